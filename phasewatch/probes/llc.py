"""Local learning coefficient (LLC) by SGLD (Lau et al. 2023; Hoogland et al. 2024, "Loss
Landscape Degeneracy Drives Stagewise Development in Transformers"), docs/reference.md:

    w <- w - (eps/2) (n beta grad L_n(w) + gamma (w - w*)) + N(0, eps)
    LLC = n beta (E[L_n(w)] - L_n(w*)),   beta = 1 / log n

`estimate_llc` (chains one after the other) and `estimate_llc_side_by_side` (one vectorised pass
for all chains; the same numbers) estimate it for any loss of a list of parameter tensors, moved
in place and put back exactly afterwards, also on failure. A chain that leaves the basin, or an
estimate above the parameter count, gives "did not converge" (`llc` None), never a number.
The `llc` probe (`llc_probe`, `model_llc`, `training_loss_llc`) applies it to the training loss;
not a default probe, it keeps its own schedule (24 log-spaced steps). Keys `llc/estimate`,
`llc/std`, `llc/converged`, `llc/drift`, `llc/loss_star`; array `trace`. `calibrate_llc` and
`recommend_step_size` choose the step size on a run's own checkpoints (bench/llc_calibration.py).
Options, defaults and the known answers the tests check: docs/llc.md.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from phasewatch.models import call_with, native_module, parameters_kept
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.errors import ConfigError

#: the one set of the llc probe's settings and their defaults, calibrated on the quickstart and
#: induction_2l runs (bench/README.md): the estimators' SGLD settings (chains ... seed) and
#: `training_loss_llc`'s own (batch_size None: minibatches of `FULL_BATCH_MINIBATCH` examples on a
#: full-batch task, the task's own batch size on a streaming one; side_by_side None: side by
#: side on a GPU or with 4 chains or more)
DEFAULTS = {"chains": 2, "draws": 200, "burn_in": 200, "step_size": 1e-4, "gamma": 300.0, "seed": 0,
            "batch_size": None, "pool": 8, "side_by_side": None}
#: a full-batch task's SGLD minibatch size when batch_size is None
FULL_BATCH_MINIBATCH = 256
#: SGLD steps between checks that the chains stay in the basin (one host sync each)
CHECK_EVERY = 25


def estimate_llc(
    loss_fn: Callable[[int], Tensor],
    params: Sequence[Tensor],
    n: int,
    *,
    loss_star: float | None = None,
    chains: int = DEFAULTS["chains"],
    draws: int = DEFAULTS["draws"],
    burn_in: int = DEFAULTS["burn_in"],
    step_size: float = DEFAULTS["step_size"],
    gamma: float = DEFAULTS["gamma"],
    beta: float | None = None,
    max_rise: float | None = None,
    seed: int = DEFAULTS["seed"],
    check_every: int = CHECK_EVERY,
) -> dict:
    """The LLC at the current values of `params` of the loss `loss_fn(t)` (an average over
    n samples, or an unbiased minibatch estimate of it at SGLD step t).

    `loss_star` is L_n(w*) (default: `loss_fn(-1)` at the start, for deterministic losses).
    The tensors in `params` are moved in place while sampling and restored exactly."""
    params = list(params)
    d = sum(p.numel() for p in params)
    nb, max_rise = _settings(n, d, chains, draws, burn_in, step_size, gamma, beta, max_rise)
    noise_of = chain_generators(seed, chains, params[0].device)
    w_star = [p.detach().clone() for p in params]
    grad_flags = [p.requires_grad for p in params]
    trace = torch.full((chains, burn_in + draws), float("nan"), dtype=torch.float64, device=params[0].device)
    converged = True
    try:
        if loss_star is None:
            with torch.no_grad():
                loss_star = float(loss_fn(-1))
        walk = _Walk(step_size, nb, gamma, float(loss_star), max_rise, check_every)
        for p in params:
            p.requires_grad_(True)
        for c in range(chains):
            if not _run_chain(loss_fn, params, w_star, noise_of[c], trace[c], walk):
                converged = False
                break
    finally:
        _put_back(params, w_star, grad_flags)
    return _result(trace, burn_in, draws, float(loss_star), nb, d, converged)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """One estimate's SGLD step (step size, n beta, the pull gamma back to w*) and its checks
    (the loss at w*, the largest rise allowed, steps between checks)."""

    step_size: float
    nb: float
    gamma: float
    loss_star: float
    max_rise: float
    check_every: int

    def step(self, w: Tensor, grad: Tensor, w_star: Tensor, noise: Tensor) -> None:
        _sgld_step(w, grad, w_star, noise, self.step_size, self.nb, self.gamma)

    def still_in_basin(self, trace: Tensor, t: int) -> bool:
        """False when a check is due after step t (every `check_every` steps, and at the last)
        and finds a chain of `trace` (chains x steps, or one chain's row) out of the basin."""
        steps = trace.shape[-1]
        due = (t + 1) % self.check_every == 0 or t == steps - 1
        return not due or _check(trace, t, self.loss_star, self.nb, self.max_rise)  # one host sync per check


def _run_chain(loss_fn: Callable[[int], Tensor], params: list[Tensor], w_star: list[Tensor],
               noise: torch.Generator, trace: Tensor, walk: _Walk) -> bool:
    """One chain of `estimate_llc` from w*, its loss at each step into `trace` (one row, as
    long as the chain); False as soon as a check finds it out of the basin."""
    with torch.no_grad():
        for p, p0 in zip(params, w_star):
            p.copy_(p0)
    for t in range(trace.shape[0]):
        with torch.enable_grad():
            loss = loss_fn(t)
            grads = torch.autograd.grad(loss, params)
        trace[t] = loss.detach()
        with torch.no_grad():
            for p, grad, p0 in zip(params, grads, w_star):
                step_noise = torch.randn(p.shape, generator=noise, device=p.device, dtype=p.dtype)
                walk.step(p, grad, p0, step_noise)
        if not walk.still_in_basin(trace, t):
            return False
    return True


def _put_back(params: list[Tensor], w_star: list[Tensor], grad_flags: list[bool]) -> None:
    """The parameters exactly as they were before sampling: values and requires_grad."""
    with torch.no_grad():
        for p, p0, flag in zip(params, w_star, grad_flags):
            p.copy_(p0)
            p.requires_grad_(flag)


def _settings(n: int, d: int, chains: int, draws: int, burn_in: int, step_size: float, gamma: float,
              beta: float | None, max_rise: float | None) -> tuple[float, float]:
    """(n beta, max_rise) with their defaults (beta = 1 / log n; max_rise = 10 d), after the
    settings are checked (ValueError naming them)."""
    if n < 2:
        raise ValueError(f"the LLC needs n >= 2 samples, got {n}")
    if chains < 1 or draws < 1 or burn_in < 0 or step_size <= 0 or gamma < 0:
        raise ValueError(f"invalid SGLD settings: chains {chains}, draws {draws}, burn_in {burn_in}, "
                         f"step_size {step_size}, gamma {gamma}")
    nb = n * (1 / math.log(n) if beta is None else beta)
    return nb, 10.0 * d if max_rise is None else max_rise


def _sgld_step(w: Tensor, grad: Tensor, w_star: Tensor, noise: Tensor, step_size: float, nb: float,
               gamma: float) -> None:
    """One SGLD step in place: w <- w - (eps/2) (n beta grad + gamma (w - w*)) + sqrt(eps) noise."""
    w.add_(-(step_size / 2) * (nb * grad + gamma * (w - w_star)) + math.sqrt(step_size) * noise)


def chain_generators(seed: int, chains: int, device) -> list[torch.Generator]:
    """One random stream per chain (chain c: seed `seed * 7919 + c`): a chain's noise is the
    same whether the chains run one after the other or side by side."""
    return [torch.Generator(device=device).manual_seed(seed * 7919 + c) for c in range(chains)]


def _check(trace: Tensor, t: int, loss_star: float, nb: float, max_rise: float) -> bool:
    """Whether every chain's draws up to step t are finite and within `max_rise` of L(w*)."""
    seen = trace[..., : t + 1]
    return bool(torch.isfinite(seen).all()) and float(seen.max() - loss_star) * nb <= max_rise


def _result(trace: Tensor, burn_in: int, draws: int, loss_star: float, nb: float, d: int, converged: bool) -> dict:
    """The estimate and its diagnostics from the chains' loss traces (chains x steps)."""
    chains = trace.shape[0]
    sampled = trace[:, burn_in:].double()
    per_chain = nb * (sampled.mean(dim=1) - loss_star)
    mean = float(per_chain.mean())
    if not converged or mean > d:
        return {"llc/converged": 0.0, "llc": None, "trace": trace.cpu(), "loss_star": loss_star}
    std = float(per_chain.std()) if chains > 1 else 0.0
    half = draws // 2
    rise = abs(float(sampled.mean()) - loss_star)
    drift = float((sampled[:, half:].mean() - sampled[:, :half].mean()).abs()) / max(rise, 1e-300) if half else 0.0
    return {"llc/converged": 1.0, "llc": mean, "llc/std": std, "llc/drift": drift, "trace": trace.cpu(),
            "loss_star": loss_star}


def estimate_llc_side_by_side(
    loss: Callable[[dict[str, Tensor], Any], Tensor],
    params: dict[str, Tensor],
    inputs_at: Callable[[int], Any],
    n: int,
    *,
    loss_star: float,
    chains: int = DEFAULTS["chains"],
    draws: int = DEFAULTS["draws"],
    burn_in: int = DEFAULTS["burn_in"],
    step_size: float = DEFAULTS["step_size"],
    gamma: float = DEFAULTS["gamma"],
    beta: float | None = None,
    max_rise: float | None = None,
    seed: int = DEFAULTS["seed"],
    check_every: int = CHECK_EVERY,
) -> dict:
    """`estimate_llc` with the chains run side by side: one vectorised forward and backward
    pass per SGLD step for all chains (`torch.func.vmap` of `grad_and_value`), instead of
    one per chain. `loss(params, inputs)` is one chain's loss as a pure function of its
    parameters (a dict of tensors, e.g. for `torch.func.functional_call`) and inputs;
    `inputs_at(t)` gives step t's inputs with a leading chain dimension. Each chain draws its
    noise from its own stream (`chain_generators`), so chain c follows the same path as
    chain c of `estimate_llc` given the same inputs, to floating-point accuracy. The tensors
    in `params` are not touched."""
    from torch.func import grad_and_value, vmap

    d = sum(p.numel() for p in params.values())
    nb, max_rise = _settings(n, d, chains, draws, burn_in, step_size, gamma, beta, max_rise)
    walk = _Walk(step_size, nb, gamma, float(loss_star), max_rise, check_every)
    w_star = {k: p.detach() for k, p in params.items()}
    device = next(iter(w_star.values())).device
    noise_of = chain_generators(seed, chains, device)
    state = {k: p.unsqueeze(0).repeat(chains, *[1] * p.dim()) for k, p in w_star.items()}
    step = vmap(grad_and_value(loss), in_dims=(0, 0))
    trace = torch.full((chains, burn_in + draws), float("nan"), dtype=torch.float64, device=device)
    converged = True
    for t in range(burn_in + draws):
        grads, values = step(state, inputs_at(t))
        trace[:, t] = values.detach()
        with torch.no_grad():
            for k, w in state.items():
                noise = torch.stack([torch.randn(w.shape[1:], generator=g, device=device, dtype=w.dtype)
                                     for g in noise_of])
                walk.step(w, grads[k], w_star[k], noise)
        if not walk.still_in_basin(trace, t):
            converged = False
            break
    return _result(trace, burn_in, draws, float(loss_star), nb, d, converged)


def training_loss_llc(model, task, **options) -> dict:
    """`estimate_llc`'s output for a model's training loss, with `options` over DEFAULTS: on
    the full training set of a full-batch task, or on a fixed pool of `pool` training batches
    (steps 0..pool-1) of a streaming one. SGLD steps use minibatches of `batch_size` examples
    drawn at random from it (full-batch tasks; chain after chain, step after step, from one
    stream) or the pool's batches in turn (streaming). With `side_by_side` the chains run as
    one vectorised population (`estimate_llc_side_by_side`), otherwise one after the other
    (`estimate_llc`): the same numbers to floating-point accuracy. Default (None): side by
    side on a GPU, or with 4 chains or more (on the CPU, 2 chains side by side are 0.9-1.0x
    as fast, 8 chains 1.25-2.2x: bench/README.md). Options beyond DEFAULTS (beta, max_rise,
    check_every) go to the estimator."""
    settings = {**DEFAULTS, **options}
    module = native_module(model)
    named = {k: p for k, p in module.named_parameters() if p.requires_grad}
    device = next(iter(named.values())).device
    chains, steps = settings["chains"], settings["burn_in"] + settings["draws"]
    if task.full_batch:
        batches, batch_at = _minibatches(task, device, settings["batch_size"], chains, steps, settings["seed"])
    else:
        batches, batch_at = _batch_pool(task, device, settings["batch_size"], settings["pool"])
    n, loss_star = _training_loss(module, task, batches)
    side_by_side = settings["side_by_side"]
    if side_by_side is None:
        side_by_side = chains >= 4 or device.type != "cpu"
    sgld = {k: v for k, v in settings.items() if k not in ("batch_size", "pool", "side_by_side")}  # the estimator's
    if side_by_side:
        return _llc_side_by_side(module, named, task, batch_at, n, loss_star, sgld)
    return _llc_chain_after_chain(module, list(named.values()), task, batch_at, n, loss_star, sgld)


def _minibatches(task, device, batch_size: int | None, chains: int, steps: int, seed: int):
    """A full-batch task's training set as the one batch of L_n, and `batch_at(t, chain)`:
    chain c's random minibatch at SGLD step t (the set itself at t < 0, or when the
    minibatch is the whole set)."""
    from phasewatch.tasks.base import Batch

    full = task.train_batch(0, None).to(device)
    size = len(full)
    if batch_size is not None and not 1 <= batch_size:
        raise ValueError(f"llc batch_size must be a positive number of examples, got {batch_size}")
    batch_size = min(FULL_BATCH_MINIBATCH if batch_size is None else batch_size, size)
    pick = torch.Generator(device=device).manual_seed(seed + 1)
    if batch_size == size:
        picks = None
    else:  # chain c's minibatch at step t: the (c * steps + t)-th draw, as the chains run one after the other
        picks = torch.stack([torch.randperm(size, generator=pick, device=device)[:batch_size]
                             for _ in range(chains * steps)]).reshape(chains, steps, batch_size)

    def batch_at(t: int, chain: int = 0):
        if t < 0 or picks is None:
            return full
        idx = picks[chain, t]
        return Batch(full.tokens[idx], full.targets[idx], full.loss_mask[idx], {})

    return [full], batch_at


def _batch_pool(task, device, batch_size: int | None, pool: int):
    """A streaming task's `pool` training batches (steps 0..pool-1) as L_n, and
    `batch_at(t, chain)`: the pool's batches in turn, the same for every chain."""
    if pool < 1:
        raise ValueError(f"llc pool must be at least one batch, got {pool}")
    batches = [task.train_batch(i, batch_size).to(device) for i in range(pool)]

    def batch_at(t: int, chain: int = 0):
        return batches[t % len(batches)]

    return batches, batch_at


def _training_loss(module, task, batches: list) -> tuple[int, float]:
    """(n, L_n(w*)): the number of predictions in `batches` and their mean loss."""
    from phasewatch.tasks.base import masked_loss

    counts = [int(b.loss_mask.sum()) for b in batches]
    n = sum(counts)
    with torch.no_grad():
        loss_star = sum(float(masked_loss(module(b.tokens), b, task.loss_dtype)) * k for b, k in zip(batches, counts)) / n
    return n, loss_star


def _llc_side_by_side(module, named: dict[str, Tensor], task, batch_at, n: int, loss_star: float,
                      sgld: dict[str, Any]) -> dict:
    """`estimate_llc_side_by_side` of the module's loss on `batch_at`'s batches."""
    from phasewatch.tasks.base import Batch, masked_mean_loss

    chains = sgld["chains"]

    def loss(p: dict[str, Tensor], inputs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        tokens, targets, mask = inputs
        return masked_mean_loss(call_with(module, p, (tokens,)), Batch(tokens, targets, mask), task.loss_dtype)

    def inputs_at(t: int) -> tuple[Tensor, Tensor, Tensor]:
        per_chain = [batch_at(t, c) for c in range(chains)]
        return tuple(torch.stack([getattr(b, f) for b in per_chain]) for f in ("tokens", "targets", "loss_mask"))

    with parameters_kept(module):
        return estimate_llc_side_by_side(loss, named, inputs_at, n, loss_star=loss_star, **sgld)


def _llc_chain_after_chain(module, params: list[Tensor], task, batch_at, n: int, loss_star: float,
                           sgld: dict[str, Any]) -> dict:
    """`estimate_llc` of the module's loss on `batch_at`'s batches, each chain from step 0."""
    from phasewatch.tasks.base import masked_loss

    chain = {"c": -1}

    def loss_fn(t: int) -> Tensor:
        if t == 0:
            chain["c"] += 1  # estimate_llc runs chain after chain, each from step 0
        batch = batch_at(t, max(chain["c"], 0))
        return masked_loss(module(batch.tokens), batch, task.loss_dtype)

    return estimate_llc(loss_fn, params, n, loss_star=loss_star, **sgld)


def model_llc(model, task, **options) -> dict:
    """The `llc` probe's values: `training_loss_llc` (DEFAULTS for the settings not given) as
    metric keys, and the trace."""
    out = training_loss_llc(model, task, **options)
    result = {"llc/converged": out["llc/converged"], "llc/loss_star": float(out["loss_star"]), "trace": out["trace"]}
    if out["llc"] is not None:
        result.update({"llc/estimate": out["llc"], "llc/std": out["llc/std"], "llc/drift": out["llc/drift"]})
    return result


KEYS = KeyFamilies(
    detail=r"^llc/(std|converged|drift|loss_star)$",  # diagnostics (the estimate stays)
    panels=(Panel("local learning coefficient (SGLD estimate)", ("llc/estimate",)),),
    hidden=("llc/",),
)


@register_probe("llc", applies_to=lambda task: True, default=False, schedule={"kind": "log", "count": 24}, keys=KEYS)
def llc_probe(model, task, **options) -> dict:
    """`model_llc`; options: chains, draws, burn_in, step_size, gamma, batch_size, pool, seed,
    side_by_side (defaults in DEFAULTS; side_by_side: on a GPU or with 4+ chains)."""
    if "step_size" not in options:
        # shown once per process: the default is calibrated on two configs, not on every model
        warnings.warn(f"llc: no step size given; the default SGLD step size {DEFAULTS['step_size']:g} was calibrated "
                      "on configs/quickstart.yaml and induction_2l.yaml only; on another model a too-large step inflates "
                      "the LLC (2x on the paper's grokking config). Check it on this run's checkpoints with "
                      "bench/llc_calibration.py and set probes.options.llc.step_size (docs/llc.md).", stacklevel=2)
    try:
        return model_llc(model, task, **options)
    except ValueError as err:
        raise ConfigError("probes.options.llc", str(err), "Give positive chains, draws, step_size and batch_size, "
                          "burn_in >= 0, gamma >= 0 (see bench/README.md for calibrated values).") from err


def calibrate_llc(model, task, step_sizes: Sequence[float] = (3e-5, 1e-4, 3e-4), **kwargs) -> list[dict]:
    """`training_loss_llc` at each SGLD step size (other settings from kwargs, DEFAULTS
    otherwise), with its drift diagnostic.

    How to choose: the largest step size that converges with small drift (< 0.1) and
    whose estimate agrees with the next smaller step size's; too small a step does not
    leave w* within the draws (the estimate grows with the step size), too large a step
    diverges ("did not converge") or drifts."""
    rows = []
    for eps in step_sizes:
        out = training_loss_llc(model, task, **{**kwargs, "step_size": eps})
        rows.append({"step_size": eps, "converged": bool(out["llc/converged"]), "llc": out["llc"],
                     "std": out.get("llc/std"), "drift": out.get("llc/drift")})
    return rows


def recommend_step_size(rows: list[dict], max_drift: float = 0.1, agree: float = 0.25) -> float | None:
    """The largest calibrated step size that converged, drifted less than `max_drift`
    and whose estimate is within `agree` (relative) of the next smaller one's."""
    ok = [r for r in rows if r["converged"] and r["drift"] is not None and r["drift"] < max_drift and r["llc"] > 0]
    ok.sort(key=lambda r: r["step_size"])
    best = None
    for smaller, larger in zip(ok, ok[1:]):
        if abs(larger["llc"] - smaller["llc"]) <= agree * abs(smaller["llc"]):
            best = larger["step_size"]
    return best

"""Local learning coefficient (LLC) by SGLD (Lau et al. 2023; Hoogland et al. 2024, "Loss
Landscape Degeneracy Drives Stagewise Development in Transformers"), REFERENCE.md:

    w <- w - (eps/2) (n beta grad L_n(w) + gamma (w - w*)) + N(0, eps)
    LLC = n beta (E[L_n(w)] - L_n(w*)),   beta = 1 / log n

`estimate_llc` is the estimator for any loss of a list of parameter tensors; chains are
independent and run one after the other. It reports "did not converge" (`converged`
False, `llc` None) instead of a number when a chain's loss becomes non-finite or runs
away (more than `max_rise` x n beta above the start), and returns the loss traces for
diagnostics. Known answers (tests/unit/test_llc.py): the potentials w^2, w^4, w^6 give
1/2, 1/4, 1/6; a d-dimensional quadratic gives d/2.

The `llc` probe applies it to a model's training loss on the task's training batch; it
costs chains x (burn_in + draws) forward and backward passes, so it is not a default
probe: ask for it with `--probes.names '[llc, ...]'` and give it a sparse schedule.
Keys: `llc/estimate`, `llc/std` (across chains), `llc/converged`; array `trace`.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from phasewatch.probes.registry import register_probe


def estimate_llc(
    loss_fn: Callable[[Sequence[Tensor]], Tensor],
    params: Sequence[Tensor],
    n: int,
    *,
    chains: int = 4,
    draws: int = 200,
    burn_in: int = 100,
    step_size: float = 1e-4,
    gamma: float = 100.0,
    beta: float | None = None,
    max_rise: float = 1e3,
    seed: int = 0,
) -> dict:
    """The LLC at `params` of the loss `loss_fn(params)` (an average over n samples)."""
    if n < 2:
        raise ValueError(f"the LLC needs n >= 2 samples, got {n}")
    beta = 1 / math.log(n) if beta is None else beta
    nb = n * beta
    g = torch.Generator().manual_seed(seed)
    w_star = [p.detach().clone() for p in params]
    with torch.no_grad():
        l_star = float(loss_fn(w_star))
    traces, converged = [], True
    for _ in range(chains):
        w = [p.clone().requires_grad_(True) for p in w_star]
        trace = []
        for t in range(burn_in + draws):
            loss = loss_fn(w)
            grads = torch.autograd.grad(loss, w)
            value = float(loss.detach())
            if not math.isfinite(value) or (value - l_star) * nb > max_rise:
                converged = False
                break
            with torch.no_grad():
                for p, grad, p0 in zip(w, grads, w_star):
                    noise = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
                    p.add_(-(step_size / 2) * (nb * grad + gamma * (p - p0)) + math.sqrt(step_size) * noise)
            if t >= burn_in:
                trace.append(value)
        traces.append(trace)
        if not converged:
            break
    if not converged:
        return {"llc/converged": 0.0, "llc": None, "trace": traces}
    per_chain = [nb * (sum(tr) / len(tr) - l_star) for tr in traces]
    mean = sum(per_chain) / len(per_chain)
    std = math.sqrt(sum((x - mean) ** 2 for x in per_chain) / max(len(per_chain) - 1, 1))
    return {"llc/converged": 1.0, "llc": mean, "llc/std": std, "trace": torch.tensor(traces), "loss_star": l_star}


def training_loss_llc(model, task, **kwargs) -> dict:
    """`estimate_llc`'s output for a model's training loss on the task's training batch
    (the whole set for full-batch tasks, the batch of step 0 for streaming ones)."""
    from torch.func import functional_call

    from phasewatch.tasks.base import masked_loss

    module = getattr(model, "original_model", model)
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    params = dict(module.named_parameters())
    batch = task.train_batch(0, None)
    device = next(module.parameters()).device
    batch = type(batch)(batch.tokens.to(device), batch.targets.to(device), batch.loss_mask.to(device), batch.extras)

    def loss_fn(ws):
        logits = functional_call(module, {**params, **dict(zip(names, ws))}, (batch.tokens,))
        return masked_loss(logits, batch, task.loss_dtype)

    with torch.enable_grad():
        return estimate_llc(loss_fn, [params[k] for k in names], int(batch.loss_mask.sum()), **kwargs)


def model_llc(model, task, **kwargs) -> dict:
    """The `llc` probe's values: `training_loss_llc` as metric keys and the trace."""
    out = training_loss_llc(model, task, **kwargs)
    result = {"llc/converged": out["llc/converged"], "trace": out["trace"]}
    if out["llc"] is not None:
        result.update({"llc/estimate": out["llc"], "llc/std": out["llc/std"]})
    return result


@register_probe("llc", applies_to=lambda task: True, default=False)
def llc_probe(model, task, **options) -> dict:
    """`model_llc`; options: chains, draws, burn_in, step_size, gamma, seed."""
    return model_llc(model, task, **options)


def calibrate_llc(model, task, step_sizes: Sequence[float] = (1e-7, 3e-7, 1e-6, 3e-6, 1e-5, 3e-5), **kwargs) -> list[dict]:
    """`training_loss_llc` at each SGLD step size (other settings from kwargs), with a drift
    diagnostic per step size: how far the chains' mean loss still moves between the
    first and the second half of the draws, relative to its rise above L(w*) (near 0
    for a chain that has settled, as the estimator assumes).

    How to choose: the largest step size that converges with small drift (< 0.1) and
    whose estimate agrees with the next smaller step size's; too small a step does not
    leave w* within the draws (the estimate grows with the step size), too large a step
    diverges ("did not converge") or drifts."""
    rows = []
    for eps in step_sizes:
        out = training_loss_llc(model, task, step_size=eps, **kwargs)
        row = {"step_size": eps, "converged": bool(out["llc/converged"]), "llc": out["llc"],
               "std": out.get("llc/std"), "drift": None}
        if row["converged"]:
            trace = out["trace"].double()
            half = trace.shape[1] // 2
            rise = (trace.mean() - out["loss_star"]).abs().clamp_min(1e-300)
            row["drift"] = float((trace[:, half:].mean() - trace[:, :half].mean()).abs() / rise)
        rows.append(row)
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

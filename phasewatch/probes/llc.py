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
    return {"llc/converged": 1.0, "llc": mean, "llc/std": std, "trace": torch.tensor(traces)}


def model_llc(model, task, **kwargs) -> dict:
    """`estimate_llc` of a model's training loss on the task's training batch (the whole
    set for full-batch tasks, the batch of step 0 for streaming ones)."""
    import torch.nn.functional as F
    from torch.func import functional_call

    module = getattr(model, "original_model", model)
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    params = dict(module.named_parameters())
    batch = task.train_batch(0, None)
    device = next(module.parameters()).device
    tokens, targets, mask = batch.tokens.to(device), batch.targets.to(device), batch.loss_mask.to(device)

    def loss_fn(ws):
        overrides = {**params, **dict(zip(names, ws))}
        logits = functional_call(module, overrides, (tokens,))
        return F.cross_entropy(logits[mask].to(task.loss_dtype), targets[mask])

    with torch.enable_grad():
        out = estimate_llc(loss_fn, [params[k] for k in names], int(mask.sum()), **kwargs)
    result = {"llc/converged": out["llc/converged"], "trace": out["trace"]}
    if out["llc"] is not None:
        result.update({"llc/estimate": out["llc"], "llc/std": out["llc/std"]})
    return result


@register_probe("llc", applies_to=lambda task: True, default=False)
def llc_probe(model, task, **options) -> dict:
    """`model_llc`; options: chains, draws, burn_in, step_size, gamma, seed."""
    return model_llc(model, task, **options)

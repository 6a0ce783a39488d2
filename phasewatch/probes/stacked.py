"""Probes over a population's members at once. A function here takes a template module (one
member's architecture), every member's parameters stacked along a leading member dimension
(`params`, as `torch.func.functional_call` names them), the members' own models (for what
reads weights directly) and the task, and returns each member's values: the probe's values
on that member alone, to float rounding (the forward pass is one `torch.func.vmap` over the
members instead of one pass each). `STACKED` names the probes that have such a form; every
other probe runs member by member. Pure: weights in, numbers out."""

from __future__ import annotations

from typing import Any, Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from phasewatch.models import parameters_kept
from phasewatch.probes.grokking import CHUNK, check_key_freqs, grid_inputs, progress_measures

#: members in one vectorised pass (each over `CHUNK` inputs), to bound its memory
MEMBERS_PER_PASS = 16


def stacked_last_logits(template: torch.nn.Module, params: dict[str, Tensor], tokens: Int[Tensor, "rows seq"],
                        classes: int) -> Float[Tensor, "n rows classes"]:
    """Every member's logits at the last position of `tokens` (the same inputs for every
    member) over the first `classes` classes, float64 on the CPU, without gradients."""
    from torch.func import functional_call, vmap

    def one(member: dict[str, Tensor], chunk: Tensor) -> Tensor:
        return functional_call(template, member, (chunk,))[:, -1, :classes].double()

    def group(members: dict[str, Tensor]) -> Tensor:
        size = next(iter(members.values())).shape[0]
        if size == 1:  # a stack of one rounds otherwise than larger ones (`vectorised_outputs`): run it as two
            members = {name: torch.cat([p, p]) for name, p in members.items()}
        out = torch.cat([vmap(one, in_dims=(0, None))(members, chunk) for chunk in tokens.split(CHUNK)], dim=1)
        return out[:size]

    n = next(iter(params.values())).shape[0]
    tokens = tokens.to(next(iter(params.values())).device)
    was_training = template.training
    template.eval()
    try:
        with torch.no_grad(), parameters_kept(template):
            return torch.cat([group({name: p[start:start + MEMBERS_PER_PASS] for name, p in params.items()})
                              for start in range(0, n, MEMBERS_PER_PASS)]).cpu()
    finally:
        template.train(was_training)


def grokking_stacked(template: torch.nn.Module, params: dict[str, Tensor], models: list, task,
                     key_freqs: list[int] | None = None) -> list[dict[str, Any]]:
    """The grokking probe (`probes.grokking.grokking_probe`) of every member: the logits of
    all p^2 inputs for the members at once, the rest of `progress_measures` member by member."""
    p, freqs = task.p, check_key_freqs(key_freqs, task.p)
    logits = stacked_last_logits(template, params, grid_inputs(task), p).reshape(-1, p, p, p)
    return [progress_measures(model, task, freqs, logits=own) for model, own in zip(models, logits)]


#: probe name -> its form over stacked weights: (template, params, models, task, **options) -> values per member
STACKED: dict[str, Callable[..., list[dict[str, Any]]]] = {"grokking": grokking_stacked}

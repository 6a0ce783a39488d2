"""Probes over a population's members at once. A function here takes a template module (one
member's architecture), every member's parameters stacked along a leading member dimension
(`params`, as `torch.func.functional_call` names them), the members' own models (for what
reads weights directly) and the task, and returns each member's values: the probe's values
on that member alone, to float rounding (one `torch.func.vmap` over the members does the
tensor work of all of them). `STACKED` names the probes that have such a form (grokking:
the logits of every input; composition: the Q/K/V scores); every other probe runs member by
member. Pure: weights in, numbers out."""

from __future__ import annotations

from typing import Any, Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from phasewatch.models import parameters_kept
from phasewatch.probes.composition import COMPOSE_FACTOR, composition_probe_values, head_weights, scores_of_weights
from phasewatch.probes.grokking import check_key_freqs, grid_inputs, progress_measures

#: members in one vectorised pass, and inputs per pass: small enough that a pass stays in the
#: CPU's caches (on the quickstart 4 x 1,024 runs as fast as member by member, 16 x 4,096 half as
#: fast); a member's inputs are split alike whatever the number of members (a replay alone rounds alike)
MEMBERS_PER_PASS = 4
ROWS = 1024


def _one_as_two(stacked: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """A stack of one member doubled (a stack of one rounds otherwise than larger ones in
    PyTorch's batched kernels: `training.module.vectorised_outputs`), and the members' count."""
    size = next(iter(stacked.values())).shape[0]
    return ({name: torch.cat([p, p]) for name, p in stacked.items()} if size == 1 else stacked), size


def stacked_last_logits(template: torch.nn.Module, params: dict[str, Tensor], tokens: Int[Tensor, "rows seq"],
                        classes: int) -> Float[Tensor, "n rows classes"]:
    """Every member's logits at the last position of `tokens` (the same inputs for every
    member) over the first `classes` classes, float64 on the CPU, without gradients."""
    from torch.func import functional_call, vmap

    def one(member: dict[str, Tensor], chunk: Tensor) -> Tensor:
        return functional_call(template, member, (chunk,))[:, -1, :classes].double()

    def group(members: dict[str, Tensor]) -> Tensor:
        members, size = _one_as_two(members)
        out = torch.cat([vmap(one, in_dims=(0, None))(members, chunk) for chunk in tokens.split(ROWS)], dim=1)
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
    all p^2 inputs for `MEMBERS_PER_PASS` members at once (p^3 float64 each, so a group at a
    time), the rest of `progress_measures` member by member."""
    p, freqs, tokens, out = task.p, check_key_freqs(key_freqs, task.p), grid_inputs(task), []
    for start in range(0, len(models), MEMBERS_PER_PASS):
        group = {name: w[start:start + MEMBERS_PER_PASS] for name, w in params.items()}
        logits = stacked_last_logits(template, group, tokens, p).reshape(-1, p, p, p)
        out += [progress_measures(model, task, freqs, logits=own)
                for model, own in zip(models[start:start + MEMBERS_PER_PASS], logits)]
    return out


def composition_stacked(template: torch.nn.Module, params: dict[str, Tensor], models: list, task,
                        factor: float = COMPOSE_FACTOR) -> list[dict[str, Any]]:
    """The composition probe (`probes.composition.composition_probe`) of every member: the
    Q/K/V scores of all members in one vmapped pass, the keys and pairs member by member."""
    from torch.func import vmap

    weights = [head_weights(model) for model in models]
    stacked, size = _one_as_two({name: torch.stack([w[name] for w in weights]) for name in weights[0]})
    scores = vmap(scores_of_weights)(stacked)
    return [composition_probe_values(model, factor, {kind: s[k] for kind, s in scores.items()})
            for k, model in enumerate(models[:size])]


#: probe name -> its form over stacked weights: (template, params, models, task, **options) -> values per member
STACKED: dict[str, Callable[..., list[dict[str, Any]]]] = {"grokking": grokking_stacked,
                                                           "composition": composition_stacked}

"""Probes over a population's members at once. A function here takes a template module (one
member's architecture), every member's parameters stacked along a leading member dimension
(`params`, as `torch.func.functional_call` names them), the members' own models (for what
reads weights directly) and the task, and returns each member's values: the probe's values
on that member alone, to float rounding (one `torch.func.vmap` over the members does the
tensor work of all of them), or None where it has no such form for that model. `STACKED`
names the probes that have one (grokking: the logits of every input; composition: the Q/K/V
scores; heads: the forward pass on repeated tokens, read through hooks on a TransformerLens
native model's attention); every other probe runs member by member. Pure: weights in, numbers out."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from phasewatch.models import call_with, native_module, parameters_kept
from phasewatch.probes.composition import (COMPOSE_FACTOR, _ln1_scale, composition_probe_values, head_weights,
                                           scores_of_weights)
from phasewatch.probes.grokking import check_key_freqs, grid_inputs, progress_measures
from phasewatch.probes.heads import _Weights, forward_scores, head_probe_values, head_tokens, weight_scores

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


def stacked_forward(template: torch.nn.Module, params: dict[str, Tensor], tokens: Int[Tensor, "rows seq"],
                    read: Callable[[Tensor, Tensor], Any]) -> list:
    """`read(logits, chunk)` of every member (vmapped: its tensors gain a leading member
    dimension) on `tokens` (the same inputs for every member) in chunks of `ROWS` rows,
    `MEMBERS_PER_PASS` members a pass, in eval mode without gradients: one list per pass, of
    one result per chunk. `read` may call `captured()`: what the hooks registered on the
    template while it runs took (`capture`)."""
    from torch.func import vmap

    def one(member: dict[str, Tensor], chunk: Tensor):
        _CAPTURED.clear()
        return read(call_with(template, member, (chunk,)), chunk)

    def group(members: dict[str, Tensor]) -> list:
        members, size = _one_as_two(members)
        return [_first(vmap(one, in_dims=(0, None))(members, chunk), size) for chunk in tokens.split(ROWS)]

    n = next(iter(params.values())).shape[0]
    tokens = tokens.to(next(iter(params.values())).device)
    was_training = template.training
    template.eval()
    try:
        with torch.no_grad(), parameters_kept(template):
            return [group({name: p[start:start + MEMBERS_PER_PASS] for name, p in params.items()})
                    for start in range(0, n, MEMBERS_PER_PASS)]
    finally:
        template.train(was_training)


def _first(tree, size: int):
    """Every tensor of `tree` (dicts, lists, tuples) cut to its first `size` members."""
    if isinstance(tree, dict):
        return {k: _first(v, size) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_first(v, size) for v in tree)
    return tree[:size]


_CAPTURED: list[Tensor] = []


def captured() -> list[Tensor]:
    """What the hooks of `capture` took in the member's forward pass now running."""
    return list(_CAPTURED)


@contextlib.contextmanager
def capture(modules: list[torch.nn.Module], pick: Callable[[Any], Tensor]):
    """While the block runs, `pick(output)` of each of `modules`' forward passes is kept, in
    the order they run, for `captured()` (a forward hook: under vmap the batched tensor)."""
    handles = [m.register_forward_hook(lambda module, args, output: _CAPTURED.append(pick(output))) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        _CAPTURED.clear()


def stacked_last_logits(template: torch.nn.Module, params: dict[str, Tensor], tokens: Int[Tensor, "rows seq"],
                        classes: int) -> Float[Tensor, "n rows classes"]:
    """Every member's logits at the last position of `tokens` (the same inputs for every
    member) over the first `classes` classes, float64 on the CPU, without gradients."""
    passes = stacked_forward(template, params, tokens, lambda logits, chunk: logits[:, -1, :classes].double())
    return torch.cat([torch.cat(chunks, dim=1) for chunks in passes]).cpu()


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


class _Reader(torch.nn.Module):
    """`read(model)` as a module's forward, for `torch.func.functional_call` with other weights."""

    def __init__(self, model: torch.nn.Module, read: Callable[[Any], dict[str, Tensor]]):
        super().__init__()
        self.model, self.read = model, read

    def forward(self) -> dict[str, Tensor]:
        return self.read(self.model)


def stacked_reads(models: list, params: dict[str, Tensor], read: Callable[[Any], dict[str, Tensor]]
                  ) -> dict[str, Tensor]:
    """`read(model)` (weight matrices as the model shows them, e.g. `heads._Weights`) of every
    member, stacked: read once, through the first member's model with each member's parameters
    (`params`, named as the members' native module names them) under one vmap, instead of
    member by member (a bridge's accessors stack and reshape every block's weights at each
    call). The same numbers, each member's own weights copied or reshaped as `read` does,
    where `read`'s accessors read the parameters `torch.func.functional_call` swaps in: members
    that differ from the first in every parameter any member differs in (`_witnesses`, mostly
    the last member alone) are read alone too, and any difference means member by member (a
    bridge's LayerNorm scale accessor, for one, keeps showing the first member's). Member by
    member, too, where the model's parameters are not all among `params`."""
    from torch.func import functional_call, vmap

    def each() -> dict[str, Tensor]:
        reads = [read(m) for m in models]
        return {key: torch.stack([r[key] for r in reads]) for key in reads[0]}

    model = models[0]
    native = {id(p): name for name, p in native_module(model).named_parameters()} if params else {}
    names = {name: native.get(id(p)) for name, p in model.named_parameters()}
    if not names or not all(n in params for n in names.values()):
        return each()
    stacked, size = _one_as_two({f"model.{name}": params[own] for name, own in names.items()})
    reader = _Reader(model, read)
    with torch.no_grad():
        together = _first(vmap(lambda member: functional_call(reader, member, ()))(stacked), size)
    for k in _witnesses([params[n][:size] for n in names.values()]):  # does `read` see them swapped in?
        alone = read(models[k])
        if set(alone) != set(together) or not all(torch.equal(together[key][k], v) for key, v in alone.items()):
            return each()
    return together


def _witnesses(stacks: list[Tensor]) -> list[int]:
    """Members to read alone to learn whether a read sees each member's parameters (`stacks`,
    member first): together, they differ from the first member in every parameter that any
    member differs in (a read showing the first member's parameter is right for a member
    whose parameter equals it, and shows itself only on one whose differs); the last
    members first, each only for what the ones before leave uncovered."""
    differs = [(p != p[:1]).reshape(len(p), -1).any(1).tolist() for p in stacks]
    left, out = {i for i, d in enumerate(differs) if any(d)}, []
    for k in range(len(stacks[0]) - 1, 0, -1) if stacks else ():
        if not left:
            break
        if covered := {i for i in left if differs[i][k]}:
            out.append(k)
            left -= covered
    return out


def composition_stacked(template: torch.nn.Module, params: dict[str, Tensor], models: list, task,
                        factor: float = COMPOSE_FACTOR) -> list[dict[str, Any]]:
    """The composition probe (`probes.composition.composition_probe`) of every member: the
    Q/K/V scores of all members in one vmapped pass, the keys and pairs member by member. The
    weights (`head_weights`) read once over the stacked parameters (`stacked_reads`) where no
    block has a LayerNorm scale to fold (a bridge's scale accessor shows the first member's
    under swapped parameters: `stacked_reads` would find it and read member by member anyway)."""
    from torch.func import vmap

    if any(_ln1_scale(models[0], layer) is not None for layer in range(models[0].cfg.n_layers)):
        weights = [head_weights(model) for model in models]
        weights = {name: torch.stack([w[name] for w in weights]) for name in weights[0]}
    else:
        weights = stacked_reads(models, params, head_weights)
    stacked, size = _one_as_two(weights)
    scores = vmap(scores_of_weights)(stacked)
    shape = tuple(weights["W_Q"].shape[-2:])  # (d_model, d_head), as each member's W_Q shows it
    return [composition_probe_values(model, factor, {kind: s[k] for kind, s in scores.items()}, shape)
            for k, model in enumerate(models[:size])]


def _attention_layers(template: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The attention modules of a TransformerLens native model, each returning (output,
    pattern); None for any other module (its probes then run member by member)."""
    layers = getattr(template, "layers", None)
    attns = [getattr(layer, "attn", None) for layer in layers or []]
    return attns if attns and all(getattr(a, "accepts_pattern_fn", False) for a in attns) else None


def heads_stacked(template: torch.nn.Module, params: dict[str, Tensor], models: list, task,
                  thresholds: dict[str, float] | None = None) -> list[dict[str, Any]] | None:
    """The heads probe (`probes.heads.heads_probe`) of every member: the forward pass on the
    repeated tokens and the scores read from it (attention patterns, copy losses) vmapped over
    the members, `MEMBERS_PER_PASS` at a time; the weights' scores (`weight_scores`) of all of
    them in one vmapped call (each member's equal to its own, bit for bit: tests/unit/
    test_stacked_probes.py); the keys member by member. None where the template is not a
    native model whose attention patterns can be read."""
    from torch.func import vmap

    attns = _attention_layers(template)
    if attns is None:
        return None
    tokens, rep_len = head_tokens(task.vocab_size, task.n_ctx, task.bos)
    with capture(attns, lambda output: output[1]):
        passes = stacked_forward(template, params, tokens, lambda logits, chunk: forward_scores(
            logits, captured(), chunk, rep_len))
    reads = [{k: v[i] for k, v in chunk.items()} for (chunk,) in passes for i in range(len(chunk["first"]))]
    stacked, size = _one_as_two(stacked_reads(models, params, lambda model: _Weights(model).tensors()))
    with torch.no_grad():
        weighed = vmap(lambda w: weight_scores(_Weights(tensors=w)))(stacked)
    return [head_probe_values(model, task.vocab_size, task.bos, task.n_ctx, thresholds, read=own,
                              weighed={kind: s[k] for kind, s in weighed.items()})
            for k, (model, own) in enumerate(zip(models[:size], reads))]


#: probe name -> its form over stacked weights: (template, params, models, task, **options) -> values per member
STACKED: dict[str, Callable[..., list[dict[str, Any]]]] = {"grokking": grokking_stacked,
                                                           "composition": composition_stacked,
                                                           "heads": heads_stacked}

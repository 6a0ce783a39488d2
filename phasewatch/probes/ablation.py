"""Ablations: which heads and layers does the model need right now?

For every attention head, every layer's attention output and every MLP output: the task's
held-out loss and accuracy with that component replaced by its mean output at each position
over the held-out set (mean ablation; "zero" replaces it by zeros), the rest intact. On a
schedule it shows when each component becomes necessary (Olsson et al. 2022 ablate heads over
training the same way). Estimated from a fixed weighted sample of held-out sequences from every
length (64; means from 256), token by token as `val/loss`, with the same numbers as one full
hooked pass per component (hooks on the model, e.g. an intervention's, act on the copies too).

Keys: `ablation/<component>/loss_delta` (ablated minus clean loss, nats per answer token) and
`ablation/<component>/acc`, <component> `L<l>H<h>` (through `hook_z`), `L<l>.attn` or `L<l>.mlp`;
array `necessary_components` (accuracy cost above `threshold`). Public: `ablation_probe`,
`ablation_scores`, `components`, `position_means`, the samplers. docs/tracr.md, "ablation".
"""

from __future__ import annotations

import re

from typing import Any

import torch

from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.probes.residual import ResidualPass
from phasewatch.models import native_module
from phasewatch.tasks.base import Batch, Task, padded, spread_index

MODES = ("mean", "zero")


def components(model) -> list[tuple[str, str, int | None]]:
    """(label, hook name, head index or None) of every ablatable component."""
    cfg = model.cfg
    out: list[tuple[str, str, int | None]] = []
    for layer in range(cfg.n_layers):
        out += [(f"L{layer}H{h}", f"blocks.{layer}.attn.hook_z", h) for h in range(cfg.n_heads)]
        out.append((f"L{layer}.attn", f"blocks.{layer}.hook_attn_out", None))
        if not cfg.attn_only:
            out.append((f"L{layer}.mlp", f"blocks.{layer}.hook_mlp_out", None))
    return out


def position_means(model, batches, names: set[str], weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Each hook's mean output at each position over every held-out sequence that has
    that position, a sequence of batch i weighing `weights[i]` (1 when None: a sample's
    weights make its means estimates of the whole set's). Over the whole held-out set,
    not per batch: a RASP task's batches hold one length each, and a per-batch mean would
    keep the length (and everything computed from it) intact. One forward pass of the
    native module on the batches padded to one (`padded`), keeping each output as it leaves its
    module, before any hook already on it, as the bridge's hooks cache it (`_Clean.means`)."""
    device = next(model.parameters()).device
    return _clean_pass(native_module(model), batches, device).means(names, _row_weights(batches, weights).to(device))


def _clean_pass(native, batches, device) -> "_Clean":
    """`_Clean` of the batches padded to one (`padded`), on `device`."""
    joined, mask = padded(batches)
    return _Clean(native, joined.tokens.to(device), None if mask is None else mask.to(device))


def _row_weights(batches, weights: list[float] | None) -> torch.Tensor:
    """One weight per sequence of the batches joined (`weights[i]` for batch i; 1 when None)."""
    weights = weights or [1.0] * len(batches)
    return torch.cat([torch.full((len(b),), float(w), dtype=torch.float64) for b, w in zip(batches, weights)])


def sample_weights(batches, sample) -> list[float]:
    """How many sequences of its batch each sampled sequence stands for: with them, sums
    over a sample (`proportional_sample`) estimate the whole set's."""
    return [len(b) / len(s) for b, s in zip(batches, sample)]


def proportional_sample(batches, total: int | None) -> list:
    """About `total` sequences of the batches, the same share of each (at least one of each,
    spread evenly over it); all of them when `total` is None or they hold no more."""
    counts = _shares(batches, total)
    return batches if counts == [len(b) for b in batches] else [b.spread(n) for b, n in zip(batches, counts)]


def _shares(batches, total: int | None) -> list[int]:
    """How many sequences of each batch `proportional_sample` draws."""
    size = sum(len(b) for b in batches)
    if total is None or total >= size:
        return [len(b) for b in batches]
    return [max(1, round(len(b) * total / size)) for b in batches]


def nested_sample(batches, drawn: list, total: int | None) -> list[torch.Tensor] | None:
    """The rows, within each batch of `drawn` (a `proportional_sample` of the batches), of a
    sample of `total` drawn from `drawn` itself: as many of each batch as
    `proportional_sample(batches, total)` draws, spread evenly over `drawn`'s; None when `drawn`
    holds fewer. One pass over `drawn` then serves both samples."""
    counts = _shares(batches, total)
    if any(n > len(d) for n, d in zip(counts, drawn)):
        return None
    return [spread_index(len(d), n) for d, n in zip(drawn, counts)]


class _Clean(ResidualPass):
    """The clean pass of the native model on a batch (`ResidualPass`: the residual stream into
    each block, `pre`; each attention layer's output after any hook on the attention module,
    `attn`; the stream after it, `mid`; the heads' outputs before W_O, `z`), from which each
    layer's ablated copies start."""

    def __init__(self, native, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        super().__init__(native, tokens, mask, outputs=True)

    def means(self, names: set[str], row: torch.Tensor) -> dict[str, torch.Tensor]:
        """`position_means` of this pass's sequences, sequence i weighing `row[i]`: each hook's
        output (`blocks.<l>.attn.hook_z` [pos, head, d_head], `hook_attn_out`, `hook_mlp_out`
        [pos, d_model]) averaged at each position over the sequences that have it, padded
        with zeros to n_ctx positions."""
        has = (torch.ones(self.pre[0].shape[:2], device=row.device) if self.mask is None else self.mask
               ).double() * row[:, None]  # [batch, pos]
        n_ctx, n_heads = self.native.cfg.n_ctx, self.native.cfg.n_heads
        counts = torch.zeros(n_ctx, dtype=torch.float64, device=row.device)
        counts[:has.shape[1]] = has.sum(0)
        out = {}
        for name in names:
            parts = name.split(".")
            layer, kind = int(parts[1]), parts[-1]
            if kind == "hook_z":
                value = self.z[layer].unflatten(-1, (n_heads, -1))
            else:
                value = (self.attn_out if kind == "hook_attn_out" else self.mlp_out)[layer]
            total = torch.einsum("bp,bp...->p...", has, value.double())
            sums = torch.zeros((n_ctx, *total.shape[1:]), dtype=torch.float64, device=row.device)
            sums[:has.shape[1]] = total
            out[name] = (sums / counts.clamp_min(1e-12).reshape(-1, *[1] * (sums.dim() - 1))).float()
        return out

    def _inputs(self, hidden: torch.Tensor, copies: int) -> dict[str, torch.Tensor]:
        """A block's keyword arguments for `copies` copies of the batch."""
        size, n_pos = hidden.shape[:2]
        return {"attention_mask": None if self.mask is None else self.mask.repeat(copies, 1),
                "position_ids": torch.arange(n_pos, device=hidden.device).unsqueeze(0).expand(size, -1)}

    def ablated(self, layer: int, kind: str, values: list[tuple[int | None, torch.Tensor | float]]) -> torch.Tensor:
        """Layer `layer`'s attention (`kind` "attn") or MLP ("mlp") output for one copy of the
        batch per (head, value) of `values`: the module runs again on the copies, from the
        clean stream into it, with the copy's head output before W_O (hook_z; head None: the
        module's whole output) replaced by the value. Hooks already on the model (an
        intervention's) act as in a pass through the bridge's hooks: on a whole output after
        the replacement, on a head's before it. Without a hook on the module the copies'
        outputs come from the clean pass (`_replaced`) and the module does not run again."""
        block = self.native.layers[layer]
        module = block.attn if kind == "attn" else block.mlp
        if not hooked(module):
            return self._replaced(layer, kind, values)
        size, copies = self.pre[layer].shape[0], len(values)

        def rows(i: int) -> slice:
            return slice(i * size, (i + 1) * size)

        def swap_heads(module, args):
            z = args[0].unflatten(-1, (-1, block.attn.d_head)).clone()
            for i, (head, value) in enumerate(values):
                if head is not None:
                    z[rows(i), :, head] = value
            return (z.flatten(-2), *args[1:])

        def swap_whole(module, args, out):
            first = (out[0] if kind == "attn" else out).clone()
            for i, (head, value) in enumerate(values):
                if head is None:
                    first[rows(i)] = value
            return (first, *out[1:]) if kind == "attn" else first

        handles = [module.register_forward_hook(swap_whole, prepend=True)]
        if kind == "attn":
            handles.append(block.attn.o.register_forward_pre_hook(swap_heads))  # after an intervention's, as hook_z
            hidden = self.pre[layer].repeat(copies, 1, 1)
            inputs = block.ln1(hidden), self._inputs(hidden, copies)
        else:
            hidden = self.mid[layer].repeat(copies, 1, 1)
            inputs = block.ln2(hidden), {}
        try:
            out = module(inputs[0], **inputs[1])
        finally:
            for handle in handles:
                handle.remove()
        return out[0] if kind == "attn" else out

    def _replaced(self, layer: int, kind: str, values: list[tuple[int | None, torch.Tensor | float]]) -> torch.Tensor:
        """`ablated` from the clean pass alone, for a module without hooks: a whole output
        replaced is the value; a head's is the clean output changed by its part of W_O,
        (value - z_head) W_O[head] (the attention output is linear in each head's z), so
        the module does not run again."""
        attn = self.native.layers[layer].attn
        outs = []
        for head, value in values:
            if head is None:
                outs.append(torch.zeros_like(self.pre[layer]) + value)
            else:  # only attention layers have heads
                rows = slice(head * attn.d_head, (head + 1) * attn.d_head)
                outs.append(self.attn[layer] + (value - self.z[layer][..., rows]) @ attn.o.weight[:, rows].T)
        return torch.cat(outs)

    def run_from(self, layer: int, kind: str, out: torch.Tensor) -> torch.Tensor:
        """Logits of copies of the batch (as many as `out` holds) whose layer `layer` has `out`
        in place of its attention output (`kind` "attn": then its MLP and the later layers run)
        or of its MLP output ("mlp": then only the later layers run): [copies x batch, pos,
        vocab]. What
        comes before the ablated component is the clean pass's, so it is not computed again:
        the same numbers as a full forward pass with the component replaced by a hook."""
        from transformer_lens.utilities.activation_functions import apply_softcap

        native, block = self.native, self.native.layers[layer]
        copies = len(out) // len(self.pre[layer])
        if kind == "attn":
            hidden = self.pre[layer].repeat(copies, 1, 1) + out
            if not block.cfg.attn_only:
                hidden = hidden + block.mlp(block.ln2(hidden))
        else:
            hidden = self.mid[layer].repeat(copies, 1, 1) + out
        inputs = self._inputs(hidden, copies)
        for later in native.layers[layer + 1:]:
            (hidden,) = later(hidden, **inputs)
        return apply_softcap(native.head(native.ln_out(hidden)), native.output_logits_soft_cap)


def hooked(module: torch.nn.Module) -> bool:
    """Whether a forward hook (or pre-hook) is on the module, on one inside it, or on every
    module (a global one): what `_Clean.ablated` must run the module again for."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _ablated_logits(clean: _Clean, layer: int, kind: str, group: list[tuple[str, str, int | None]], means,
                    n_pos: int) -> torch.Tensor:
    """Logits of one copy of the batch per component of `group` (all of layer `layer`'s
    attention, `kind` "attn", or its MLP, "mlp"), each with that component replaced by its
    mean (`means`; zero when None): [len(group) x batch, pos, vocab]."""
    values = [(head, 0.0 if means is None else means[hook][:n_pos] if head is None else means[hook][:n_pos, head])
              for _, hook, head in group]
    return clean.run_from(layer, kind, clean.ablated(layer, kind, values))


@torch.no_grad()
def ablation_scores(model, task: Task, mode: str = "mean", sample: int | None = 64,
                    mean_over: int | None = 256, max_rows: int = 16384) -> dict[str, dict[str, float]]:
    """component -> {"loss": ..., "acc": ...} with it ablated, plus "clean", estimated from
    `sample` held-out sequences drawn from every length in proportion (`proportional_sample`,
    weighted by `sample_weights`; None: all of them). The means (mode "mean") are the held-out
    set's, estimated from `mean_over` sequences drawn the same way (None: all of them).
    Batched: one clean pass, every length padded to the longest, of the means' sample (the
    ablated sample is drawn from it, `nested_sample`; a pass of its own when it is larger, or
    in mode "zero") gives the means and keeps the residual stream at each layer; the ablated
    sample's copies with one component ablated start there, one pass per layer (and MLP) with a
    copy per component (as many as fit in `max_rows` sequences), running only what comes after
    the component. The same numbers as one full pass per component and length."""
    if mode not in MODES:
        from phasewatch.errors import ConfigError

        raise ConfigError("probes.options.ablation.mode", f"unknown mode {mode!r}", f"Use one of {', '.join(MODES)}.")
    comps = components(model)
    joined, weight, means, clean = _clean_run(model, task, mode, sample, mean_over, {hook for _, hook, _ in comps})
    size, n_pos = joined.tokens.shape
    totals = _weighted_sums(["clean"], clean.logits, joined, weight, task.loss_dtype)
    per_pass = max(1, max_rows // size)
    for (layer, kind), group in _by_layer(comps).items():
        for start in range(0, len(group), per_pass):
            part = group[start:start + per_pass]
            logits = _ablated_logits(clean, layer, kind, part, means, n_pos)
            totals |= _weighted_sums([label for label, _, _ in part], logits, joined, weight, task.loss_dtype)
    return {label: {"loss": s / n, "acc": a / n} for label, (s, a, n) in totals.items()}


def _clean_run(model, task: Task, mode: str, sample: int | None, mean_over: int | None, hooks: set[str]):
    """(the ablated sample padded into one batch, each answer token's weight, the means of
    `hooks`' outputs (None in mode "zero"), the clean pass of the sample): the sample and the
    means' sample drawn as `ablation_scores` says, one clean pass serving both when it can."""
    device = next(model.parameters()).device
    native = native_module(model)
    batches = [b for b, group in zip(task.val_batches(), task.val_groups()) if group == "val"]
    drawn = proportional_sample(batches, mean_over) if mode == "mean" else None
    nested = None if drawn is None else nested_sample(batches, drawn, sample)
    chosen = proportional_sample(batches, sample) if nested is None else [d.take(i) for d, i in zip(drawn, nested)]
    joined, mask = padded(chosen)
    joined = joined.to(device)
    weight = _row_weights(chosen, sample_weights(batches, chosen)).to(device)[:, None].expand_as(joined.loss_mask)
    weight = weight[joined.loss_mask]  # one per answer token
    if nested is None:  # zero ablation, or an ablated sample larger than the means'
        means = None if drawn is None else position_means(model, drawn, hooks, sample_weights(batches, drawn))
        clean = _Clean(native, joined.tokens, None if mask is None else mask.to(device))
    else:  # one clean pass of the means' sample serves both: the means, and the ablated sample's rows of it
        run = _clean_pass(native, drawn, device)
        means = run.means(hooks, _row_weights(drawn, sample_weights(batches, drawn)).to(device))
        starts = torch.tensor([0, *[len(d) for d in drawn]]).cumsum(0)
        clean = run.rows(torch.cat([start + i for start, i in zip(starts.tolist(), nested)]).to(device))
    return joined, weight, means, clean


def _by_layer(comps: list[tuple[str, str, int | None]]) -> dict[tuple[int, str], list]:
    """(layer, "attn" or "mlp") -> its components, in order."""
    kinds: dict[tuple[int, str], list] = {}
    for comp in comps:
        layer = int(comp[1].split(".")[1])  # blocks.<layer>....
        kinds.setdefault((layer, "mlp" if comp[1].endswith("hook_mlp_out") else "attn"), []).append(comp)
    return kinds


def _weighted_sums(labels: list[str], logits: torch.Tensor, joined: Batch, weight: torch.Tensor,
                   loss_dtype: torch.dtype) -> dict[str, list[float]]:
    """label -> [weighted loss sum, weighted correct sum, weight sum] of each copy of the
    batch in `logits` ([copy x batch, pos, vocab], copies in the order of `labels`), in one go."""
    size = joined.tokens.shape[0]
    targets = joined.targets[joined.loss_mask]
    picked = logits.unflatten(0, (len(labels), size))[:, joined.loss_mask]  # [copy, answer, vocab]
    loss = torch.nn.functional.cross_entropy(picked.flatten(0, 1).to(loss_dtype), targets.repeat(len(labels)),
                                             reduction="none").view(len(labels), -1)  # in the task's loss dtype
    correct = picked.argmax(-1).eq(targets)
    sums = (torch.stack([loss.double(), correct.double(), torch.ones_like(loss, dtype=torch.float64)], 1)
            * weight).sum(-1)  # [copy, 3], one reduction
    return dict(zip(labels, sums.tolist()))


def _applies(task: Task) -> bool:
    return "val" in task.val_groups()


KEYS = KeyFamilies(
    detail=r"^ablation/L\d+H\d+/|^ablation/.+/loss_delta$",  # per head, and the loss deltas (accuracies stay)
    tracked="necessary_components",
    tracked_names={"necessary_components": "components whose ablation breaks the task"},
    panels=(Panel("accuracy with one layer mean-ablated", re.compile(r"ablation/L\d+\.(attn|mlp)/acc")),),
    hidden=("ablation/",),
)


@register_probe("ablation", applies_to=_applies, default=lambda task: hasattr(task, "program"), keys=KEYS)
def ablation_probe(model, task: Task, mode: str = "mean", threshold: float = 0.1,
                   sample: int | None = 64, mean_over: int | None = 256) -> dict[str, Any]:
    """Options: mode ("mean" or "zero"), threshold (accuracy drop that makes a component
    necessary), sample (held-out sequences that are ablated, every length in
    proportion; null: all), mean_over (held-out sequences the means are estimated from,
    drawn the same way; null: all). Default for RASP tasks; on request for the others."""
    scores = ablation_scores(model, task, mode, sample, mean_over)
    clean = scores.pop("clean")
    out: dict[str, Any] = {}
    for label, s in scores.items():
        out[f"ablation/{label}/loss_delta"] = s["loss"] - clean["loss"]
        out[f"ablation/{label}/acc"] = s["acc"]
    out["necessary_components"] = [label for label, s in scores.items() if clean["acc"] - s["acc"] > threshold]
    return out

"""Ablations: which heads and layers does the model need right now?

For every attention head, every layer's attention output and every MLP output, the
task's held-out loss and accuracy when that component is replaced by its mean output at
each position over the whole held-out set (mean ablation, the default; "zero" replaces
it by zeros), with the other components intact. Run on a schedule, it shows when each component becomes necessary
(Olsson et al. 2022 ablate heads over training in the same way; the "necessity" part of
the tracr comparison compares it with the compiled model's non-empty components).

Keys logged: `ablation/<component>/loss_delta` (ablated minus clean loss, in nats per
answer token) and `ablation/<component>/acc` (accuracy with it ablated), where
<component> is `L<l>H<h>` (head h of layer l, ablated through `hook_z`, before W_O),
`L<l>.attn` or `L<l>.mlp`. Array: `necessary_components` (those whose ablation costs
more than `threshold` of accuracy; changes are printed during training).
Loss and accuracy are summed over the held-out batches token by token, as `val/loss` (the
`val` set only: a length-generalisation run's longer lengths, `val_longer`, are left out),
on at most `per_length` (64) held-out sequences of each batch (a RASP task's batches hold
one length each), spread evenly over it, with means estimated from at most `mean_over`
(1024) held-out sequences, every batch in proportion to its size: estimates of the whole
held-out set's numbers that keep the probe cheap enough to run densely (bench/README.md,
`probe_overhead.py`; both options null for the whole set).
"""

from __future__ import annotations

import re

from typing import Any

import torch

from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.tasks.base import Task, masked_loss_and_acc

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


def position_means(model, batches, names: set[str]) -> dict[str, torch.Tensor]:
    """Each hook's mean output at each position over every held-out sequence that has
    that position. Over the whole held-out set, not per batch: a RASP task's batches
    hold one length each, and a per-batch mean would keep the length (and everything
    computed from it) intact."""
    sums: dict[str, torch.Tensor] = {}
    counts = None
    for batch in batches:
        _, cache = model.run_with_cache(batch.tokens, names_filter=lambda name: name in names)
        n_pos = batch.tokens.shape[1]
        for name in names:
            total = cache[name].double().sum(0)
            if name not in sums:
                sums[name] = torch.zeros((model.cfg.n_ctx, *total.shape[1:]), dtype=torch.float64, device=total.device)
            sums[name][:n_pos] += total
        step = torch.zeros(model.cfg.n_ctx, dtype=torch.float64, device=batch.tokens.device)
        step[:n_pos] = len(batch.tokens)
        counts = step if counts is None else counts + step
    return {name: (s / counts.clamp_min(1).reshape(-1, *[1] * (s.dim() - 1))).float() for name, s in sums.items()}


def held_out_sample(batches, per_length: int | None) -> list:
    """At most `per_length` sequences of each held-out batch (one length each for a RASP
    task), spread evenly over it; all of them when `per_length` is None."""
    return batches if per_length is None else [batch.spread(per_length) for batch in batches]


def proportional_sample(batches, total: int | None) -> list:
    """About `total` sequences of the batches, the same share of each (at least one of each,
    spread evenly over it); all of them when `total` is None or they hold no more."""
    size = sum(len(b) for b in batches)
    if total is None or total >= size:
        return batches
    return [b.spread(max(1, round(len(b) * total / size))) for b in batches]


def _ablated_copies(value_of: dict[int, torch.Tensor | float], head: int | None, size: int):
    """A forward hook for a batch made of copies of one batch (`size` sequences each): copy
    i + 1 gets `value_of[i]` in place of the component's output (one head's slice of hook_z,
    or the whole output); the others pass unchanged."""

    def hook(value: torch.Tensor, hook=None) -> torch.Tensor:
        value = value.clone()
        for i, v in value_of.items():
            rows = slice((i + 1) * size, (i + 2) * size)
            if head is None:
                value[rows] = v
            else:
                value[rows, :, head] = v
        return value

    return hook


@torch.no_grad()
def ablation_scores(model, task: Task, mode: str = "mean", per_length: int | None = 64,
                    mean_over: int | None = 1024, max_rows: int = 16384) -> dict[str, dict[str, float]]:
    """component -> {"loss": ..., "acc": ...} with it ablated, plus "clean", on at most
    `per_length` held-out sequences of each length (`held_out_sample`; None: all of them).
    The means (mode "mean") are over the held-out set, estimated from at most `mean_over`
    of its sequences taken from every batch in proportion to its size, so that each length
    weighs what it weighs in the whole set (None: all of them). Batched: one forward pass
    holds the clean batch and one copy per component with that component ablated (as many
    components as fit in `max_rows` sequences), the same numbers as one pass per component."""
    if mode not in MODES:
        from phasewatch.tasks.base import ConfigError

        raise ConfigError("probes.options.ablation.mode", f"unknown mode {mode!r}", f"Use one of {', '.join(MODES)}.")
    comps = components(model)
    device = next(model.parameters()).device
    batches = [b.to(device) for b, group in zip(task.val_batches(), task.val_groups()) if group == "val"]
    means = position_means(model, proportional_sample(batches, mean_over),
                           {hook for _, hook, _ in comps}) if mode == "mean" else None
    totals: dict[str, list[float]] = {}

    def add(label: str, logits: torch.Tensor, batch) -> None:
        loss, acc = masked_loss_and_acc(logits, batch, torch.float64)
        n = int(batch.loss_mask.sum())
        entry = totals.setdefault(label, [0.0, 0.0, 0])
        entry[0] += float(loss) * n
        entry[1] += float(acc) * n
        entry[2] += n

    for batch in held_out_sample(batches, per_length):
        size, n_pos = batch.tokens.shape[:2]
        per_pass = max(1, max_rows // size - 1)
        for start in range(0, len(comps), per_pass):
            group = comps[start:start + per_pass]
            hooks: dict[tuple[str, int | None], dict[int, torch.Tensor | float]] = {}
            for i, (_, hook, head) in enumerate(group):
                value = 0.0 if means is None else means[hook][:n_pos] if head is None else means[hook][:n_pos, head]
                hooks.setdefault((hook, head), {})[i] = value
            tokens = batch.tokens.repeat(len(group) + 1, 1)
            logits = model.run_with_hooks(tokens, fwd_hooks=[(hook, _ablated_copies(values, head, size))
                                                             for (hook, head), values in hooks.items()])
            if start == 0:
                add("clean", logits[:size], batch)
            for i, (label, _, _) in enumerate(group):
                add(label, logits[(i + 1) * size:(i + 2) * size], batch)
    return {label: {"loss": s / n, "acc": a / n} for label, (s, a, n) in totals.items()}


def _applies(task: Task) -> bool:
    return "val" in task.val_groups()


KEYS = KeyFamilies(
    detail=r"^ablation/L\d+H\d+/|^ablation/.+/loss_delta$",  # per head, and the loss deltas (accuracies stay)
    tracked="necessary_components",
    panels=(Panel("accuracy with one layer mean-ablated", re.compile(r"ablation/L\d+\.(attn|mlp)/acc")),),
    hidden=("ablation/",),
)


@register_probe("ablation", applies_to=_applies, default=lambda task: hasattr(task, "program"), keys=KEYS)
def ablation_probe(model, task: Task, mode: str = "mean", threshold: float = 0.1,
                   per_length: int | None = 64, mean_over: int | None = 1024) -> dict[str, Any]:
    """Options: mode ("mean" or "zero"), threshold (accuracy drop that makes a component
    necessary), per_length (held-out sequences of each length that are ablated, spread
    evenly over them; null: all), mean_over (held-out sequences the means are estimated
    from, every length in proportion; null: all). Default for RASP tasks; on request for the others."""
    scores = ablation_scores(model, task, mode, per_length, mean_over)
    clean = scores.pop("clean")
    out: dict[str, Any] = {}
    for label, s in scores.items():
        out[f"ablation/{label}/loss_delta"] = s["loss"] - clean["loss"]
        out[f"ablation/{label}/acc"] = s["acc"]
    out["necessary_components"] = [label for label, s in scores.items() if clean["acc"] - s["acc"] > threshold]
    return out

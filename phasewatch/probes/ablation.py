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
`val` set only: a length-generalisation run's longer lengths, `val_longer`, are left out).
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


def _replace(value_of: torch.Tensor, head: int | None):
    """A forward hook that puts `value_of` (broadcast over the batch) in place of the
    component's output (one head's slice of hook_z, or the whole output)."""

    def hook(value: torch.Tensor, hook=None) -> torch.Tensor:
        value = value.clone()
        if head is None:
            value[...] = value_of
        else:
            value[:, :, head] = value_of
        return value

    return hook


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


@torch.no_grad()
def ablation_scores(model, task: Task, mode: str = "mean") -> dict[str, dict[str, float]]:
    """component -> {"loss": ..., "acc": ...} with it ablated, plus "clean"."""
    if mode not in MODES:
        from phasewatch.tasks.base import ConfigError

        raise ConfigError("probes.options.ablation.mode", f"unknown mode {mode!r}", f"Use one of {', '.join(MODES)}.")
    comps = components(model)
    device = next(model.parameters()).device
    batches = [b.to(device) for b, group in zip(task.val_batches(), task.val_groups()) if group == "val"]
    means = position_means(model, batches, {hook for _, hook, _ in comps}) if mode == "mean" else None
    totals: dict[str, list[float]] = {}

    def add(label: str, logits: torch.Tensor, batch) -> None:
        loss, acc = masked_loss_and_acc(logits, batch, torch.float64)
        n = int(batch.loss_mask.sum())
        entry = totals.setdefault(label, [0.0, 0.0, 0])
        entry[0] += float(loss.detach()) * n
        entry[1] += float(acc.detach()) * n
        entry[2] += n

    for batch in batches:
        n_pos = batch.tokens.shape[1]
        add("clean", model(batch.tokens), batch)
        for label, hook, head in comps:
            if means is not None:
                value = means[hook][:n_pos] if head is None else means[hook][:n_pos, head]
            else:
                value = 0.0
            add(label, model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, _replace(value, head))]), batch)
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
def ablation_probe(model, task: Task, mode: str = "mean", threshold: float = 0.1) -> dict[str, Any]:
    """Options: mode ("mean" or "zero"), threshold (accuracy drop that makes a component
    necessary). Default for RASP tasks; on request for the others."""
    scores = ablation_scores(model, task, mode)
    clean = scores.pop("clean")
    out: dict[str, Any] = {}
    for label, s in scores.items():
        out[f"ablation/{label}/loss_delta"] = s["loss"] - clean["loss"]
        out[f"ablation/{label}/acc"] = s["acc"]
    out["necessary_components"] = [label for label, s in scores.items() if clean["acc"] - s["acc"] > threshold]
    return out

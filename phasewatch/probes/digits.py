"""Per-answer-token loss and accuracy for n-digit addition (Nanda et al. 2023, appendix:
each of the 6 answer tokens of 5-digit addition has its own phase change).

Keys: `digits/loss/<i>` and `digits/acc/<i>` for answer token i = 0 (the final carry,
predicted first) .. n_digits, on the task's fixed held-out set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasewatch.models import native_module
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.tasks.digit_addition import DigitAddition


@torch.no_grad()
def per_token_metrics(model, task: DigitAddition, held_out_logits: list[torch.Tensor] | None = None) -> dict[str, float]:
    """The keys above; `held_out_logits`: the model's logits on the held-out batch, computed
    already (by validation at the same step), else computed here as validation does."""
    (batch,) = task.val_batches()
    if held_out_logits is None:
        held_out_logits = [native_module(model)(batch.tokens.to(next(model.parameters()).device))]
    logits = held_out_logits[0].float().cpu()
    out: dict[str, float] = {}
    for i, pos in enumerate(task.answer_positions):
        target = batch.targets[:, pos]
        out[f"digits/loss/{i}"] = float(F.cross_entropy(logits[:, pos], target))
        out[f"digits/acc/{i}"] = float((logits[:, pos].argmax(-1) == target).float().mean())
    return out


KEYS = KeyFamilies(panels=(Panel("loss per answer token", "digits/loss/", log_y=True),
                          Panel("accuracy per answer token", "digits/acc/")))


@register_probe("digit_tokens", applies_to=lambda task: isinstance(task, DigitAddition), cheap=True, keys=KEYS,
                held_out=True)
def digit_tokens_probe(model, task: DigitAddition, held_out_logits: list[torch.Tensor] | None = None) -> dict[str, float]:
    """`per_token_metrics`: `digits/loss/<i>`, `digits/acc/<i>`."""
    return per_token_metrics(model, task, held_out_logits)

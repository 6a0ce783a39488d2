"""Interventions during training, each one config entry (`interventions.items`).

    interventions:
      items:
        - {kind: freeze, component: L0H1, start: 0, end: 1000}      # weights kept as they are
        - {kind: ablate, component: L0.attn, mode: zero, start: 500, end: 800}
        - {kind: ablate, component: L1H2, mode: mean, start: 0, end: 3000}
        - {kind: reinit, component: L0.mlp, step: 1200, seed: 1}

- `freeze`: the component's weights are restored after every optimizer step in
  [start, end), so they stay bit-identical (AdamW's weight decay and momentum included).
- `ablate`: while the step is in [start, end), the component's output (a head's z, a
  layer's attention output, an MLP's output) is replaced by zeros (`mode: zero`) or by
  its mean over the batch at each position (`mode: mean`), in training and validation
  alike, through a forward hook on the model.
- `reinit`: at `step`, the component's weights are drawn again from the model's own
  initialisation (a fresh model of the same architecture with `seed`); the optimizer's
  moments for them are not reset.

Components: `L<l>H<h>` (a head), `L<l>.attn`, `L<l>.mlp`; `embed`, `pos_embed`, `unembed`
(freeze and reinit only). Steps count optimizer updates, like the run's `step`.
The list is written to `<run_dir>/interventions.jsonl` and drawn on the report's time
axis. Invalid entries stop the run before training (ConfigError).
An auxiliary loss from a probe is not available yet.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from phasewatch.tasks.base import ConfigError, require, require_int
from phasewatch.trainers.model import (build_model, component_parameters, parse_component,
                                       register_component_hook)

KINDS = ("freeze", "ablate", "reinit")
RECORD = "interventions.jsonl"


@dataclasses.dataclass
class Intervention:
    kind: str
    component: str
    start: int | None = None
    end: int | None = None
    step: int | None = None
    mode: str = "zero"
    seed: int = 0

    def validate(self) -> "Intervention":
        field = "interventions.items"
        require(self.kind in KINDS, field, f"unknown kind {self.kind!r}", f"Use one of {', '.join(KINDS)}.")
        if self.kind == "reinit":
            require_int(self.step, f"{field}.step", 0, "A reinit needs the step at which it happens.")
        else:
            require_int(self.start, f"{field}.start", 0, f"A {self.kind} needs start and end steps.")
            require_int(self.end, f"{field}.end", 1, f"A {self.kind} needs start and end steps.")
            require(self.end > self.start, field, f"end {self.end} is not after start {self.start}",
                    "Give a window with end > start.")
        require(self.mode in ("zero", "mean"), f"{field}.mode", f"unknown mode {self.mode!r}", "Use zero or mean.")
        return self

    def active(self, step: int) -> bool:
        return self.kind != "reinit" and self.start <= step < self.end


class Interventions(pl.Callback):
    """Args:
    items: the interventions, each a mapping with `kind` (freeze, ablate, reinit),
        `component`, and `start`/`end` (freeze, ablate) or `step` (reinit); `mode` (zero,
        mean) for ablate, `seed` for reinit.
    """

    def __init__(self, items: list[dict[str, Any]] | None = None):
        self.items = []
        for raw in items or []:
            if not isinstance(raw, dict):
                raise ConfigError("interventions.items", f"{raw!r} is not a mapping",
                                  "Write each item as {kind: ..., component: ..., ...}.")
            try:
                self.items.append(Intervention(**raw).validate())
            except TypeError as err:
                raise ConfigError("interventions.items", f"{raw!r}: {err}",
                                  "Use the keys kind, component, start, end, step, mode, seed.") from err
        self._frozen: list[tuple[torch.nn.Parameter, tuple, torch.Tensor]] = []
        self._hooks: list = []
        self._step = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        model = pl_module.model
        for item in self.items:
            parse_component(item.component, model.cfg.n_layers, model.cfg.n_heads)  # refuses unknown components
            if item.kind == "ablate":
                self._hooks.append(register_component_hook(model, item.component, self._replacer(item)))
            else:
                component_parameters(model, item.component)
        if self.items and trainer.default_root_dir:
            path = Path(trainer.default_root_dir) / RECORD
            path.write_text("".join(json.dumps(dataclasses.asdict(i)) + "\n" for i in self.items))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _replacer(self, item: Intervention):
        def replace(value: torch.Tensor) -> torch.Tensor:
            if not item.active(self._step):
                return value
            if item.mode == "zero":
                return torch.zeros_like(value)
            return value.mean(0, keepdim=True).expand_as(value)

        return replace

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = self._step = trainer.global_step
        model = pl_module.model
        for item in self.items:
            if item.kind == "reinit" and step == item.step:
                fresh = build_model(dataclasses.replace(pl_module.arch, seed=item.seed), pl_module.task)
                pairs = zip(component_parameters(model, item.component), component_parameters(fresh, item.component))
                with torch.no_grad():
                    for (p, index), (q, _) in pairs:
                        p[index] = q[index].to(p.device, p.dtype)
        self._frozen = [(p, index, p.detach()[index].clone()) for item in self.items
                        if item.kind == "freeze" and item.active(step)
                        for p, index in component_parameters(model, item.component)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            for p, index, saved in self._frozen:
                p[index] = saved
        self._frozen = []

    def on_validation_start(self, trainer, pl_module) -> None:
        self._step = trainer.global_step

"""Interventions during training, each one config entry (`interventions.items`): `freeze`,
`ablate` (zero or mean), `reinit` and `aux_loss` of a component (`L<l>H<h>`, `L<l>.attn`,
`L<l>.mlp`, `embed`, `pos_embed`, `unembed`) over a window of optimizer steps. The list is
written to the run folder and drawn on the report's time axis; invalid entries stop the run
before training (ConfigError). What each kind does, exactly: docs/interventions.md ("The
entries, in full")."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch

from phasewatch.loggers.run_folder import run_folder
from phasewatch.models import build_model, component_parameters, parse_component, register_component_hook
from phasewatch.probes.grokking import training_measure
from phasewatch.tasks.base import require, require_int
from phasewatch.errors import ConfigError

KINDS = ("freeze", "ablate", "reinit", "aux_loss")


@dataclasses.dataclass
class Intervention:
    kind: str
    component: str | None = None
    start: int | None = None
    end: int | None = None
    step: int | None = None
    mode: str = "zero"
    seed: int = 0
    measure: str | None = None
    weight: float | None = None

    def validate(self) -> "Intervention":
        field = "interventions.items"
        require(self.kind in KINDS, field, f"unknown kind {self.kind!r}", f"Use one of {', '.join(KINDS)}.")
        if self.kind != "aux_loss":
            require(isinstance(self.component, str), f"{field}.component", f"a {self.kind} needs a component",
                    "Name it: L<layer>H<head>, L<layer>.attn, L<layer>.mlp, embed, pos_embed or unembed.")
        if self.kind == "reinit":
            require_int(self.step, f"{field}.step", 0, "A reinit needs the step at which it happens.")
        else:
            require_int(self.start, f"{field}.start", 0, f"A {self.kind} needs start and end steps.")
            require_int(self.end, f"{field}.end", 1, f"A {self.kind} needs start and end steps.")
            require(self.end > self.start, field, f"end {self.end} is not after start {self.start}",
                    "Give a window with end > start.")
        require(self.mode in ("zero", "mean"), f"{field}.mode", f"unknown mode {self.mode!r}", "Use zero or mean.")
        if self.kind == "aux_loss":
            require(self.measure in ("excluded_loss", "restricted_loss"), f"{field}.measure",
                    f"unknown measure {self.measure!r}", "Use excluded_loss or restricted_loss (modular addition).")
            require(isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool) and self.weight != 0,
                    f"{field}.weight", f"must be a non-zero number, got {self.weight!r}",
                    "Give the term's weight; negative pushes the measure up, e.g. -0.1 on excluded_loss.")
        return self

    def active(self, step: int) -> bool:
        return self.kind != "reinit" and self.start <= step < self.end


class Interventions(pl.Callback):
    """Args:
    items: the interventions, each a mapping with `kind` (freeze, ablate, reinit),
        `component` (not for aux_loss), and `start`/`end` (freeze, ablate, aux_loss) or
        `step` (reinit); `mode` (zero, mean) for ablate, `seed` for reinit, `measure` and
        `weight` for aux_loss.
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
            if item.kind != "aux_loss":  # refuses unknown components
                parse_component(item.component, model.cfg.n_layers, model.cfg.n_heads)
            if item.kind == "ablate":
                self._hooks.append(register_component_hook(model, item.component, self._replacer(item)))
            elif item.kind == "aux_loss":
                if not hasattr(pl_module.task, "p") or getattr(pl_module.task, "op", None) != "+":
                    raise ConfigError("interventions.items.measure", f"{item.measure} is a measure of modular addition",
                                      "Use aux_loss with a ModularAddition task (op '+').")
                pl_module.aux_terms.append(self._aux_term(item))
            else:
                component_parameters(model, item.component)
        if self.items and trainer.default_root_dir:
            run_folder(trainer).write_interventions([dataclasses.asdict(i) for i in self.items])

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _aux_term(self, item: Intervention):
        def term(pl_module) -> dict[str, torch.Tensor]:
            if not item.active(pl_module.global_step):  # logged as 0 outside its window
                return {item.measure: torch.zeros((), dtype=torch.float64, device=pl_module.device)}
            return {item.measure: item.weight * training_measure(pl_module.model, pl_module.task, item.measure)}

        return term

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

"""Run probes during training and hand their values to every logger.

A thin adapter: the measurements live in `phasewatch.probes`. Probes run on their
schedule (log-spaced by default) at the start of the step, when the weights are those
after `step` updates and everything earlier has been logged; cheap probes also run at
every validation. Scalars go to every logger under the step; arrays are saved under
`<run_dir>/arrays/<probe>/<key>/step=<N>.npy`. The key-frequency set of the grokking
probe is tracked over time (`key_freq_history`), printed when it changes, and kept in
checkpoints so it survives a resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from phasewatch.callbacks.schedule import Schedule
from phasewatch.probes import default_probes, get_probe


class ProbeRunner(pl.Callback):
    """Args:
    names: probes to run on the schedule (default: every probe that applies to the task).
    schedule: when (default: 60 log-spaced steps, step 0 and the last step included).
    every_validation: also run the cheap ones among `names` at every validation.
    """

    def __init__(self, names: list[str] | None = None, schedule: Schedule = Schedule(kind="log", count=60),
                 every_validation: bool = True):
        self.names, self.schedule, self.every_validation = names, schedule.validate(), every_validation
        self.key_freq_history: list[tuple[int, list[int]]] = []
        self._steps: set[int] = set()
        self._probes: list = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        task = pl_module.task
        names = default_probes(task) if self.names is None else self.names
        self._probes = [get_probe(n, task) for n in names]
        self._steps = set(self.schedule.resolve(trainer.max_steps))

    # --- when ---------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self._steps:
            self._run(trainer, pl_module, [p for p in self._probes if not (p.cheap and self.every_validation)])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step in self._steps:  # the last step has no next batch
            self._run(trainer, pl_module, [p for p in self._probes if not (p.cheap and self.every_validation)])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_validation and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._run(trainer, pl_module, [p for p in self._probes if p.cheap])

    # --- what ---------------------------------------------------------------------

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, probes: list) -> None:
        if not probes:
            return
        step = trainer.global_step
        model, was_training = pl_module.model, pl_module.model.training
        model.eval()
        try:
            with torch.no_grad():
                results = {p.name: p(model, pl_module.task) for p in probes}
        finally:
            model.train(was_training)
        scalars: dict[str, float] = {}
        for name, values in results.items():
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    scalars[key] = float(value)
                else:
                    self._save_array(trainer, name, key, step, value)
            if "key_freqs" in values:
                self._track_key_freqs(step, list(values["key_freqs"]))
        if scalars:
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)

    @staticmethod
    def _save_array(trainer: pl.Trainer, probe: str, key: str, step: int, value: Any) -> None:
        folder = Path(trainer.default_root_dir) / "arrays" / probe / key
        folder.mkdir(parents=True, exist_ok=True)
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        np.save(folder / f"step={step:07d}.npy", array)

    def _track_key_freqs(self, step: int, freqs: list[int]) -> None:
        previous = self.key_freq_history[-1][1] if self.key_freq_history else None
        if previous is None or sorted(previous) != sorted(freqs):
            self.key_freq_history.append((step, freqs))
            if previous is not None:
                print(f"phasewatch: step {step}: key frequencies {sorted(previous)} -> {sorted(freqs)}")

    # --- resume -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"key_freq_history": [[s, list(f)] for s, f in self.key_freq_history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.key_freq_history = [(int(s), list(f)) for s, f in state_dict.get("key_freq_history", [])]

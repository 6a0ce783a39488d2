"""Checkpoints on a schedule, plus a rolling `last.ckpt`, written atomically.

`step=<N>.ckpt` holds the weights after N optimizer steps (step 0: the initial weights).
`last.ckpt` is refreshed every `last_every` steps and at the end, so a killed run loses at
most that many steps. Every file is written to a temporary name and renamed into place,
so a crash never leaves a half-written checkpoint under a real name.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl

from phasewatch.callbacks.schedule import Schedule
from phasewatch.tasks.base import require_int


def checkpoint_name(step: int) -> str:
    return f"step={step:07d}.ckpt"


class ScheduledCheckpoints(pl.Callback):
    """Save checkpoints at the schedule's steps and keep last.ckpt fresh.

    Args:
        dirpath: where to write (the CLI sets it to `<run_dir>/checkpoints`).
        schedule: when to keep a permanent checkpoint (default: 30 log-spaced steps).
        last_every: refresh last.ckpt every this many steps.
    """

    def __init__(self, dirpath: str | None = None, schedule: Schedule | None = None, last_every: int = 200):
        require_int(last_every, "checkpoints.last_every", 1)
        self.dirpath = dirpath
        self.schedule = schedule or Schedule()
        self.last_every = last_every
        self._steps: set[int] = set()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        self._steps = set(self.schedule.resolve(trainer.max_steps))

    def _save(self, trainer: pl.Trainer, name: str) -> None:
        path = Path(self.dirpath) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        trainer.save_checkpoint(tmp, weights_only=False)
        if trainer.is_global_zero:
            os.replace(tmp, path)

    def _save_step(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if step in self._steps:
            self._save(trainer, checkpoint_name(step))
        if step in self._steps or step % self.last_every == 0:
            self._save(trainer, "last.ckpt")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0:
            self._save_step(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._save_step(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, "last.ckpt")

"""Checkpoints on a schedule, plus a rolling `last.ckpt`, written atomically.

`step=<N>.ckpt` holds the state after N optimizer steps (step 0: the initial weights). By default
the schedule is the probes' (post-hoc analysis sees the steps the live probes saw), plus, while the
transition watcher has an onset pending, the steps of its dense grid (`dense_now`), thinned to at
most `dense_per_decade` per tenfold of steps. The steps of an explicit `schedule` are resume points
and hold the full state; every other step checkpoint exists for post-hoc probes and holds the
weights only (`weights_only` overrides both). `last.ckpt` always holds the full state: it is
refreshed every `last_every` steps, once at the end, and at the step SIGTERM stopped (`on_exception`).
At a step where validation runs, the save waits until validation has logged. Every file is written
under a temporary name and renamed into place; a full disk stops the run with one line (DiskFull).

Resume without gaps or duplicates: a full checkpoint stores every `CheckpointStateLogger`'s
`checkpoint_state()`; on resume `restore_checkpoint_state(state, step)` cuts what was logged after
it. README, "The run folder": what a run writes, how big. `shared_views`: one object per view.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import SIGTERMException

from phasewatch.loggers.run_folder import CheckpointStateLogger, run_folder
from phasewatch.callbacks.probes import ProbeRunner
from phasewatch.callbacks.schedule import Schedule
from phasewatch.callbacks.transitions import dense_now
from phasewatch.errors import DiskFull, is_disk_full
from phasewatch.rundir import LAST_CHECKPOINT, checkpoint_name, step_checkpoints
from phasewatch.tasks.base import require_int


def stops_after_step(trainer: pl.Trainer, exception: BaseException) -> bool:
    """Whether `exception` is SIGTERM stopping a fit after a whole step, where last.ckpt is to
    hold that step (`ScheduledCheckpoints.on_exception`): not in the sanity check, nor in the
    middle of a validation (Lightning stops it between batches, the step's validation incomplete)."""
    return (isinstance(exception, SIGTERMException) and trainer.state.fn == "fit" and not trainer.sanity_checking
            and trainer.state.stage != RunningStage.VALIDATING)


def save_at_stop(trainer: pl.Trainer, save: Callable[[], None]) -> None:
    """`save()`, the last.ckpt of the step SIGTERM stopped at (`on_exception`): where it fails (a
    full disk) one line says so and the older last.ckpt stays, so the run still stops as
    SIGTERM stops it (status 143, the stop line naming that checkpoint, the report)."""
    try:
        save()
    except (DiskFull, OSError) as err:
        print(f"phasewatch: {LAST_CHECKPOINT} not saved at step {trainer.global_step}: {err}", file=sys.stderr)


def shared_views(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with every dense tensor that views the same memory as an earlier entry, with
    the same type, dtype, device, shape, strides, `requires_grad` and conjugate and negative view
    bits, replaced by that entry's object (in place; returned). `torch.save` writes a tensor's
    storage once either way, but a tensor object once per object: a bridge's state dict repeats
    each weight under several paths, whose pickling was about 30% of a weights-only checkpoint's
    host work (bench/README.md, fit_speed). Loaded, every key holds the same values as before."""
    first: dict[tuple, torch.Tensor] = {}
    for key, value in state_dict.items():
        # plain dense tensors only: a sparse tensor has no data_ptr, every meta tensor's is 0
        if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided and not value.is_meta:
            view = (type(value), value.data_ptr(), value.dtype, value.device, value.shape, value.stride(),
                    value.requires_grad, value.is_conj(), value.is_neg())
            state_dict[key] = first.setdefault(view, value)
    return state_dict


class ScheduledCheckpoints(Checkpoint):
    """Save checkpoints at the schedule's steps and keep last.ckpt fresh.

    Args:
        dirpath: where to write (default: the run folder's checkpoint folder).
        schedule: when to keep a permanent checkpoint (default: at every step of the probes'
            schedule; 30 log-spaced steps when no probes run).
        last_every: refresh last.ckpt (the full state) every this many steps.
        weights_only: whether step checkpoints hold the weights only (a third of the size with
            AdamW, but no resuming from them). Default (null): the full state at the steps of an
            explicit `schedule`, the weights only at the default schedule's and the dense grid's.
        dense_per_decade: keep at most this many of the dense grid's extra checkpoints per
            tenfold of steps: one is skipped when the step checkpoint before it is within a
            factor 10**(1/dense_per_decade); 0 keeps none, null every one. The schedule's own
            steps are always kept.
    """

    def __init__(self, dirpath: str | None = None, schedule: Schedule | None = None, last_every: int = 200,
                 weights_only: bool | None = None, dense_per_decade: int | None = 30):
        require_int(last_every, "checkpoints.last_every", 1)
        if dense_per_decade is not None:
            require_int(dense_per_decade, "checkpoints.dense_per_decade", 0)
        self.dirpath = dirpath
        self.schedule = schedule.validate() if schedule is not None else None
        self.last_every = last_every
        self.weights_only = weights_only
        self.dense_per_decade = dense_per_decade
        self._steps: set[int] = set()
        self._trainer: pl.Trainer | None = None
        self._restored_logger_states: list | None = None
        self._last_step: int | None = None  # the step last.ckpt holds, where this run wrote it

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.dirpath is None:
            self.dirpath = str(run_folder(trainer).checkpoints)
        if self.schedule is not None:
            self._steps = set(self.schedule.resolve(trainer.max_steps))
        else:
            runner = next((cb for cb in trainer.callbacks if isinstance(cb, ProbeRunner)), None)
            self._steps = set((runner.schedule if runner is not None else Schedule()).resolve(trainer.max_steps))

    # --- resume ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        loggers = self._trainer.loggers if self._trainer is not None else []
        return {"logger_states": [lg.checkpoint_state() if isinstance(lg, CheckpointStateLogger) else None
                                  for lg in loggers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_logger_states = state_dict.get("logger_states")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # Before the first optimizer step the loops have done nothing: leave their state out,
        # so a run resumed from step 0 starts them afresh. (Restoring Lightning's loop state
        # from a checkpoint taken before the first batch puts its count of logging steps one
        # ahead: every train/ line would be filed after the next validation and the last one
        # dropped.)
        if trainer.global_step == 0:
            checkpoint.pop("loops", None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restored_logger_states is not None:
            for lg, state in zip(trainer.loggers, self._restored_logger_states):
                if state is not None and isinstance(lg, CheckpointStateLogger):
                    lg.restore_checkpoint_state(state, trainer.global_step)
            self._restored_logger_states = None
        if trainer.global_step == 0:
            self._save_due(trainer)

    # --- saving ---------------------------------------------------------------------

    def _save(self, trainer: pl.Trainer, name: str, weights_only: bool = False, copy_to_last: bool = False) -> None:
        path = Path(self.dirpath) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        last_tmp = path.with_name(LAST_CHECKPOINT + ".tmp")
        try:
            trainer.save_checkpoint(tmp, weights_only=weights_only)
            if trainer.is_global_zero:
                if copy_to_last:  # the same bytes: copy rather than serialise twice
                    shutil.copyfile(tmp, last_tmp)
                    os.replace(last_tmp, path.with_name(LAST_CHECKPOINT))
                os.replace(tmp, path)
            if copy_to_last or name == LAST_CHECKPOINT:
                self._last_step = trainer.global_step
        except OSError as err:
            for partial in (tmp, last_tmp):
                partial.unlink(missing_ok=True)
            if not is_disk_full(err):
                raise
            last = path.with_name(LAST_CHECKPOINT)
            run_dir = run_folder(trainer).root
            raise DiskFull.in_run(run_dir, name, last.stat().st_size if last.exists() else None) from None

    def due_at(self, step: int, dense: bool = False) -> bool:
        """Whether a checkpoint may be written after `step` (`on_train_batch_end`, or the
        validation after it) by the schedules: the step is on the schedule, `last.ckpt` is due
        (every `last_every` steps), or `dense` (the run's transition watcher has the step on its
        dense grid with an onset pending). SIGTERM adds its step. False: nothing is written
        there, so a population may leave this callback out of the step (training/population.py)."""
        return dense or step % self.last_every == 0 or step in self._steps

    def _save_due(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        sigterm = getattr(trainer, "received_sigterm", False)
        # the last step's last.ckpt is the one `on_train_end` writes (after the watcher's final look)
        ends = 0 < trainer.max_steps <= step and not sigterm
        last_due = sigterm or (step % self.last_every == 0 and not ends)
        scheduled = step in self._steps
        if scheduled or (dense_now(trainer) and self._dense_kept(step)):
            light = self.light(scheduled)
            self._save(trainer, checkpoint_name(step), light, copy_to_last=not light and not ends)
            if light and last_due:
                self._save(trainer, LAST_CHECKPOINT)
        elif last_due:
            self._save(trainer, LAST_CHECKPOINT)

    def light(self, scheduled: bool) -> bool:
        """Whether a step checkpoint holds the weights only: `weights_only` when given, else
        all but those at the steps of an explicit schedule (`scheduled`: the step is on the
        schedule, not only on the dense grid)."""
        if self.weights_only is not None:
            return bool(self.weights_only)
        return not (scheduled and self.schedule is not None)

    def _dense_kept(self, step: int) -> bool:
        """Whether a dense-grid checkpoint at `step` is kept (`dense_per_decade`): the step
        checkpoint before it, as the folder holds it (so a resumed run thins alike), is more
        than a factor 10**(1/dense_per_decade) earlier."""
        if self.dense_per_decade is None:
            return True
        if self.dense_per_decade == 0:
            return False
        before = [s for s in step_checkpoints(self.dirpath) if s < step]
        return not before or step >= before[-1] * 10 ** (1 / self.dense_per_decade)

    @staticmethod
    def _validation_due(trainer: pl.Trainer) -> bool:
        interval = trainer.val_check_batch
        return bool(trainer.enable_validation and isinstance(interval, int) and interval > 0
                    and trainer.global_step % interval == 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._validation_due(trainer):
            self._save_due(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save_due(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, LAST_CHECKPOINT)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """SIGTERM that arrived after this step's save was decided (`_save_due` ran without it:
        during the hooks, logging or validation that follow) stops the fit where Lightning next
        looks, after the step: last.ckpt is written there unless it already holds the step. Not
        in the middle of validation (Lightning stops it between batches: the step's validation
        is incomplete), where last.ckpt stays the one before and the stop line says its step. A
        save that fails here (a full disk) says so in one line and leaves that older last.ckpt:
        the run still stops as SIGTERM stops it (status 143, the stop line, the report)."""
        if stops_after_step(trainer, exception) and self._last_step != trainer.global_step:
            save_at_stop(trainer, lambda: self._save(trainer, LAST_CHECKPOINT))

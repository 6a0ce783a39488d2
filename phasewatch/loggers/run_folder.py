"""What callbacks ask of loggers, declared: the run folder's logger and the protocols.

`RunFolderLogger` is the Lightning logger of the run folder: every logged scalar goes to
its metrics file, one line per logging call, flushed at once, and into the series it keeps
in memory for the live detector. Callbacks reach loggers only through the protocols below
(`isinstance` against them), and find the run folder with `run_folder(trainer)`.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from phasewatch.rundir import RunFolder, Series, series_from_records


@runtime_checkable
class EventLogger(Protocol):
    """A logger that records phase-transition events ({"metric", "direction", "onset",
    "midpoint", "end", "magnitude", "detected_at", "kind", "steepest", "snr", "confidence"}:
    the README's run-folder section, docs/phases.md)."""

    def log_event(self, event: dict[str, Any]) -> None: ...


@runtime_checkable
class CheckpointStateLogger(Protocol):
    """A logger with state to save in each checkpoint and to restore on resume."""

    def checkpoint_state(self) -> dict[str, Any]: ...

    def restore_checkpoint_state(self, state: dict[str, Any], step: int) -> None: ...


class RunFolderLogger(Logger):
    """Appends every logged scalar to the run folder's metrics, one line per logging call,
    flushed at once; non-finite values are written as null (JSON has no NaN). Keeps the
    series logged so far in memory (`series()`), read from the folder once when it already
    holds some (a resumed run)."""

    def __init__(self, folder: RunFolder, name: str):
        super().__init__()
        self.folder, self._name = folder, name
        self._series: Series | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return ""

    @property
    def log_dir(self) -> str:
        return str(self.folder.root)

    @property
    def root_dir(self) -> str:
        return str(self.folder.root)

    @property
    @rank_zero_experiment
    def experiment(self) -> RunFolder:
        return self.folder

    def series(self) -> Series:
        """Every numeric key logged to the folder so far, as (steps, values)."""
        if self._series is None:
            self._series = self.folder.series()
        return self._series

    def checkpoint_state(self) -> dict[str, int]:
        """Saved inside each checkpoint (see ScheduledCheckpoints)."""
        return self.folder.snapshot()

    def restore_checkpoint_state(self, state: dict[str, int], step: int) -> None:
        """On resume from a checkpoint at `step`: drop the lines logged after it that the
        resumed run will log again."""
        self.folder.rollback(state, step)
        self._series = None

    @rank_zero_only
    def log_event(self, event: dict[str, Any]) -> None:
        """Append a phase-transition event to the folder's events."""
        self.folder.append(self.folder.events, event)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The CLI writes the config itself; nothing to do."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        record: dict[str, Any] = {"step": int(step) if step is not None else None}
        for key, value in metrics.items():
            if key == "epoch":
                continue
            value = float(value)
            record[key] = value if math.isfinite(value) else None  # JSON has no NaN/inf
        if len(record) > 1:
            self.folder.append(self.folder.metrics, record)
            if self._series is not None:
                series_from_records([record], into=self._series)


def _folder_logger(trainer: pl.Trainer) -> RunFolderLogger | None:
    return next((lg for lg in trainer.loggers if isinstance(lg, RunFolderLogger)), None)


def run_folder(trainer: pl.Trainer) -> RunFolder:
    """The run folder of this training: its logger's, else the trainer's root folder."""
    logger = _folder_logger(trainer)
    return logger.folder if logger is not None else RunFolder(trainer.default_root_dir)


def logged_series(trainer: pl.Trainer) -> Series:
    """The series logged so far (from memory when the run folder's logger is attached)."""
    logger = _folder_logger(trainer)
    return logger.series() if logger is not None else run_folder(trainer).series()


def log_event(trainer: pl.Trainer, event: dict[str, Any]) -> None:
    """Hand a phase-transition event to every logger that records events."""
    for logger in trainer.loggers:
        if isinstance(logger, EventLogger):
            logger.log_event(event)

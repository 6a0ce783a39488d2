"""Keep the run folder's report current while training runs (a thin Lightning callback).

Every `every_n_validations` validations, once at least `min_seconds` of wall time have passed since
the fit began or since the last rewrite, the report is rewritten with a meta refresh, so an open
page reloads itself (every `REFRESH_SECONDS`: of several rewrites between two reloads a reader would
see only the last); at the end of training it is written once more without it, whatever the clock.
A report failure is a warning, never the end of a training run.
"""

from __future__ import annotations

import time
import warnings

import lightning.pytorch as pl

from phasewatch.loggers.run_folder import run_folder
from phasewatch.report.html import REFRESH_SECONDS, write_report


class LiveReport(pl.Callback):
    """Args:
        every_n_validations: how often to rewrite the report, in validations (0 turns it off).
        min_seconds: ... and at least this many seconds (wall time) after the fit began or the
            last rewrite (default: the live page's own reload period, `REFRESH_SECONDS`, 30 s;
            0: at every `every_n_validations`-th validation). A run shorter than that gets its
            report at the end only.
    """

    def __init__(self, every_n_validations: int = 10, min_seconds: float = REFRESH_SECONDS):
        self.every = int(every_n_validations)
        self.min_seconds = float(min_seconds)
        self._validations = 0
        self._written = time.monotonic()  # the clock starts again at the fit's start (`on_train_start`)

    def _write(self, trainer: pl.Trainer, live: bool) -> None:
        if self.every <= 0 or not trainer.is_global_zero:
            return
        try:
            write_report(run_folder(trainer).root, live=live)
        except Exception as err:  # noqa: BLE001 - the report must not stop training
            warnings.warn(f"could not write the report ({err!r}); training goes on", stacklevel=2)
        self._written = time.monotonic()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._written = time.monotonic()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validations += 1
            if (self.every > 0 and self._validations % self.every == 0
                    and time.monotonic() - self._written >= self.min_seconds):
                self._write(trainer, live=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, live=False)

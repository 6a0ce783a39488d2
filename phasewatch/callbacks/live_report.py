"""Keep the run folder's report current while training runs (a thin Lightning callback).

Every `every_n_validations` validations the report is rewritten with a meta refresh, so
an open page reloads itself; at the end of training it is written once more without it.
A report failure is a warning, never the end of a training run.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl

from phasewatch.loggers.run_folder import run_folder
from phasewatch.report.html import write_report


class LiveReport(pl.Callback):
    """Args: every_n_validations: how often to rewrite the report (0 turns it off)."""

    def __init__(self, every_n_validations: int = 10):
        self.every = int(every_n_validations)
        self._validations = 0

    def _write(self, trainer: pl.Trainer, live: bool) -> None:
        if self.every <= 0 or not trainer.is_global_zero:
            return
        try:
            write_report(run_folder(trainer).root, live=live)
        except Exception as err:  # noqa: BLE001 - the report must not stop training
            warnings.warn(f"could not write the report ({err!r}); training goes on", stacklevel=2)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validations += 1
            if self.every > 0 and self._validations % self.every == 0:
                self._write(trainer, live=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, live=False)

"""Weights & Biases through Lightning's WandbLogger, never fatal to a training run.

Mode: `WANDB_MODE` when the user set it; otherwise online when an API key is available
(the `WANDB_API_KEY` variable or a `~/.netrc` entry written by `wandb login`), offline
when not, with one line saying where the files are and how to `wandb sync` them.
Any W&B failure turns into one warning; the run folder still gets every value.
"""

from __future__ import annotations

import netrc
import os
import secrets
import string
import warnings
from typing import Any

from lightning.fabric.loggers.logger import _DummyExperiment
from lightning.pytorch.loggers import WandbLogger

from phasewatch.trainers.run_store import RunStore

WANDB_ID_FILE = "wandb_id"


def wandb_mode() -> str:
    """online, offline or disabled, decided without touching the network."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return {"dryrun": "offline", "run": "online"}.get(mode, mode)
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        if netrc.netrc().authenticators(host):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


class SafeWandbLogger(WandbLogger):
    """A WandbLogger whose failures become one warning and are then ignored."""

    _failed = False

    def _guard(self, fn, *args: Any, **kwargs: Any) -> Any:
        if self._failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - W&B must never stop training
            self._failed = True
            warnings.warn(f"W&B logging failed and is now off for this run ({err!r}); "
                          "the run folder keeps every value.", stacklevel=2)
            return None

    @property
    def experiment(self):
        if self._failed:
            return _DummyExperiment()
        experiment = self._guard(lambda: WandbLogger.experiment.fget(self))
        return _DummyExperiment() if experiment is None else experiment

    def log_metrics(self, metrics, step=None):
        return self._guard(super().log_metrics, metrics, step)

    def log_hyperparams(self, params, *args, **kwargs):
        return self._guard(super().log_hyperparams, params, *args, **kwargs)

    def after_save_checkpoint(self, checkpoint_callback):
        return self._guard(super().after_save_checkpoint, checkpoint_callback)

    def log_event(self, event: dict) -> None:
        """A detected phase transition: W&B run summary keys
        `transitions/<metric>/<direction>/<onset|midpoint|end|magnitude>` (latest event)."""

        def write():
            prefix = f"transitions/{event['metric']}/{event['direction']}"
            for key in ("onset", "midpoint", "end", "magnitude"):
                self.experiment.summary[f"{prefix}/{key}"] = event[key]

        self._guard(write)

    def finalize(self, status):
        """Close the W&B run at the end of fit (Lightning leaves it open, and the next
        run in the same process would silently log into it)."""
        self._guard(super().finalize, status)
        if self._experiment is not None and not self._failed:
            self._guard(self._experiment.finish, exit_code=0 if status == "success" else 1)
            self._experiment = None


def make_wandb_logger(store: RunStore, name: str, project: str, config: dict[str, Any]) -> SafeWandbLogger | None:
    """A logger writing under `<run_dir>/wandb`, resuming the W&B run id kept in the run
    folder (a new run takes `WANDB_RUN_ID` when `wandb agent` set it, so that the run
    joins the agent's sweep); None when W&B is disabled."""
    if os.environ.get("WANDB_MODE") == "":  # set but empty: W&B's own settings would refuse it
        del os.environ["WANDB_MODE"]
    mode = wandb_mode()
    if mode == "disabled":
        return None
    id_file = store.root / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
    else:  # `wandb agent` chooses the id of each sweep run (WANDB_RUN_ID)
        run_id = os.environ.get("WANDB_RUN_ID") or "".join(
            secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        id_file.write_text(run_id + "\n")
    if mode == "offline":
        why = "WANDB_MODE=offline" if os.environ.get("WANDB_MODE") else "no login found"
        print(f"phasewatch: W&B is offline ({why}); its files go to {store.root / 'wandb'}. "
              f"Upload later with: wandb sync {store.root / 'wandb'}/offline-run-*")
    logger = SafeWandbLogger(
        name=name, project=project, save_dir=str(store.root), id=run_id, resume="allow", mode=mode,
        config=config, log_model=False,
    )
    return logger

"""LightningCLI for phasewatch: the run folder, loggers and checkpoints around a fit.

Imported only when a Lightning subcommand runs (`phasewatch fit`), so that the rest of
the command line starts without importing torch or lightning.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from jsonargparse import ActionYesNo, Namespace
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.cli import LightningCLI

from phasewatch.callbacks.checkpoints import ScheduledCheckpoints
from phasewatch.callbacks.probes import ProbeRunner
from phasewatch.callbacks.transitions import TransitionWatcher
from phasewatch.probes import default_probes, get_probe
from phasewatch.report.live import LiveReport
from phasewatch.tasks.base import ConfigError
from phasewatch.trainers.cli import default_run_dir
from phasewatch.trainers.interventions import Interventions
from phasewatch.trainers.module import TaskDataModule, TrainModule
from phasewatch.trainers.run_store import RunFolderLogger, RunStore
from phasewatch.trainers.wandb_logging import make_wandb_logger


class TrainingProgressBar(TQDMProgressBar):
    """One bar for training, its postfix showing the latest train and val metrics; no
    extra bar per validation (grokking runs validate hundreds of times)."""

    def on_validation_start(self, trainer, pl_module) -> None:
        pass

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        pass

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        pass

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._train_progress_bar is not None and trainer.state.fn == "fit":
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


class PhasewatchCLI(LightningCLI):
    """LightningCLI plus `--run_dir`, `--wandb/--no_wandb`, `--wandb_project` and the
    `checkpoints` callback; sets up the run folder and loggers before the trainer."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="Run folder (default: runs/<task>-<date>-<time>).")
        parser.add_argument("--wandb", action=ActionYesNo, default=True,
                            help="Log to W&B (offline when not logged in); --no_wandb turns it off.")
        parser.add_argument("--wandb_project", type=str, default="phasewatch", help="W&B project name.")
        parser.add_lightning_class_args(ScheduledCheckpoints, "checkpoints")
        parser.add_lightning_class_args(ProbeRunner, "probes")
        parser.add_lightning_class_args(TransitionWatcher, "transitions")
        parser.add_lightning_class_args(LiveReport, "report")
        parser.add_lightning_class_args(Interventions, "interventions")
        parser.link_arguments("data.task", "model.task", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: Any):
        cfg = self.config[self.subcommand]
        task = self.datamodule.task
        resuming = cfg.get("ckpt_path") is not None
        run_dir = cfg.get("run_dir") or default_run_dir(task.name)
        store = RunStore(run_dir)
        if store.has_run() and not resuming and self.subcommand == "fit":
            raise ConfigError("run_dir", f"{run_dir} already holds a run",
                              f"Resume it with --run_dir {run_dir} --ckpt_path last, or choose another --run_dir.")
        probe_cb = self._get(self.config_init, "probes")
        if probe_cb.names is None:  # record the task's default probes by name
            probe_cb.names = default_probes(task)
        for name in probe_cb.names:
            get_probe(name, task)  # unknown or inapplicable probes stop here, before anything is written
        cfg.probes.names = list(probe_cb.names)
        store.create()
        store.acquire_lock()
        ckpt_cb = self._get(self.config_init, "checkpoints")
        ckpt_cb.dirpath = str(store.checkpoints)
        # record what the run really uses, not "default" placeholders
        cfg.run_dir = str(run_dir)
        cfg.model.arch = Namespace(**dataclasses.asdict(self.model.arch))
        cfg.checkpoints.dirpath = ckpt_cb.dirpath
        cfg.checkpoints.schedule = Namespace(**dataclasses.asdict(ckpt_cb.schedule))
        name = Path(run_dir).name
        loggers = [RunFolderLogger(store, name)]
        if cfg.get("wandb") and self.subcommand == "fit":
            wandb_logger = make_wandb_logger(store, name, cfg.get("wandb_project"), self.config_dump_dict())
            if wandb_logger is not None:
                loggers.append(wandb_logger)
        kwargs.setdefault("logger", loggers)
        trainer_cfg = cfg.trainer
        if trainer_cfg.get("enable_progress_bar") is not False and not trainer_cfg.get("callbacks"):
            # a quiet bar: about 100 refreshes per run, at most every 50 steps
            refresh = max(1, min(50, (trainer_cfg.get("max_steps") or 0) // 100))
            kwargs.setdefault("callbacks", [TrainingProgressBar(refresh_rate=refresh)])
        kwargs.setdefault("default_root_dir", str(store.root))
        self.store = store
        return super().instantiate_trainer(**kwargs)

    def config_dump_dict(self) -> dict[str, Any]:
        import yaml

        text = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        return yaml.safe_load(text)

    def before_fit(self) -> None:
        if not self.store.config.exists():  # a resumed run keeps its original config
            self._parser(self.subcommand).save(self.config[self.subcommand], self.store.config,
                                               skip_none=False, overwrite=True)
        print(f"phasewatch: run folder {self.store.root}")

    def after_fit(self) -> None:
        self.store.release_lock()
        if getattr(self.model, "nonfinite_step", None) is not None:
            sys.exit(1)  # stopped on a NaN/inf loss: a failure for scripts and sweeps


TRAINER_DEFAULTS = dict(  # with the other defaults: the quickstart run
    max_steps=3000, val_check_interval=25, check_val_every_n_epoch=None, log_every_n_steps=10,
    num_sanity_val_steps=0, enable_checkpointing=True, enable_model_summary=False,
)


def run_lightning_cli(argv: list[str]) -> None:
    """Run `phasewatch fit|validate ...` (argv without the program name)."""
    saved_argv = sys.argv
    sys.argv = ["phasewatch", *argv]  # LightningCLI reads sys.argv; `main(argv)` may be called from Python
    try:
        PhasewatchCLI(
            TrainModule, TaskDataModule, save_config_callback=None, trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0, auto_configure_optimizers=False,
        )
    finally:
        sys.argv = saved_argv



"""`phasewatch fit` and friends: LightningCLI with a run folder, W&B and checkpoints.

    phasewatch fit --config configs/quickstart.yaml [--model.lr 3e-4 ...] [--run_dir runs/x]
    phasewatch fit --run_dir runs/x --ckpt_path last          # resume that run
    phasewatch tasks                                           # list tasks and tracr programs

Every config field is a dotted flag (`phasewatch fit --help` lists them). Invalid values
stop before training with one line naming the field and the fix (exit status 2).
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

USAGE = """usage: phasewatch COMMAND [...]

commands:
  fit       train a model on a task (phasewatch fit --config configs/quickstart.yaml)
  validate  evaluate a checkpoint on the task's held-out data
  plot      draw a run's curves: phasewatch plot RUN_DIR [--out FILE.png]
  tasks     list the tasks and the tracr programs they can run

phasewatch fit --help lists every configuration flag.
"""


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _set_flag(argv: list[str], flag: str, value: str, keep_position: bool = False) -> list[str]:
    """argv with `flag` set to `value`: in place of the old one (keep_position, which
    matters when later flags refine it), or appended at the end."""
    out, skip, placed = [], False, False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == flag or arg.startswith(flag + "="):
            skip = arg == flag
            if keep_position and not placed:
                out += [flag, value]
                placed = True
            continue
        out.append(arg)
    return out if placed else out + [flag, value]


def task_argument(argv: list[str]) -> list[str]:
    """Accept registry names (`--data.task induction`) besides class names, and refuse
    unknown tasks with the list of known ones."""
    value = _flag_value(argv, "--data.task")
    if value is None or value.lstrip().startswith(("{", "[")):
        return argv
    from phasewatch.tasks import task_class, task_names
    from phasewatch.tasks.base import ConfigError

    classes = {task_class(n).__name__: task_class(n) for n in task_names()}
    if value in task_names():
        cls = task_class(value)
    elif value.rsplit(".", 1)[-1] in classes:
        cls = classes[value.rsplit(".", 1)[-1]]
    else:
        raise ConfigError("data.task", f"unknown task {value!r}",
                          f"Use one of {', '.join(task_names())} (or {', '.join(sorted(classes))}).")
    return _set_flag(argv, "--data.task", f"phasewatch.tasks.{cls.__name__}", keep_position=True)


def resume_arguments(argv: list[str]) -> list[str]:
    """Make `fit --run_dir D --ckpt_path last` resume D: read D/config.yaml when no
    config is given, and turn `last` into D/checkpoints/last.ckpt."""
    from phasewatch.tasks.base import ConfigError
    from phasewatch.trainers.run_store import RunStore

    ckpt, run_dir = _flag_value(argv, "--ckpt_path"), _flag_value(argv, "--run_dir")
    if ckpt is None or run_dir is None:
        if ckpt == "last":
            raise ConfigError("ckpt_path", "'last' needs the run folder to resume",
                              "Pass --run_dir runs/<name> together with --ckpt_path last.")
        return argv
    store = RunStore(run_dir)
    if _flag_value(argv, "--config") is None and _flag_value(argv, "-c") is None:
        if not store.config.exists():
            raise ConfigError("run_dir", f"{store.config} does not exist, so there is no run to resume",
                              "Check the folder name (runs/<name>), or start a new run with --config.")
        argv = argv[:1] + ["--config", str(store.config)] + argv[1:]
    if ckpt == "last":
        if not store.last_checkpoint.exists():
            raise ConfigError("ckpt_path", f"{store.last_checkpoint} does not exist",
                              "The run saved no checkpoint yet; start it again without --ckpt_path.")
        argv = _set_flag(argv, "--ckpt_path", str(store.last_checkpoint))
    return argv


def _lightning_cli(argv: list[str]) -> None:
    from jsonargparse import ActionYesNo, Namespace
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.cli import LightningCLI

    from phasewatch.callbacks.checkpoints import ScheduledCheckpoints
    from phasewatch.tasks.base import ConfigError
    from phasewatch.trainers.module import TaskDataModule, TrainModule
    from phasewatch.trainers.run_store import RunFolderLogger, RunStore
    from phasewatch.trainers.wandb_logging import make_wandb_logger

    class PhasewatchCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument("--run_dir", type=str | None, default=None,
                                help="Run folder (default: runs/<task>-<date>-<time>).")
            parser.add_argument("--wandb", action=ActionYesNo, default=True,
                                help="Log to W&B (offline when not logged in); --no_wandb turns it off.")
            parser.add_argument("--wandb_project", type=str, default="phasewatch", help="W&B project name.")
            parser.add_lightning_class_args(ScheduledCheckpoints, "checkpoints")
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
            store.create()
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
                kwargs.setdefault("callbacks", [TQDMProgressBar(refresh_rate=refresh)])
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

    trainer_defaults = dict(  # with the other defaults: the quickstart run
        max_steps=3000, val_check_interval=25, check_val_every_n_epoch=None, log_every_n_steps=10,
        num_sanity_val_steps=0, enable_checkpointing=True, enable_model_summary=False,
    )
    saved_argv = sys.argv
    sys.argv = ["phasewatch", *argv]  # LightningCLI reads sys.argv; `main(argv)` may be called from Python
    try:
        PhasewatchCLI(
            TrainModule, TaskDataModule, save_config_callback=None, trainer_defaults=trainer_defaults,
            seed_everything_default=0, auto_configure_optimizers=False,
        )
    finally:
        sys.argv = saved_argv


def default_run_dir(task_name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{task_name}-{stamp}"
    k = 1
    while path.exists():
        k += 1
        path = Path("runs") / f"{task_name}-{stamp}-{k}"
    return path


def list_tasks() -> None:
    from phasewatch.tasks import task_class, task_names
    from phasewatch.tasks.tracr_programs import PROGRAMS

    for name in task_names():
        cls = task_class(name)
        print(f"{name:18s} {cls.__module__}.{cls.__qualname__}")
    print("\ntracr programs for the rasp task (--data.task.program NAME):")
    for name, spec in sorted(PROGRAMS.items()):
        print(f"  {name:14s} {spec.summary} (vocab {list(spec.vocab)}, max_seq_len {spec.max_seq_len}, "
              f"{'causal' if spec.causal else 'non-causal'})")


def plot_command(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="phasewatch plot", description="Draw a run folder's curves as a PNG.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/figures/curves.png)")
    args = parser.parse_args(argv)
    from phasewatch.report.curves import plot_run

    try:
        print(plot_run(args.run_dir, args.out))
    except FileNotFoundError as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    from phasewatch.tasks.base import ConfigError

    try:
        if argv[0] in ("fit", "validate"):
            _lightning_cli(resume_arguments(task_argument(argv)))
        elif argv[0] == "tasks":
            list_tasks()
        elif argv[0] == "plot":
            return plot_command(argv[1:])
        else:
            print(f"phasewatch: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
            return 2
    except ConfigError as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one configuration path: LightningCLI for phasewatch, and the run folder, loggers and
checkpoints around a fit.

`PhasewatchCLI` is the parser of every run's configuration. `phasewatch fit|validate` run
it on the command line (`run_lightning_cli`; registry task names and `--run_dir D
--ckpt_path last` are resolved before jsonargparse parses: `resolve_arguments`), and every
command that needs a finished run's model or data (`analyze`, `trajectory`) gets them from
the same parser over the run's saved config (`load_run_config`), never by hand.

Imported only when such a command runs, so that the rest of the command line starts
without importing lightning.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionYesNo, ArgumentError, Namespace
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from phasewatch.callbacks.checkpoints import ScheduledCheckpoints
from phasewatch.loggers.run_folder import RunFolderLogger
from phasewatch.callbacks.probes import ProbeRunner
from phasewatch.callbacks.transitions import TransitionWatcher
from phasewatch.plugins import check_trusted, named_modules, only_trusted_imports
from phasewatch.probes import check_options, default_probes, get_probe
from phasewatch.callbacks.live_report import LiveReport
from phasewatch.rundir import RunFolder, default_run_dir, read_checkpoint
from phasewatch.errors import ConfigError
from phasewatch.callbacks.interventions import Interventions
from phasewatch.training.module import TaskDataModule, TrainModule
from phasewatch.loggers.wandb_logger import make_wandb_logger


class TrainingProgressBar(TQDMProgressBar):
    """One bar for training, its postfix showing the latest train and val metrics; no
    extra bar per validation (grokking runs validate hundreds of times)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The bar counts optimisation steps (`trainer.global_step`), not Lightning's batches:
        a Lightning step can run several (`TrainModule.chunked`). Drawn when the count passes
        a multiple of the refresh rate, and at the end."""
        bar, steps = self._train_progress_bar, trainer.global_step
        if bar is None or bar.disable or not (steps // self.refresh_rate > bar.n // self.refresh_rate
                                              or steps == bar.total):
            return
        bar.n = steps
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws the bar

    def on_validation_start(self, trainer, pl_module) -> None:
        pass

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        pass

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        pass

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._train_progress_bar is not None and trainer.state.fn == "fit":
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = {**getattr(pl_module, "shown", {}), **super().get_metrics(trainer, pl_module)}  # TrainModule.shown
        metrics.pop("v_num", None)  # the logger's version (W&B's run id): the run folder says which run
        return metrics


class PhasewatchCLI(LightningCLI):
    """LightningCLI plus `--run_dir`, `--wandb/--no_wandb`, `--wandb_project` and the
    `checkpoints` callback; sets up the run folder and loggers before the trainer."""

    _options_given = False  # --probes.options on the command line (checked against the probes run)
    _resumed: tuple[str, int] | None = None  # (checkpoint, its global_step) that resume_arguments read
    _untrusted: tuple[str, ...] | None = None  # config from a run folder: the modules the command line names

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="Run folder (default: runs/<task>-<date>-<time>).")
        parser.add_argument("--wandb", action=ActionYesNo, default=True,
                            help="Log to W&B (offline when not logged in); --no_wandb turns it off.")
        parser.add_argument("--wandb_project", type=str, default="phasewatch", help="W&B project name.")
        parser.add_argument("--population.seeds", type=int | str | list[int] | None, default=None,
                            help="Train one member per seed in one process (a count: 16, a range: 0-15, a list: "
                                 "1,4,9), each in its own run folder <run_dir>/m00, ... (training/population.py).")
        parser.add_argument("--population.vary_data", type=bool | None, default=None,
                            help="Give member k the data seed k as well (default: when the task samples its "
                                 "training batches, not for full-batch tasks).")
        parser.add_lightning_class_args(ScheduledCheckpoints, "checkpoints")
        parser.add_lightning_class_args(ProbeRunner, "probes")
        parser.add_lightning_class_args(TransitionWatcher, "transitions")
        parser.add_lightning_class_args(LiveReport, "report")
        parser.add_lightning_class_args(Interventions, "interventions")
        parser.link_arguments("data.task", "model.task", apply_on="instantiate")

    def parse_arguments(self, parser, args) -> None:
        """Parse the command line after `resolve_arguments` (a saved config, given as a
        dict by `load_run_config`, is parsed as it is). A parse error is a ConfigError: one
        line naming the key, not jsonargparse's usage dump."""
        try:
            if isinstance(args, dict):
                self.config = parser.parse_object(args)
            else:
                argv, self._resumed, self._untrusted = resolve_arguments(list(sys.argv[1:] if args is None else args))
                self._options_given = any(a.startswith("--probes.options") for a in argv)
                with self._import_guard():
                    self.config = parser.parse_args(argv)
        except ArgumentError as err:
            raise parse_error(err) from None

    def _import_guard(self) -> AbstractContextManager:
        """jsonargparse's import policy while a run folder's config is parsed and instantiated
        (`plugins.only_trusted_imports`); nothing for a config the user gave."""
        return nullcontext() if self._untrusted is None else only_trusted_imports(self._untrusted)

    def instantiate_classes(self) -> None:
        with self._import_guard():
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs: Any):
        cfg = self.config[self.subcommand]
        task = self.datamodule.task
        max_steps = cfg.trainer.get("max_steps")
        if not (isinstance(max_steps, int) and max_steps >= 1):
            raise ConfigError("trainer.max_steps", f"must be a whole number of steps >= 1, got {max_steps!r}",
                              "Set e.g. --trainer.max_steps 3000 (phasewatch's schedules need a finite run).")
        resuming = cfg.get("ckpt_path") is not None
        run_dir = cfg.get("run_dir") or default_run_dir(task.name)
        folder = RunFolder(run_dir)
        if folder.has_run() and not resuming and self.subcommand == "fit":
            raise ConfigError("run_dir", f"{run_dir} already holds a run",
                              f"Resume it with --run_dir {run_dir} --ckpt_path last, or choose another --run_dir.")
        probe_cb = self._get(self.config_init, "probes")
        if probe_cb.names is None:  # record the task's default probes by name
            probe_cb.names = default_probes(task)
        for name in probe_cb.names:
            get_probe(name, task)  # unknown or inapplicable probes stop here, before anything is written
        if self._options_given:  # a config may carry options for later (`analyze --probes llc`); a flag may not
            check_options(probe_cb.options, "probes.options", running=list(probe_cb.names))
        cfg.probes.names = list(probe_cb.names)
        folder.create()
        folder.acquire_lock()
        ckpt_cb = self._get(self.config_init, "checkpoints")
        ckpt_cb.dirpath = str(folder.checkpoints)
        # record what the run really uses, not "default" placeholders
        cfg.run_dir = str(run_dir)
        cfg.model.arch = Namespace(**dataclasses.asdict(self.model.arch))
        cfg.checkpoints.dirpath = ckpt_cb.dirpath
        if ckpt_cb.schedule is None:  # by default the probes' schedule, recorded as such
            ckpt_cb.schedule = probe_cb.schedule
            if ckpt_cb.weights_only is None:  # its checkpoints are for post-hoc probes: weights only, recorded
                ckpt_cb.weights_only = cfg.checkpoints.weights_only = True
        cfg.checkpoints.schedule = Namespace(**dataclasses.asdict(ckpt_cb.schedule))
        name = Path(run_dir).name
        trainer_cfg = cfg.trainer
        if trainer_cfg.get("enable_progress_bar") is not False and not trainer_cfg.get("callbacks"):
            # a quiet bar: about 100 refreshes per run, at most every 50 steps
            refresh = max(1, min(50, (trainer_cfg.get("max_steps") or 0) // 100))
            kwargs.setdefault("callbacks", [TrainingProgressBar(refresh_rate=refresh)])
        kwargs.setdefault("default_root_dir", str(folder.root))
        self.folder = folder
        if (cfg.get("population") or {}).get("seeds") is not None:
            return self._population_trainer(cfg, folder, kwargs)
        loggers = [RunFolderLogger(folder, name)]
        if cfg.get("wandb") and self.subcommand == "fit":
            step = self._resume_step(cfg)
            wandb_logger = make_wandb_logger(folder, name, cfg.get("wandb_project"), self.config_dump_dict(), step)
            if wandb_logger is not None:
                loggers.append(wandb_logger)
        kwargs.setdefault("logger", loggers)
        return super().instantiate_trainer(**kwargs)

    def _resume_step(self, cfg: Namespace) -> int | None:
        """The step a resumed run continues from (its checkpoint's global_step; None for a new
        run): the one `resume_arguments` read with the command line, or, for a checkpoint
        given otherwise (in a config file), read now."""
        if cfg.get("ckpt_path") is None:
            return None
        if self._resumed is not None and self._resumed[0] == cfg.ckpt_path:
            return self._resumed[1]
        return read_checkpoint(cfg.ckpt_path, resume=True)["global_step"]

    def _population_trainer(self, cfg: Namespace, folder: RunFolder, kwargs: dict[str, Any]):
        """The trainer of `--population.seeds`: every member built by this parser from its own
        config (training/population.py), trained as one PopulationModule."""
        from phasewatch.rundir import member_name
        from phasewatch.training.population import (MemberCallbacks, PopulationData, PopulationModule, build_members,
                                                    parse_seeds)

        seeds = parse_seeds(cfg.population.seeds)
        self._refuse_for_population(cfg, folder)
        vary_data = cfg.population.vary_data
        if vary_data is None:
            vary_data = not self.datamodule.task.full_batch
        members = build_members(self._parser(self.subcommand), self.config_dump_dict(), seeds, vary_data, folder.root,
                                self._member_loggers(cfg, folder))
        self.model = PopulationModule(members.modules, vary_data)
        self.datamodule = PopulationData(members.data, vary_data)
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        trainer_config["callbacks"] = [*(trainer_config.get("callbacks") or []),
                                       MemberCallbacks(members.callbacks, members.loggers, members.roots,
                                                       folder.last_checkpoint)]
        trainer_config.update(logger=False, enable_checkpointing=False)
        print(f"phasewatch: population of {len(seeds)} (seeds {cfg.population.seeds}), members in "
              f"{folder.root}/{member_name(0)} ... {member_name(len(seeds) - 1)}")
        return self.trainer_class(**trainer_config)

    def _refuse_for_population(self, cfg: Namespace, folder: RunFolder) -> None:
        """ConfigError for what a population cannot do (training/population.py)."""
        from phasewatch.rundir import member_name

        refuse = [("population.seeds", self.subcommand != "fit", f"{self.subcommand} takes one run, not a population",
                   f"Give it one member's config instead: --config {RunFolder(folder.root / member_name(0)).config}."),
                  ("interventions", bool(self._get(self.config_init, "interventions").items),
                   "a population takes no interventions", "Train the seeds one by one with --interventions."),
                  ("model.on_nonfinite", self.model.hparams.on_nonfinite == "skip",
                   "a population stops on a non-finite loss; skip is not supported",
                   "Leave it at stop, or train the seed alone with skip."),
                  ("trainer.gradient_clip_val", cfg.trainer.get("gradient_clip_val") is not None,
                   "clipping by global norm is not elementwise, so one optimizer cannot do it for every member",
                   "Leave it unset, or train the seeds one by one."),
                  ("model.arch.seed", self.model.arch.seed is not None,
                   "it would give every member the same initial weights",
                   "Leave it unset: member k's seed_everything is k.")]
        for field, bad, problem, fix in refuse:
            if bad:
                raise ConfigError(field, problem, fix)

    def _member_loggers(self, cfg: Namespace, folder: RunFolder):
        """A population member's loggers, `(member_folder, label, own config) -> [loggers]`: its run
        folder's, and with W&B a run of its own grouped under the population's name."""
        project, step = cfg.get("wandb_project"), self._resume_step(cfg)
        group = os.environ.get("WANDB_RUN_GROUP") or folder.root.name  # a sweep's group, or the population

        def loggers(member_folder: RunFolder, label: str, own: dict[str, Any]) -> list:
            out = [RunFolderLogger(member_folder, label)]
            if cfg.get("wandb"):
                wandb_logger = make_wandb_logger(member_folder, label, project, own, step, group=group)
                if wandb_logger is not None:
                    out.append(wandb_logger)
            return out

        return loggers

    def config_dump_dict(self) -> dict[str, Any]:
        import yaml

        text = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        return yaml.safe_load(text)

    def before_fit(self) -> None:
        if not self.folder.config.exists():  # a resumed run keeps its original config
            self._parser(self.subcommand).save(self.config[self.subcommand], self.folder.config,
                                               skip_none=False, overwrite=True)
        print(f"phasewatch: run folder {self.folder.root}")

    def after_fit(self) -> None:
        self.folder.release_lock()
        if getattr(self.model, "nonfinite_step", None) is not None:
            sys.exit(1)  # stopped on a NaN/inf loss: a failure for scripts and sweeps

    def __init__(self, *args: Any, **kwargs: Any):
        """LightningCLI's, with a fit stopped by SIGTERM or Ctrl-C raised as `Interrupted`.
        Lightning ends such a fit with SystemExit: status 0 after SIGTERM (`SIGTERMException`,
        raised once the step in progress is done; `ScheduledCheckpoints` has saved last.ckpt
        at that step), 1 after Ctrl-C (its KeyboardInterrupt handling)."""
        try:
            super().__init__(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt) as err:
            trainer, folder = getattr(self, "trainer", None), getattr(self, "folder", None)
            if trainer is None or folder is None or self.subcommand != "fit" or not trainer.interrupted:
                raise
            if isinstance(err, SIGTERMException) or trainer.received_sigterm:
                signum = signal.SIGTERM
            elif isinstance(err, KeyboardInterrupt) or isinstance(err.__context__, KeyboardInterrupt):
                signum = signal.SIGINT
            else:
                raise
            raise Interrupted(folder, trainer.global_step, signum) from None
        finally:  # a population's members' objects, frozen after their build, back in the collector's
            population = sys.modules.get("phasewatch.training.population")  # reach whatever ended
            if population is not None:  # the command (also a failure before the fit's own hooks)
                population.thaw()


class Interrupted(Exception):
    """A fit stopped by a signal (SIGTERM, or SIGINT: Ctrl-C) at `step`; the run folder keeps
    what was written, and `phasewatch fit --run_dir <folder> --ckpt_path last` resumes it.
    `status` is the exit status a shell gives a command killed by that signal (143, 130)."""

    def __init__(self, folder: RunFolder, step: int, signum: int):
        self.folder, self.step, self.signum = folder, step, int(signum)
        super().__init__(f"interrupted at step {step}")

    @property
    def status(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        """One line: where it stopped and the command that resumes it (and, when last.ckpt is
        older than the step reached, the step it resumes from)."""
        saved = None
        if self.folder.last_checkpoint.exists():
            try:
                saved = read_checkpoint(self.folder.last_checkpoint)["global_step"]
            except ConfigError:
                saved = None
        line = (f"interrupted at step {self.step}; resume with: "
                f"phasewatch fit --run_dir {self.folder.root} --ckpt_path last")
        if saved is None:
            return f"interrupted at step {self.step} before its first checkpoint; start it again"
        if saved != self.step:
            line += f" (from its last checkpoint, step {saved})"
        return line


def resolve_arguments(argv: list[str]) -> tuple[list[str], tuple[str, int] | None, tuple[str, ...] | None]:
    """The command line as jsonargparse should see it: negative numbers as values
    (`--model.lr -1e-3`, as users type it), registry task names as class paths, and a
    resumed run's config and last checkpoint filled in; the checkpoint read; and, when the
    config comes from a run folder, the modules the command line itself names
    (`resume_arguments`)."""
    return resume_arguments(task_argument(negative_values(argv)))


def negative_values(argv: list[str]) -> list[str]:
    """`--flag -1e-3` as `--flag=-1e-3`: argparse takes a token starting with '-' for a flag."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.fullmatch(r"-(\d|\.\d)[\d.eE+-]*", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def parse_error(err: Exception) -> ConfigError:
    """jsonargparse's error as one line: the key, what is wrong, and where to look."""
    text = " ".join(str(err).split())
    match = re.search(r'Parser key "([^"]+)"', text) or re.search(r"argument --?([\w.\-]+)", text)
    field = match.group(1) if match else "arguments"
    if text.startswith(("Problems parsing config", "Unexpected config")):
        field = "config"
        problem = ("the config file does not hold a mapping of settings" if text.startswith("Unexpected config")
                   else text.split(" - ")[0])
    else:
        alternatives = [" ".join(a.split()) for a in re.split(r"\n\s*- ", str(err))[1:]]
        if alternatives:  # what each reading of the value ran into: the class path's problem says the most
            problem = next((a for a in alternatives if "class_path" in a or "No module named" in a), alternatives[0])
        else:
            problem = text
        problem = re.sub(r'\s*-?\s*Parser key "[^"]+":\s*', " ", problem).strip()
        problem = problem.rstrip(".").split(" - ")[0].strip()  # the nested repetitions of the same complaint
        head = " ".join(problem.split()[:3])
        if head and problem.find(head, len(head)) > 0:
            problem = problem[:problem.find(head, len(head))].strip()
    if field == "config":
        fix = "Give an existing YAML file holding a mapping of settings, e.g. --config configs/quickstart.yaml."
    elif "unrecognized arguments" in text:
        fix = "Check the spelling: phasewatch fit --help lists every flag."
    else:
        fix = "phasewatch fit --help lists every flag with its type."
    return ConfigError(field, problem, fix)


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

    classes = {task_class(n).__name__: task_class(n) for n in task_names()}
    if "." in value and not value.startswith("phasewatch."):
        return argv  # a class path of the user's own (a plug-in): jsonargparse imports and checks it
    if value in task_names():
        cls = task_class(value)
    elif value.rsplit(".", 1)[-1] in classes:
        cls = classes[value.rsplit(".", 1)[-1]]
    else:
        raise ConfigError("data.task", f"unknown task {value!r}",
                          f"Use one of {', '.join(task_names())} (or {', '.join(sorted(classes))}).")
    import phasewatch.tasks

    own = getattr(phasewatch.tasks, cls.__name__, None) is cls  # phasewatch's tasks by their short class path
    path = f"phasewatch.tasks.{cls.__name__}" if own else f"{cls.__module__}.{cls.__qualname__}"
    return _set_flag(argv, "--data.task", path, keep_position=True)


def resume_arguments(argv: list[str]) -> tuple[list[str], tuple[str, int] | None, tuple[str, ...] | None]:
    """Make `fit --run_dir D --ckpt_path last` resume D: read D's config when no config is
    given, and turn `last` into D's last checkpoint. Any checkpoint given is read first,
    without running code (`read_checkpoint`): a missing, corrupt or crafted file stops here
    with one line. Returns the arguments, (checkpoint, its global_step) or None when no
    checkpoint is given, and, when D's config is read (it may be someone else's), the modules
    that the command line names (trusted: the user typed them), else None."""
    ckpt, run_dir = _flag_value(argv, "--ckpt_path"), _flag_value(argv, "--run_dir")
    untrusted = None
    if ckpt is None:
        return argv, None, None
    if run_dir is None:
        if ckpt == "last":
            raise ConfigError("ckpt_path", "'last' needs the run folder to resume",
                              "Pass --run_dir runs/<name> together with --ckpt_path last.")
        # refused here, before Lightning loads it, when it is not a phasewatch checkpoint
        return argv, (ckpt, read_checkpoint(ckpt, resume=True)["global_step"]), None
    folder = RunFolder(run_dir)
    if _flag_value(argv, "--config") is None and _flag_value(argv, "-c") is None:
        if not folder.config.exists():
            raise ConfigError("run_dir", f"{folder.config} does not exist, so there is no run to resume",
                              "Check the folder name (runs/<name>), or start a new run with --config.")
        # the folder may be someone else's: its config may name only code that is phasewatch's or installed
        untrusted = named_modules(argv)
        check_trusted(folder.read_config(), str(folder.config), untrusted, bases=(folder.root,),
                      fix=f"If you trust it, pass --config {folder.config} as well, which runs it as given.")
        argv = argv[:1] + ["--config", str(folder.config)] + argv[1:]
    if ckpt == "last":
        if not folder.last_checkpoint.exists():
            raise ConfigError("ckpt_path", f"{folder.last_checkpoint} does not exist",
                              "The run saved no checkpoint yet; start it again without --ckpt_path.")
        ckpt = str(folder.last_checkpoint)
        argv = _set_flag(argv, "--ckpt_path", ckpt)
    # refused here, before Lightning loads it, when it is not a phasewatch checkpoint
    return argv, (ckpt, read_checkpoint(ckpt, resume=True)["global_step"]), untrusted


#: errors raise (parse_arguments turns them into one line) instead of printing the usage and exiting
PARSER_KWARGS = {"exit_on_error": False}

TRAINER_DEFAULTS = dict(  # with the other defaults: the quickstart run
    max_steps=3000, val_check_interval=25, check_val_every_n_epoch=None, log_every_n_steps=10,
    num_sanity_val_steps=0, enable_checkpointing=True, enable_model_summary=False,
)


def run_lightning_cli(argv: list[str]) -> RunFolder | None:
    """Run `phasewatch fit|validate ...` (argv without the program name); the run folder
    that `fit` trained in."""
    saved_argv = sys.argv
    sys.argv = ["phasewatch", *argv]  # LightningCLI reads sys.argv; `main(argv)` may be called from Python
    try:
        cli = PhasewatchCLI(
            TrainModule, TaskDataModule, save_config_callback=None, trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0, auto_configure_optimizers=False, parser_kwargs=PARSER_KWARGS,
        )
    finally:
        sys.argv = saved_argv
    return getattr(cli, "folder", None) if cli.subcommand == "fit" else None




class _ConfigOnly(PhasewatchCLI):
    """PhasewatchCLI that parses a saved config and instantiates its classes (model, data,
    callbacks), without a trainer or a run folder."""

    def instantiate_trainer(self, **kwargs: Any) -> None:
        return None


@dataclasses.dataclass
class RunConfig:
    """A run rebuilt from its saved config: the config as saved, and the model (fresh
    weights) and data module it describes."""

    config: dict[str, Any]
    model: TrainModule
    datamodule: TaskDataModule


def load_run_config(run_dir: str | os.PathLike, allow: tuple[str, ...] = ()) -> RunConfig:
    """Rebuild a run folder's model and data from its config (`instantiate_config`); ConfigError
    when the folder has none."""
    folder = RunFolder(run_dir)
    return instantiate_config(folder.read_config(), str(folder.config), allow)


def instantiate_config(config: dict[str, Any], source: str, allow: tuple[str, ...] = ()) -> RunConfig:
    """Parse a config (a run's config.yaml, or a file of configs/) with `fit`'s own parser and
    instantiate its model and data. Only the seed, model and data are taken: nothing else is
    needed to rebuild the model, and a config may name classes of modules outside phasewatch
    and the installed plug-ins only when `allow` names them (`plugins.check_trusted`): a run
    folder is data, possibly someone else's."""
    task = config.get("data", {}).get("task") if isinstance(config.get("data"), dict) else None
    if not (isinstance(config.get("model"), dict) and isinstance(task, dict) and isinstance(task.get("class_path"), str)
            and isinstance(task.get("init_args") or {}, dict)):
        raise ConfigError("run_dir", f"{source} does not describe a model and a task (model: and data: task: "
                                     "class_path, init_args)", "Give a run folder written by phasewatch fit.")
    saved = {k: config[k] for k in ("seed_everything", "model", "data") if k in config}
    check_trusted(saved, source, allow, bases=(Path(source).parent,))
    with only_trusted_imports(allow):
        cli = _ConfigOnly(TrainModule, TaskDataModule, save_config_callback=None, trainer_defaults=TRAINER_DEFAULTS,
                          seed_everything_default=0, auto_configure_optimizers=False, args=saved, run=False,
                          parser_kwargs=PARSER_KWARGS)
    return RunConfig(config, cli.model, cli.datamodule)

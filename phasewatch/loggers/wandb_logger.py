"""Weights & Biases through Lightning's WandbLogger, never fatal to a training run or
an analysis (`phasewatch analyze` logs to a W&B run of its own: `make_analysis_logger`).

Mode: `WANDB_MODE` when the user set it; otherwise online when an API key is available
(the `WANDB_API_KEY` variable or a `~/.netrc` entry written by `wandb login`), offline
when not, with one line saying where the files are and how to `wandb sync` them.
Any W&B failure turns into one warning; the run folder still gets every value.
"""

from __future__ import annotations

import math
import netrc
import os
import secrets
import string
import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import _DummyExperiment
from lightning.pytorch.loggers import WandbLogger

from phasewatch.rundir import RunFolder


def wandb_mode() -> str:
    """online, offline or disabled, decided without touching the network."""
    if os.environ.get("WANDB_MODE") == "":  # set but empty: W&B's own settings would refuse it
        del os.environ["WANDB_MODE"]
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


def new_run_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def offline_hint(folder: RunFolder, wandb_dir: Path | None = None) -> str:
    """The line saying where an offline run's files go (`wandb_dir`, default the training
    run's `<run_dir>/wandb`) and how to upload them."""
    why = "WANDB_MODE=offline" if os.environ.get("WANDB_MODE") else "no login found"
    wandb_dir = wandb_dir or folder.wandb_dir
    return (f"phasewatch: W&B is offline ({why}); its files go to {wandb_dir}. "
            f"Upload later with: wandb sync {wandb_dir}/offline-run-*")


#: the columns of the run's events table (summary key `transitions/events`); an event lacking one leaves it empty
EVENT_COLUMNS = ("stage", "metric", "direction", "onset", "midpoint", "end", "magnitude", "detected_at", "kind",
                 "confidence", "reason")

#: the columns of the run's stages table (summary key `stages/table`): each stage's latest news
STAGE_COLUMNS = ("id", "said", "name", "onset", "midpoint", "end", "under_way_at_end", "lead", "type", "moved")


def stage_row(what: str, stage) -> list:
    """A stage (phases/stages.py `Stage`) and what was last said of it ("begins", "confirmed",
    "withdrawn") as a row of the stages table (`under_way_at_end`: a member's change had not ended
    at its series' last logged step, `Stage.under_way_at_end`)."""
    moved = ", ".join(f"{m['series']} {m['direction']}" for m in stage.members)
    return [stage.id, what, stage.name, stage.onset, stage.midpoint, stage.end, stage.under_way_at_end, stage.lead,
            stage.type, moved]


def event_row(event: dict) -> list:
    """An event as a row of the events table (an event without a stage is a confirmed transition)."""
    return [event.get("stage", "confirmed") if c == "stage" else event.get(c) for c in EVENT_COLUMNS]


def transition_summary(event: dict) -> dict[str, Any]:
    """A detected phase transition as W&B summary keys
    `transitions/<metric>/<direction>/<onset|midpoint|end|magnitude>`."""
    prefix = f"transitions/{event['metric']}/{event['direction']}"
    return {f"{prefix}/{key}": event[key] for key in ("onset", "midpoint", "end", "magnitude")}


class SafeWandbLogger(WandbLogger):
    """A WandbLogger whose failures become one warning and are then ignored. With `folder`
    set (an offline training run), a resume replays the run folder's history into W&B
    (`restore_checkpoint_state`)."""

    _failed = False
    folder: RunFolder | None = None  # set for an offline run: a resume replays it
    events_of: RunFolder | None = None  # the run folder whose events the events table starts from on resume

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # Lightning passes None, which W&B >= 0.22 warns about
            self._wandb_init.pop("anonymous", None)
        if self._wandb_init.get("mode") == "offline" and "settings" not in self._wandb_init:
            import wandb  # offline, phasewatch says itself where the files are and how to upload them

            self._wandb_init["settings"] = wandb.Settings(silent=True)
        self._rows: list[list] = []  # the events table so far
        self._stages: dict[int, list] = {}  # stage id -> its row of the stages table

    def checkpoint_state(self) -> dict[str, Any]:
        """Kept in each checkpoint, so that resuming from it calls `restore_checkpoint_state`."""
        return {"replay": self.folder is not None}

    def restore_checkpoint_state(self, state: dict[str, Any], step: int) -> None:
        """On resume from a checkpoint (after the run folder has cut what followed it): make
        W&B match the folder. Each process writes a new offline W&B file under the same run
        id, and `wandb sync` of a later file replaces the history of an earlier one
        (wandb/wandb#3841), so the new file gets the whole history the folder holds, rows
        that a kill kept from reaching W&B included, and its events; what came after the
        checkpoint is logged once, by the resumed training. Online runs keep their history on
        the server and replay nothing."""
        if self.folder is None:
            if self.events_of is not None:  # online: the events table starts from the events so far
                self._rows = [event_row(e) for e in self.events_of.read_events()]
            return
        for record in self.folder.read_metrics():
            if isinstance(record.get("step"), int):
                values = {k: math.nan if v is None else v for k, v in record.items() if k != "step"}
                self.log_metrics(values, step=record["step"])
        for event in self.folder.read_events():
            self.log_event(event)

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
    def failed(self) -> bool:
        """True once a W&B call failed (W&B is then off for this run)."""
        return self._failed

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
        """A live event (onset, confirmed, withdrawn; docs/phases.md) into the run's events table
        (summary key `transitions/events`, every event so far); a confirmed transition also into
        the summary (`transition_summary`: the latest of each series and direction). No alert: a
        run's alerts are its stages' (`log_stage`)."""
        import wandb

        self._rows.append(event_row(event))
        table = wandb.Table(columns=list(EVENT_COLUMNS), data=[list(r) for r in self._rows], allow_mixed_types=True)
        self._guard(lambda: self.experiment.summary.update({"transitions/events": table}))
        if event.get("stage", "confirmed") != "confirmed":  # onsets and withdrawals have no midpoint, end, magnitude
            return
        self._guard(lambda: self.experiment.summary.update(transition_summary(event)))

    def log_stage(self, what: str, stage) -> None:
        """A stage's news (the watcher's `stage_news`: "begins", "confirmed", "withdrawn") into the
        run's stages table (summary key `stages/table`, one row per stage: its latest news), and
        a W&B alert when a stage is confirmed (one per stage). W&B offers no marks on its
        charts' x-axis from the SDK (docs/stages.md, Live)."""
        import wandb

        if what == "withdrawn" and stage.id in self._stages:
            self._stages[stage.id][1] = what
        else:
            self._stages[stage.id] = stage_row(what, stage)
        table = wandb.Table(columns=list(STAGE_COLUMNS), data=[list(self._stages[k]) for k in sorted(self._stages)],
                            allow_mixed_types=True)
        self._guard(lambda: self.experiment.summary.update({"stages/table": table}))
        if what == "confirmed":
            self._guard(lambda: self.experiment.alert(title=f"stage {stage.id} {stage.name or '(unnamed)'}",
                                                      text=stage.summary(), level=wandb.AlertLevel.INFO))

    def log_tables(self, tables: dict[str, tuple[list[str], list[list]]]) -> None:
        """W&B Tables in the run's summary: {key: (columns, rows)}."""
        import wandb

        self._guard(lambda: self.experiment.summary.update(
            {key: wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
             for key, (columns, rows) in tables.items()}))

    def finalize(self, status):
        """Close the W&B run at the end of fit (Lightning leaves it open, and the next
        run in the same process would silently log into it)."""
        self._guard(super().finalize, status)
        if self._experiment is not None and not self._failed:
            self._guard(self._experiment.finish, exit_code=0 if status == "success" else 1)
            self._experiment = None


def make_wandb_logger(folder: RunFolder, name: str, project: str, config: dict[str, Any],
                      resume_step: int | None = None, group: str | None = None) -> SafeWandbLogger | None:
    """A logger writing under `<run_dir>/wandb`, resuming the W&B run id kept in the run
    folder (a new run takes `WANDB_RUN_ID` when `wandb agent` set it, so that the run
    joins the agent's sweep); None when W&B is disabled. Resuming from a checkpoint at
    `resume_step`, an online run rewinds W&B's history to that step (`resume_from`, W&B's
    rewind), so the steps after it are not logged twice. The run's group
    (`WANDB_RUN_GROUP`, e.g. set by `phasewatch sweep`) is kept in the folder too, for
    the runs of `phasewatch analyze`. A population's member gives its `group` (the
    population's name) and runs beside the other members' W&B runs in this process."""
    mode = wandb_mode()
    if mode == "disabled":
        return None
    member = group is not None  # a population's member: one W&B run of several in this process
    run_id = folder.wandb_id()
    if run_id is None:  # `wandb agent` chooses the id of each sweep run (WANDB_RUN_ID), not of a member's
        run_id = (None if member else os.environ.get("WANDB_RUN_ID")) or new_run_id()
        folder.set_wandb_id(run_id)
    group = group or os.environ.get("WANDB_RUN_GROUP") or None  # passed on: W&B reads its environment once per process
    if group:
        folder.set_wandb_group(group)
    if mode == "offline":
        print(offline_hint(folder))
    rewind = mode == "online" and resume_step is not None
    logger = SafeWandbLogger(
        name=name, project=project, save_dir=str(folder.root), id=run_id, mode=mode, config=config, group=group,
        log_model=False, **({"reinit": "create_new"} if member else {}), **({"resume_from": f"{run_id}?_step={resume_step}", "resume": None} if rewind else {"resume": "allow"}),
    )
    logger.folder = folder if mode == "offline" else None  # a resumed offline run replays the folder's history
    logger.events_of = folder
    return logger


def make_analysis_logger(folder: RunFolder, config: dict[str, Any], probes: list[str],
                         options: dict[str, Any]) -> SafeWandbLogger | None:
    """The W&B run of one `phasewatch analyze`: a new run in the training run's project,
    named `<run>-analyze-<probes>` (job type `analyze`), with the training run's config
    plus `analyze` (probes, options, the training run's W&B id), in the training run's
    group when it had one (e.g. its sweep's). Its values are logged
    against `trainer/global_step`, the training run's x-axis, so both plot on one chart;
    transitions go to its summary as in training.

    A separate run, not the training run resumed: an offline run resumed in a second folder
    replaces the first one's history when both are synced. None when W&B is disabled or
    the run was trained with `--no_wandb`.
    """
    return make_side_logger(folder, config, "analyze", f"analyze-{'-'.join(probes)}",
                            {"probes": probes, "options": options})


def make_side_logger(folder: RunFolder, config: dict[str, Any], job_type: str, label: str,
                     details: dict[str, Any]) -> SafeWandbLogger | None:
    """A new W&B run beside a training run, for work done on it afterwards (`analyze`,
    `diff`): named `<run>-<label>`, of `job_type`, in the training run's project and group,
    with the training run's config plus `<job_type>` (`details` and the training run's W&B
    id). Its files go to `<run_dir>/<job_type>/wandb/` (`RunFolder.side_wandb_dir`), never the
    training run's `wandb/`, whose `latest-run` and `offline-run-*` stay the training run's; one
    line says where. None when W&B is disabled or the run was trained with `--no_wandb`."""
    mode = wandb_mode()
    if mode == "disabled" or config.get("wandb") is False:
        return None
    group = folder.wandb_group() or os.environ.get("WANDB_RUN_GROUP")
    wandb_dir = folder.side_wandb_dir(job_type)
    if mode == "offline":
        print(offline_hint(folder, wandb_dir))
    else:
        print(f"phasewatch: the W&B run of this {job_type} keeps its local files in {wandb_dir}")
    try:
        wandb_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # W&B's own attempt fails the same way, and becomes one warning (SafeWandbLogger)
    return SafeWandbLogger(
        name=f"{folder.root.name}-{label}", project=config.get("wandb_project") or "phasewatch",
        save_dir=str(wandb_dir.parent), id=new_run_id(), mode=mode,
        config={**config, job_type: {**details, "training_run_id": folder.wandb_id()}},
        job_type=job_type, group=group or None, log_model=False,
    )

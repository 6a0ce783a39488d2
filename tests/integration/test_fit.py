"""`phasewatch fit` end to end with a real Lightning Trainer and real TransformerLens models."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from phasewatch.cli.main import main
from phasewatch.rundir import read_jsonl

from . import wandb_records, warm

TINY = ["--model.arch.d_model", "16", "--model.arch.n_heads", "2", "--model.arch.d_head", "8",
        "--model.arch.d_mlp", "32", "--trainer.enable_progress_bar", "false"]

TASKS = {
    "modular_addition": ["--data.task", "ModularAddition", "--data.task.p", "13", "--data.task.frac_train", "0.5"],
    "digit_addition": ["--data.task", "DigitAddition", "--data.task.n_digits", "2", "--data.task.batch_size", "8",
                       "--data.task.n_val", "32"],
    "induction": ["--data.task", "Induction", "--data.task.vocab_size", "10", "--data.task.seq_len", "13",
                  "--data.task.max_len", "6", "--data.task.batch_size", "8", "--data.task.n_val", "16"],
    "rasp": ["--data.task", "RaspTask", "--data.task.program", "reverse", "--data.task.vocab", "[1, 2, 3]",
             "--data.task.max_seq_len", "5", "--data.task.batch_size", "8"],
}


def fit(run_dir, *args, steps=12):
    return main(["fit", *args, "--run_dir", str(run_dir), "--trainer.max_steps", str(steps),
                 "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2", "--no_wandb", *TINY])


@pytest.mark.parametrize("task", sorted(TASKS))
def test_fit_writes_the_run_folder(tiny_runs, task):
    run = tiny_runs(task)  # fit(run, *TASKS[task]) (conftest.py)
    records = list(read_jsonl(run / "metrics.jsonl"))
    train = [r for r in records if "train/loss" in r]
    val = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in train] == [1, 3, 5, 7, 9, 11]  # batch index of every 2nd step
    assert [r["step"] for r in val] == [4, 8, 12]  # after 4, 8, 12 optimizer steps
    assert all(0 <= r["val/acc"] <= 1 and r["val/loss"] > 0 for r in val)
    assert all({"train/acc", "lr"} <= set(r) for r in train)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["arch"]["d_model"] == 16 and cfg["run_dir"] == str(run)
    assert cfg["checkpoints"]["schedule"]["kind"] == "log"  # resolved, not a placeholder
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "last.ckpt" in ckpts and "step=0000000.ckpt" in ckpts and "step=0000012.ckpt" in ckpts
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 12


def test_config_yaml_reruns_the_same_run(tmp_path, tiny_runs):
    first = tiny_runs("modular_addition")  # fit(first, *TASKS["modular_addition"]) (conftest.py)
    again = tmp_path / "b"
    assert main(["fit", "--config", str(first / "config.yaml"), "--run_dir", str(again), "--no_wandb"]) == 0
    strip = lambda p: [json.dumps(r) for r in read_jsonl(p / "metrics.jsonl")]  # noqa: E731
    assert strip(first) == strip(again)


def test_modular_training_learns(grokking_run):
    """A small model memorises a small modular-addition training set: train accuracy rises
    (conftest.py's 300 steps on (a + b) mod 11)."""
    train = [r for r in read_jsonl(grokking_run / "metrics.jsonl") if "train/acc" in r]
    assert train[0]["train/acc"] < 0.3 and train[-1]["train/acc"] == 1.0


#: events on both sides of the kill (step 78 or soon after; last.ckpt at 60): onsets from step 7 on, an
#: onset and a confirmation at 75 (said again after the resume), onsets pending across the kill (some
#: withdrawn at 79 and 86, the rest when training ends), confirmed ones before and after it (the Fourier
#: measures): what 200 steps killed at 90 had, in half the steps
STEPS, KILL_AT = 100, 78
# last.ckpt every 20 steps and no scheduled checkpoints in between
RESUME_CHECKPOINTS = ["--checkpoints.last_every", "20", "--checkpoints.schedule.kind", "list",
                      "--checkpoints.schedule.steps", "[0]"]


def _warm_fit(run_dir, *extra):
    """The run as its own `python -m phasewatch fit` process (warm: tests/integration/warm.py),
    with an offline W&B run."""
    args = ["fit", *TASKS["modular_addition"], "--run_dir", run_dir, "--trainer.max_steps", STEPS,
            "--trainer.val_check_interval", "25", "--trainer.log_every_n_steps", "5", *RESUME_CHECKPOINTS, *TINY, *extra]
    return warm.start(args, Path(f"{run_dir}.out"), env=wandb_records.offline_env())


def test_killed_run_resumes_without_gaps_or_duplicates(tmp_path, warm_phasewatch):
    """Killed mid-run and resumed from last.ckpt, with W&B offline: the run folder and the W&B
    history that `wandb sync` uploads (the newest offline file, README) equal an uninterrupted
    run's, step by step. Each run is a process of its own (the uninterrupted one alongside)."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    proc = _warm_fit(killed)
    uninterrupted = _warm_fit(whole)
    deadline = time.time() + 300
    while time.time() < deadline:  # SIGKILL it mid-run
        steps = [r["step"] for r in read_jsonl(killed / "metrics.jsonl")]
        if steps and max(steps) >= KILL_AT:
            break
        assert proc.poll() is None, proc.output()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    last_step = torch.load(killed / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    logged = max(r["step"] for r in read_jsonl(killed / "metrics.jsonl"))
    assert 0 < last_step <= logged < STEPS  # killed mid-run; what came after last.ckpt is rolled back

    resume = warm.start(["fit", "--run_dir", killed, "--ckpt_path", "last"], tmp_path / "resume.out",
                        env=wandb_records.offline_env())
    assert resume.wait() == 0, resume.output()
    assert uninterrupted.wait() == 0, uninterrupted.output()
    resumed, reference = list(read_jsonl(killed / "metrics.jsonl")), list(read_jsonl(whole / "metrics.jsonl"))
    keys = lambda rs: [(r["step"], sorted(r)) for r in rs]  # noqa: E731
    assert keys(resumed) == keys(reference)  # every step and key exactly once
    assert resumed == reference  # same seed, data order, optimizer state: the very same numbers
    # and the live transition detector reported the same events, none twice
    events = list(read_jsonl(whole / "events.jsonl"))
    assert {"onset", "confirmed", "withdrawn"} <= {e["stage"] for e in events}  # something to compare
    assert min(e["detected_at"] for e in events) < last_step < max(e["detected_at"] for e in events)  # either side
    assert list(read_jsonl(killed / "events.jsonl")) == events
    # W&B: two offline files for the killed run (one per process), one for the uninterrupted run; the
    # newest holds the whole history, every step once, with the uninterrupted run's values
    (reference_wandb,), offline = wandb_records.offline_runs(whole), wandb_records.offline_runs(killed)
    assert len(offline) == 2
    history = wandb_records.by_step(wandb_records.history(offline[-1]))
    assert history == wandb_records.by_step(wandb_records.history(reference_wandb))
    assert sorted(history) == sorted({r["step"] for r in reference})
    tables = [wandb_records.summary_table(o, "transitions/events")["data"] for o in (offline[-1], reference_wandb)]
    assert tables[0] == tables[1]


#: 60 steps (validations at 25 and 50): stopped after its first 3 lines of metrics (step ~2: the grokking
#: probe logs a row at almost every step of its log schedule), it has most
#: of its steps and both validations still to run when resumed
INTERRUPTED = ["--trainer.max_steps", "60", "--trainer.val_check_interval", "25", "--trainer.log_every_n_steps",
               "5", "--checkpoints.last_every", "1000", "--checkpoints.schedule.kind", "list",
               "--checkpoints.schedule.steps", "[0]", "--no_wandb", *TASKS["modular_addition"], *TINY]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The metrics of the run `test_a_stopped_run_...` interrupts, trained without interruption."""
    run = tmp_path_factory.mktemp("whole") / "run"
    assert main(["fit", "--run_dir", str(run), *INTERRUPTED]) == 0
    return list(read_jsonl(run / "metrics.jsonl"))


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143),  # Ctrl-C takes the same path: slow-marked (CI time)
                                           pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_stopped_run_says_so_and_how_to_resume_it(tmp_path, uninterrupted, signum, status, warm_phasewatch):
    """SIGTERM (a scheduler's, `kill`) or Ctrl-C mid-run: the status a shell gives a command
    killed by that signal, not 0; one line with the step and the resume command; last.ckpt at
    that step (SIGTERM: Lightning stops after the step, which is saved; Ctrl-C stops at once,
    resuming from the last checkpoint); the report written; and the printed command resumes
    the run (each a process of its own) to the same metrics as an uninterrupted run."""
    run = tmp_path / "run"
    proc = warm.start(["fit", "--run_dir", run, *INTERRUPTED], tmp_path / "fit.out")
    deadline = time.time() + 300
    while time.time() < deadline and len(list(read_jsonl(run / "metrics.jsonl"))) < 3:
        assert proc.poll() is None, proc.output()
        time.sleep(0.01)
    proc.send_signal(signum)
    proc.wait(timeout=300)
    out = proc.output()
    assert proc.returncode == status, out
    match = re.search(r"^phasewatch: interrupted at step (\d+); resume with: (phasewatch fit --run_dir (\S+) "
                      r"--ckpt_path last)(?: \(from its last checkpoint, step (\d+)\))?$", out, re.MULTILINE)
    assert match, out
    step, command, folder, saved = int(match[1]), match[2], match[3], match[4]
    assert Path(folder) == run and 0 < step < 60
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    if signum == signal.SIGTERM:
        assert saved is None and last == step  # saved at the step it stopped at (last_every would not have)
    else:
        assert int(saved) == last <= step
    report = (run / "report.html").read_text()
    assert 'http-equiv="refresh"' not in report  # the final report, not the live one
    assert not (run / ".lock").exists()

    program, *args = command.split()
    assert program == "phasewatch"
    resume = warm.start(args, tmp_path / "resume.out")  # python -m phasewatch ARGS
    assert resume.wait(timeout=600) == 0, resume.output()
    assert "interrupted" not in resume.output()
    assert list(read_jsonl(run / "metrics.jsonl")) == uninterrupted  # every step once, the same numbers


def test_sigterm_after_the_checkpoints_hook_still_saves_its_step(tmp_path, uninterrupted, monkeypatch, capsys):
    """SIGTERM that arrives after the step's callbacks have run (here raised from the module's
    own `on_train_batch_end`, which Lightning calls after every callback's; a scheduler's signal
    lands there at random, and logging and validation follow it before Lightning stops): the
    run still stops with last.ckpt at the step it reached, and resumes to the same metrics as
    an uninterrupted run."""
    from phasewatch.training.module import TrainModule

    sent, own = [], TrainModule.on_train_batch_end

    def on_train_batch_end(self, outputs, batch, batch_idx):
        own(self, outputs, batch, batch_idx)
        if not sent and self.global_step >= 7:
            sent.append(self.global_step)
            signal.raise_signal(signal.SIGTERM)  # Lightning's handler notes it; the process goes on

    monkeypatch.setattr(TrainModule, "on_train_batch_end", on_train_batch_end)
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *INTERRUPTED]) == 143
    out = "".join(capsys.readouterr())
    assert f"phasewatch: interrupted at step {sent[0]}; resume with: phasewatch fit --run_dir {run} --ckpt_path last\n" in out
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == sent[0]
    monkeypatch.undo()
    assert main(["fit", "--run_dir", str(run), "--ckpt_path", "last"]) == 0
    assert list(read_jsonl(run / "metrics.jsonl")) == uninterrupted


def test_a_full_disk_at_the_sigterm_save_still_stops_as_sigterm(tmp_path, monkeypatch, capsys):
    """The save of the step SIGTERM stopped at (`ScheduledCheckpoints.on_exception`) meets a
    full disk: one line says last.ckpt was not saved there, and the run stops as SIGTERM stops
    it (status 143, the stop line naming the older last.ckpt, the report)."""
    from phasewatch.callbacks import checkpoints
    from phasewatch.errors import DiskFull
    from phasewatch.training.module import TrainModule

    sent, own, save = [], TrainModule.on_train_batch_end, checkpoints.ScheduledCheckpoints._save

    def on_train_batch_end(self, outputs, batch, batch_idx):
        own(self, outputs, batch, batch_idx)
        if not sent and self.global_step >= 7:
            sent.append(self.global_step)
            signal.raise_signal(signal.SIGTERM)

    def full_at_the_stop(self, trainer, name, *args, **kwargs):
        if trainer.state.status == "interrupted":
            raise DiskFull.in_run(tmp_path / "run", name, 1000)
        return save(self, trainer, name, *args, **kwargs)

    monkeypatch.setattr(TrainModule, "on_train_batch_end", on_train_batch_end)
    monkeypatch.setattr(checkpoints.ScheduledCheckpoints, "_save", full_at_the_stop)
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *INTERRUPTED]) == 143
    out = "".join(capsys.readouterr())
    assert f"phasewatch: last.ckpt not saved at step {sent[0]}: " in out and "is full" in out
    assert f"interrupted at step {sent[0]}; resume with: phasewatch fit --run_dir {run} --ckpt_path last " \
           "(from its last checkpoint, step 0)" in out
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 0
    assert (run / "report.html").exists()


def test_wandb_offline_run_and_sync_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    run = tmp_path / "run"
    assert main(["fit", *TASKS["modular_addition"], "--run_dir", str(run), "--trainer.max_steps", "6",
                 "--trainer.val_check_interval", "3", *TINY]) == 0
    out = capsys.readouterr().out
    assert "W&B is offline" in out and "wandb sync" in out
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    assert (run / "wandb_id").read_text().strip() in offline[0].name


def test_wandb_failure_does_not_stop_training(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb").write_text("not a directory")  # W&B cannot create its folder
    with pytest.warns(UserWarning, match="W&B logging failed"):
        assert main(["fit", *TASKS["modular_addition"], "--run_dir", str(run), "--trainer.max_steps", "6",
                     "--trainer.val_check_interval", "3", *TINY]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "val/loss" in r] == [3, 6]


@pytest.mark.parametrize("step", [0, 17])
def test_resuming_from_a_checkpoint_between_validations_logs_exactly_as_an_uninterrupted_run(tmp_path, step):
    """A checkpoint saved at the end of a training batch (step 17; validations at 10, 20,
    ...) or before the first one (step 0): the resumed run rolls metrics.jsonl back to it
    and writes the same lines again, in the same order."""
    import shutil

    args = ["--data.task.p", "23", "--trainer.max_steps", "40", "--trainer.val_check_interval", "10",
            "--trainer.log_every_n_steps", "5", "--probes.names", "[]", "--no_wandb",
            "--trainer.enable_progress_bar", "false", "--checkpoints.schedule", '{"kind": "list", "steps": [0, 17, 40]}']
    assert main(["fit", *args, "--run_dir", str(tmp_path / "a")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    ckpt = tmp_path / "b" / "checkpoints" / f"step={step:07d}.ckpt"
    assert main(["fit", "--run_dir", str(tmp_path / "b"), "--ckpt_path", str(ckpt)]) == 0
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == (tmp_path / "a" / "metrics.jsonl").read_text()


def test_an_online_resume_rewinds_wandb_to_the_checkpoint_step(tmp_path, monkeypatch):
    """Online, a resumed run asks W&B to rewind its history to the checkpoint's step (`resume_from`,
    which W&B's own settings accept), so the steps after it are not logged twice; a new run and an
    offline resume do not rewind (offline, the newest file replays the run folder instead)."""
    import wandb

    from phasewatch.rundir import RunFolder
    from phasewatch.loggers.wandb_logger import make_wandb_logger

    monkeypatch.setenv("WANDB_MODE", "online")
    folder = RunFolder(tmp_path / "run")
    folder.create()
    resumed = make_wandb_logger(folder, "run", "phasewatch", {}, resume_step=120)
    run_id = folder.wandb_id()
    assert resumed._wandb_init["resume_from"] == f"{run_id}?_step=120" and resumed._wandb_init["resume"] is None
    moment = wandb.Settings(run_id=run_id, resume_from=resumed._wandb_init["resume_from"]).resume_from
    assert (moment.run, moment.metric, moment.value) == (run_id, "_step", 120)
    new = make_wandb_logger(folder, "run", "phasewatch", {})
    assert "resume_from" not in new._wandb_init and new._wandb_init["resume"] == "allow"
    monkeypatch.setenv("WANDB_MODE", "offline")
    offline = make_wandb_logger(folder, "run", "phasewatch", {}, resume_step=120)
    assert "resume_from" not in offline._wandb_init and offline.folder is folder

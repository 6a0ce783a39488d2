"""Hardening: a checkpoint or run folder from someone else never runs code; bad files get one line."""

import os
import shutil
import sys
import textwrap

import pytest
import torch
import yaml

from phasewatch.rundir import RunFolder
from phasewatch.trainers.cli import main

TINY = ["--data.task", "ModularAddition", "--data.task.p", "11", "--model.arch.d_model", "16",
        "--model.arch.n_heads", "2", "--model.arch.d_mlp", "32", "--trainer.enable_progress_bar", "false",
        "--no_wandb", "--probes.names", "[]"]


class Payload:
    """Unpickling this calls os.system: what a crafted checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted(path, marker):
    torch.save({"state_dict": {"w": Payload(marker)}, "global_step": 0, "model": {}, "config": {}}, path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hardening") / "run"
    assert main(["fit", *TINY, "--run_dir", str(run), "--trainer.max_steps", "12",
                 "--trainer.val_check_interval", "4"]) == 0
    return run


def one_error(capsys) -> str:
    """The command's output on stderr: exactly one line, phasewatch's error."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(("phasewatch", "Traceback"))]
    assert len(lines) == 1 and lines[0].startswith("phasewatch: error: "), lines
    return lines[0]


def test_the_crafted_checkpoint_does_run_code_when_unpickled(tmp_path):
    """The test's own premise: loading the file the unsafe way runs the command."""
    marker = tmp_path / "ran"
    path = crafted(tmp_path / "evil.ckpt", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("command", ["fit with run_dir", "validate with run_dir", "fit without run_dir",
                                     "analyze run", "trajectory run", "analyze pth"])
def test_a_crafted_checkpoint_is_refused_by_every_command_and_runs_nothing(run, tmp_path, capsys, command):
    marker = tmp_path / "ran"
    evil = crafted(tmp_path / "evil.ckpt", marker)
    copy = tmp_path / "their-run"
    shutil.copytree(run, copy)
    first = next(iter(RunFolder(copy).checkpoint_steps().values()))
    crafted(first, marker)  # a run folder someone sent, one of its step checkpoints crafted
    argv = {
        "fit with run_dir": ["fit", "--run_dir", str(copy), "--ckpt_path", str(evil)],
        "validate with run_dir": ["validate", "--run_dir", str(copy), "--ckpt_path", str(evil)],
        "fit without run_dir": ["fit", *TINY, "--ckpt_path", str(evil), "--trainer.max_steps", "12"],
        "analyze run": ["analyze", str(copy), "--probes", "grokking", "--no_wandb", "--device", "cpu"],
        "trajectory run": ["trajectory", str(copy)],
        "analyze pth": ["analyze", str(evil)],
    }[command]
    assert main(argv) == 2
    error = one_error(capsys)
    assert "other than tensors and plain data" in error
    assert not marker.exists()


def test_a_truncated_step_checkpoint_is_named_with_the_fix(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    steps = RunFolder(copy).checkpoint_steps()
    last_step, last = list(steps.items())[-1]
    last.write_bytes(last.read_bytes()[:200])
    assert main(["trajectory", str(copy)]) == 2
    error = one_error(capsys)
    assert f"{last} is truncated or corrupt" in error
    assert f"e.g. {list(steps.values())[-2]}" in error  # the newest other one
    text = tmp_path / "not-a-checkpoint.txt"
    text.write_text("hello\n")
    assert main(["analyze", str(text)]) == 2  # was IndexError: pop from empty list
    assert f"{text} cannot be read by torch.load" in one_error(capsys)


def test_a_run_config_naming_foreign_code_is_refused_unless_allowed(run, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "theirmod.py").write_text(textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(marker)!r}).touch()
        from phasewatch.tasks import ModularAddition

        class TheirTask(ModularAddition):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    copy = tmp_path / "their-run"
    shutil.copytree(run, copy)
    folder = RunFolder(copy)
    config = folder.read_config()
    config["data"]["task"]["class_path"] = "theirmod.TheirTask"
    folder.config.write_text(yaml.safe_dump(config))
    for argv in (["analyze", str(copy), "--probes", "grokking", "--no_wandb", "--device", "cpu"],
                 ["trajectory", str(copy)]):
        assert main(argv) == 2
        error = one_error(capsys)
        assert "names 'theirmod.TheirTask'" in error and "--allow theirmod" in error
        assert not marker.exists() and "theirmod" not in sys.modules
    # named by the user, it is trusted: imported, and the analysis runs
    assert main(["analyze", str(copy), "--probes", "grokking", "--no_wandb", "--device", "cpu",
                 "--allow", "theirmod"]) == 0
    assert marker.exists()

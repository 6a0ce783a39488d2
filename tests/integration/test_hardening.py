"""Hardening: a checkpoint or run folder from someone else never runs code; bad files get one line."""

import os
import shutil
import sys
import textwrap

import pytest
import torch
import yaml

from phasewatch.rundir import RunFolder
from phasewatch.cli.main import main

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


def _their_module(tmp_path, monkeypatch):
    """A module that leaves a marker when imported, on the path: what a crafted config would name."""
    marker = tmp_path / "imported"
    (tmp_path / "theirmod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("theirmod", None)  # a test that saw it imported must not fail the next one
    return marker


#: every way found for a config to name code: form -> (section, key, the value written there). Each is
#: tried as `fit --run_dir D --ckpt_path last` resumes a run folder and, where analyze reads the
#: section (it rebuilds the model and data only), as analyze reads it.
CRAFTED_FORMS = {
    "class name as a string": ("data", "task", "theirmod.X"),
    "inline YAML for data": (None, "data", '{"task": {"class_path": "theirmod.X"}}'),
    "inline YAML for the task": ("data", "task", '{"class_path": "theirmod.X"}'),
    "block scalar for the task": ("data", "task", "class_path: theirmod.X\ninit_args: {p: 11}\n"),
    "quoted class name": ("data", "task", "'theirmod.X'"),
    "class name and a comment": ("data", "task", "theirmod.X  # the task"),
    "path to another config": (None, "data", "{tmp}/other.yaml"),
    "path without an extension": ("data", "task", "{tmp}/other"),
    "path relative to the run folder": ("data", "task", "task-spec"),
    "class path as a mapping": ("data", "task", {"class_path": "theirmod.X"}),
    "trainer plugin as inline YAML": ("trainer", "plugins", "class_path: theirmod.X"),
    "trainer callback in a list": ("trainer", "callbacks", ['{"class_path": "theirmod.X"}']),
    "trainer logger as a mapping": ("trainer", "logger", {"class_path": "theirmod.X"}),
    "colon form": ("data", "task", "theirmod:X"),
}


@pytest.mark.parametrize("form, command", [(form, command) for form in sorted(CRAFTED_FORMS)
                                           for command in ("analyze", "fit --ckpt_path last")
                                           if command.startswith("fit") or CRAFTED_FORMS[form][0] != "trainer"])
def test_no_form_of_a_crafted_config_gets_its_module_imported(run, tmp_path, capsys, monkeypatch, form, command):
    marker = _their_module(tmp_path, monkeypatch)
    (tmp_path / "other.yaml").write_text("task: {class_path: theirmod.X}\n")
    (tmp_path / "other").write_text("class_path: theirmod.X\ninit_args: {p: 11}\n")
    copy = tmp_path / "their-run"
    shutil.copytree(run, copy)
    (copy / "task-spec").write_text("class_path: theirmod.X\n")
    folder = RunFolder(copy)
    config = folder.read_config()
    section, key, value = CRAFTED_FORMS[form]
    if isinstance(value, str):
        value = value.replace("{tmp}", str(tmp_path))
    (config if section is None else config.setdefault(section, {}))[key] = value
    folder.config.write_text(yaml.safe_dump(config))
    argv = (["fit", "--run_dir", str(copy), "--ckpt_path", "last"] if command.startswith("fit")
            else ["analyze", str(copy), "--probes", "grokking", "--no_wandb", "--device", "cpu"])
    assert main(argv) == 2
    one_error(capsys)
    assert not marker.exists() and "theirmod" not in sys.modules


def test_jsonargparse_itself_refuses_foreign_imports_while_a_run_folder_is_parsed(tmp_path, monkeypatch):
    """The guard behind check_trusted: whatever form reached the parser, its import is refused
    before the module runs, and the policy is lifted afterwards."""
    from jsonargparse import ArgumentParser

    from phasewatch.plugins import only_trusted_imports
    from phasewatch.tasks.base import Task

    marker = _their_module(tmp_path, monkeypatch)
    (tmp_path / "theirmod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                          "from phasewatch.tasks import ModularAddition as X\n")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=Task)
    for value in ({"class_path": "theirmod.X"}, "class_path: theirmod.X", "theirmod.X"):
        with only_trusted_imports(("mylab",)):
            with pytest.raises(Exception, match="theirmod"):
                parser.instantiate_classes(parser.parse_object({"task": value}))
        assert not marker.exists() and "theirmod" not in sys.modules
    with only_trusted_imports(("theirmod",)):  # allowed by name: imported
        parser.parse_object({"task": {"class_path": "theirmod.X", "init_args": {"p": 11}}})
    assert marker.exists()
    marker.unlink()
    sys.modules.pop("theirmod")
    parser.parse_object({"task": {"class_path": "theirmod.X", "init_args": {"p": 11}}})  # the policy is lifted
    assert marker.exists()
    sys.modules.pop("theirmod")


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
    sys.modules.pop("theirmod", None)  # imported by an earlier test of another module of that name
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


BAD_INPUTS = {  # argv -> the field the one line must name
    "missing config file": (["--config", "/nonexistent/config.yaml"], "config"),
    "config that is a list": (["--config", "{tmp}/list.yaml"], "config"),
    "YAML syntax error": (["--config", "{tmp}/broken.yaml"], "config"),
    "unknown key": (["--model.lrr", "3"], "arguments"),
    "schedule not a mapping": (["--probes.schedule", "garbage"], "probes.schedule"),
    "unknown schedule kind": (["--probes.schedule.kind", "banana"], "probes.schedule.kind"),
    "probe schedule count": (["--probes.schedule.count", "-3"], "probes.schedule.count"),
    "negative learning rate": (["--model.lr", "-1e-3"], "model.lr"),
    "options of a probe not run": (["--probes.options", '{"llc": {"draws": 3}}'], "probes.options"),
    "zero steps": (["--trainer.max_steps", "0"], "trainer.max_steps"),
    "negative steps": (["--trainer.max_steps", "-5"], "trainer.max_steps"),
    "modulus too large for memory": (["--data.task.p", "1000000"], "data.task.p"),
    "run name too long": (["--run_dir", "{tmp}/" + "a" * 300], "run_dir"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_every_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("model: [\n")
    args, field = BAD_INPUTS[case]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    run = tmp_path / "run"
    argv = ["fit", "--no_wandb", "--trainer.max_steps", "5", *(["--run_dir", str(run)] if "--run_dir" not in args else []),
            *args]
    assert main(argv) == 2
    out = capsys.readouterr().err.splitlines()
    assert not [ln for ln in out if ln.startswith(("usage:", "Traceback"))]
    error = one_error_of(out)
    assert error.startswith(f"phasewatch: error: {field}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.yaml", "list.yaml"]  # nothing written


def one_error_of(lines: list[str]) -> str:
    (error,) = [ln for ln in lines if ln.startswith("phasewatch")]
    return error


def test_a_negative_learning_rate_typed_without_equals_reaches_the_field_check(tmp_path, capsys):
    """`--model.lr -1e-3` is parsed as a value (it used to read as an unknown flag)."""
    assert main(["fit", "--no_wandb", "--model.lr", "-1e-3", "--run_dir", str(tmp_path / "r")]) == 2
    assert "got -0.001" in one_error_of(capsys.readouterr().err.splitlines())


def test_compile_refuses_bad_arguments_in_one_line(capsys):
    assert main(["compile", "reverse", "--vocab", "[1,2"]) == 2
    assert one_error_of(capsys.readouterr().err.splitlines()).startswith("phasewatch: error: vocab: ")
    assert main(["compile", "reverse", "--max-seq-len", "0"]) == 2  # as fit refuses it
    assert one_error_of(capsys.readouterr().err.splitlines()).startswith("phasewatch: error: data.task.max_seq_len: ")


def test_output_cut_short_by_the_reader_ends_quietly():
    """`phasewatch tasks | head -c 0`: the reader is gone before anything is written, so the output
    is cut short whatever the child's buffering and speed (read 20 bytes first, the test passed only
    under PYTHONUNBUFFERED=1: buffered, the 2.3 kB go out in one write at exit, status 0)."""
    import subprocess

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "phasewatch", "tasks"], stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert proc.wait() == 141 and b"Traceback" not in proc.stderr.read()


def test_a_full_disk_mid_run_is_one_line_leaves_no_temporary_file_and_resumes(tmp_path, capsys, monkeypatch):
    import errno

    from lightning.fabric.plugins.io import torch_io

    real = torch_io._atomic_save
    calls = []

    def fills_the_disk(checkpoint, path):  # the third checkpoint write runs out of space half-way
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(checkpoint, path)

    monkeypatch.setattr(torch_io, "_atomic_save", fills_the_disk)
    run = tmp_path / "run"
    assert main(["fit", *TINY, "--run_dir", str(run), "--trainer.max_steps", "12",
                 "--trainer.val_check_interval", "4"]) == 2
    error = one_error_of(capsys.readouterr().err.splitlines())
    assert error.startswith(f"phasewatch: error: run_dir: the disk of {run} is full: writing step=")
    assert f"resume: phasewatch fit --run_dir {run} --ckpt_path last" in error
    assert not list(RunFolder(run).checkpoints.glob("*.tmp"))
    monkeypatch.setattr(torch_io, "_atomic_save", real)  # space freed
    assert main(["fit", "--run_dir", str(run), "--ckpt_path", "last"]) == 0
    assert max(r["step"] for r in RunFolder(run).read_metrics()) >= 11


def test_a_full_disk_while_writing_the_report_keeps_the_old_one(run, tmp_path, capsys, monkeypatch):
    import errno
    import pathlib

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = RunFolder(copy).report.read_text()
    real = pathlib.Path.write_text

    def full(self, data, *args, **kwargs):
        if self.name.endswith(".tmp"):
            real(self, data[:100], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    assert main(["report", str(copy)]) == 2
    assert "is full: writing report.html" in one_error_of(capsys.readouterr().err.splitlines())
    assert RunFolder(copy).report.read_text() == before and not list(copy.glob("*.tmp"))


def test_a_module_built_in_python_saves_hyperparameters_that_load_without_code(tmp_path):
    """TrainModule(arch=ModelConfig(...)) keeps its architecture as plain data in the hyperparameters
    Lightning saves, so its checkpoints pass `read_checkpoint` (weights only)."""
    from phasewatch.models import ModelConfig
    from phasewatch.rundir import read_checkpoint
    from phasewatch.tasks import ModularAddition
    from phasewatch.training.module import TrainModule

    module = TrainModule(task=ModularAddition(p=11, frac_train=0.5), arch=ModelConfig(d_model=16, n_heads=2, d_mlp=32))
    assert module.hparams["arch"]["d_model"] == 16
    path = tmp_path / "step=0000000.ckpt"
    torch.save({"state_dict": module.state_dict(), "global_step": 0, "hyper_parameters": dict(module.hparams)}, path)
    assert read_checkpoint(path)["hyper_parameters"]["arch"]["d_model"] == 16


@pytest.mark.slow  # 90 s; one kill and resume is compared with W&B step by step in test_fit.py (default suite)
def test_wandb_matches_the_run_folder_after_several_kills(tmp_path):
    """kill -9 three times, each at a random moment, then resume: the newest offline W&B file
    (the one `wandb sync` leaves standing, as a later file of the same id replaces an earlier
    one's history) holds exactly the run folder's history, row by row: rows a kill kept from
    reaching W&B are there, rows after a checkpoint are there once."""
    import random
    import signal
    import subprocess
    import time

    from phasewatch.rundir import read_jsonl

    from . import wandb_records

    run = tmp_path / "run"
    env = wandb_records.offline_env()
    first = [sys.executable, "-m", "phasewatch", "fit", *[a for a in TINY if a != "--no_wandb"], "--run_dir", str(run),
             "--trainer.max_steps", "400", "--trainer.val_check_interval", "20", "--trainer.log_every_n_steps", "5",
             "--checkpoints.last_every", "30", "--checkpoints.schedule.kind", "list", "--checkpoints.schedule.steps", "[0]"]
    resume = [sys.executable, "-m", "phasewatch", "fit", "--run_dir", str(run), "--ckpt_path", "last"]
    rng = random.Random(0)
    for kill, cmd in enumerate([first, resume, resume]):
        target = 60 + 100 * kill + rng.randrange(40)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
            if steps and max(steps) >= target:
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert subprocess.run(resume, env=env, stdout=subprocess.DEVNULL).returncode == 0

    offline = wandb_records.offline_runs(run)
    assert len(offline) == 4  # one offline W&B file per process, all with the run's id
    assert {o.name.rsplit("-", 1)[-1] for o in offline} == {(run / "wandb_id").read_text().strip()}  # killed: unfinished
    folder_rows = [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in read_jsonl(run / "metrics.jsonl")]
    wandb_rows = [(row["trainer/global_step"], {k: v for k, v in row.items()
                                                if not k.startswith("_") and k not in ("trainer/global_step", "epoch")})
                  for row in wandb_records.history(offline[-1])]
    assert max(s for s, _ in folder_rows) == 400
    assert wandb_rows == folder_rows

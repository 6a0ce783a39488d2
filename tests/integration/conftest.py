"""Run folders trained once per test session and shared by the tests that only read them.

A test that writes into one (an analysis, a diff, a report drawn again) works on its own copy:
`copy_run` (a small folder: milliseconds). Each fixture says which tests' runs it replaces;
they differed only in settings their assertions do not read (how often validation ran, W&B).
"""

import shutil

import pytest

from phasewatch.cli.main import main

from .test_fit import TASKS, fit

#: the live watcher's final look only, no checkpoints added (test_headline_fast.py's QUIET), for the
#: runs whose users read the metrics and the checkpoints on the schedule, not the training's events
QUIET = ["--transitions.every_n_validations", "1000", "--transitions.looks", "0", "--transitions.dense", "false"]
#: 300 steps of a small model on (a + b) mod 11 without probes: it memorises, the probes of
#: `phasewatch analyze` run over its checkpoints afterwards. Quiet: a third less CPU, 47
#: checkpoints to analyse instead of 54
GROKKING_RUN = [*TASKS["modular_addition"], "--data.task.p", "11", "--trainer.max_steps", "300",
                "--trainer.val_check_interval", "10", "--model.weight_decay", "0.1", "--model.arch.d_model", "32",
                "--model.arch.d_mlp", "64", "--model.arch.n_heads", "2", "--model.arch.d_head", "16",
                "--trainer.enable_progress_bar", "false", "--probes.names", "[]", *QUIET]


def copy_run(run, to):
    """A copy of a shared run folder to write into (W&B's relative links kept as links)."""
    shutil.copytree(run, to, symlinks=True)
    return to


def _offline_fit(run, *args) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    try:
        assert main(["fit", "--run_dir", str(run), *args]) == 0
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def grokking_run(tmp_path_factory):
    """GROKKING_RUN logged to an offline W&B run (test_analyze.py's analyses, copied;
    test_fit.py's check that training memorises)."""
    run = tmp_path_factory.mktemp("grokking") / "run"
    _offline_fit(run, *GROKKING_RUN)
    return run


@pytest.fixture(scope="session")
def modular_run(tmp_path_factory):
    """A 150-step run of the default model on (a + b) mod 23 with 70% of the pairs for training,
    without probes, logged to an offline W&B run (test_diff.py's diffs and test_trajectory.py's
    trajectories, each on a copy). The watcher is quiet (QUIET): diff finds its transitions in
    the metrics, and both read the checkpoints on the schedule."""
    run = tmp_path_factory.mktemp("modular") / "run"
    _offline_fit(run, "--data.task.p", "23", "--data.task.frac_train", "0.7", "--trainer.max_steps", "150",
                 "--trainer.val_check_interval", "10", "--probes.names", "[]", "--trainer.enable_progress_bar", "false",
                 *QUIET)
    return run


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """`tiny_runs(task)`: the folder of test_fit.py's `fit(run, *TASKS[task])` (12 steps of a
    tiny model, no W&B), trained the first time a test asks for that task (test_fit.py's run
    folder checks and rerun from config.yaml, the digit probe's schedule, the hostile strings
    of test_report_escaping.py on a copy)."""
    made = {}

    def run_of(task: str):
        if task not in made:
            run = tmp_path_factory.mktemp(f"tiny-{task}") / "run"
            assert fit(run, *TASKS[task]) == 0
            made[task] = run
        return made[task]

    return run_of

"""`phasewatch diff` on a real run: two steps of one run, a run against itself, --across a
transition, its tables, and bad input as one line with exit status 2."""

import csv

import pytest

from phasewatch.rundir import RunFolder
from phasewatch.trainers.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("diff") / "run"
    assert main(["fit", "--data.task.p", "23", "--data.task.frac_train", "0.7", "--trainer.max_steps", "150",
                 "--trainer.val_check_interval", "10", "--probes.names", "[]", "--run_dir", str(run), "--no_wandb",
                 "--trainer.enable_progress_bar", "false"]) == 0
    return run


def _table(path):
    with open(path) as f:
        return {row["component"]: row for row in csv.DictReader(f)}


def test_diff_of_two_steps_of_a_run(run, capsys):
    steps = list(RunFolder(run).checkpoint_steps())
    early = steps[1]
    assert main(["diff", f"{run}@{early}", f"{run}@last"]) == 0
    out = capsys.readouterr().out
    assert f"A = run@{early}, B = run@last: held-out loss" in out
    for section in ("weights (relative", "activations (relative", "direct logit attribution", "patching B's output",
                    "inputs whose loss changed most"):
        assert section in out
    table = _table(run / "diff" / f"run@{early}_vs_run@last.csv")
    assert {"embed", "L0H0", "L0.attn", "L0.mlp", "unembed", "resid_final"} <= set(table)
    assert float(table["L0H0"]["weight_abs"]) > 0 and float(table["resid_final"]["act_rel"]) > 0
    with open(run / "diff" / f"run@{early}_vs_run@last_inputs.csv") as f:
        inputs = list(csv.DictReader(f))
    assert len(inputs) == 10 and all(len(r["tokens"].split()) == 3 for r in inputs)
    changes = [abs(float(r["change"])) for r in inputs]
    assert changes == sorted(changes, reverse=True) and changes[0] > 0

    # the last checkpoint against itself: zero, and nothing to recover
    assert main(["diff", str(run), f"{run}@last", "--name", "same"]) == 0
    table = _table(run / "diff" / "same.csv")
    assert all(float(r["weight_abs"]) == 0 for r in table.values() if r["weight_abs"])
    assert all(r["patch_b_into_a"] == "" for r in table.values())
    assert "the two losses are equal" in capsys.readouterr().out


def test_diff_across_the_largest_transition_of_a_series(run, capsys):
    assert main(["diff", str(run), "--across", "train/loss"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("train/loss: transition down") and "diffing the checkpoints of steps" in first
    before, after = (int(s) for s in first.rsplit("steps ", 1)[1].split(" and "))
    onset, end = (int(s) for s in first.split("transition down ")[1].split(" ")[0].split("-")[::2])
    steps = list(RunFolder(run).checkpoint_steps())
    assert before <= onset and after >= end and before in steps and after in steps
    assert (run / "diff" / f"run@{before}_vs_run@{after}.csv").exists()


@pytest.mark.parametrize("args,message", [
    (["{run}@99999"], "has no checkpoint at step 99999. Pick one of its steps: 0,"),
    (["{run}@soon"], "@soon is not a step"),
    (["{run}/nothing"], "is neither a run folder nor a file"),
    ([], "give either two models or one run and --across SERIES"),
    (["--across", "no/such"], "has no series 'no/such'"),
])
def test_bad_input_is_one_line(run, capsys, args, message):
    argv = ["diff", str(run)] + [a.format(run=run) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

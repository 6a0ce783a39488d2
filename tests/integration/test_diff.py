"""`phasewatch diff` on a real run: two steps of one run, a run against itself, --across a
transition, its tables (in the run folder and as W&B Tables of a W&B run beside the training
run, read back from the offline transaction log), and bad input as one line with exit status 2."""

import csv
import re

import pytest

from phasewatch.rundir import RunFolder
from phasewatch.cli.main import main

from . import wandb_records
from .conftest import copy_run
from .test_report import open_page


@pytest.fixture(scope="module")
def run(modular_run, tmp_path_factory):
    """A 150-step grokking run without probes, logged to an offline W&B run: the session's
    (conftest.py), copied, as the diffs write into it."""
    return copy_run(modular_run, tmp_path_factory.mktemp("diff") / "run")


def _table(path):
    with open(path) as f:
        return {row["component"]: row for row in csv.DictReader(f)}


def test_diff_of_two_steps_of_a_run(run, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    steps = list(RunFolder(run).checkpoint_steps())
    early = steps[1]
    (training,) = wandb_records.offline_runs(run)
    assert (run / "wandb" / "latest-run").resolve() == training.resolve()
    assert main(["diff", f"{run}@{early}", f"{run}@last"]) == 0
    out = capsys.readouterr().out
    # the diff's W&B run is kept apart: the training run's wandb/ (what the README says to sync) is untouched
    assert wandb_records.offline_runs(run) == [training]
    assert (run / "wandb" / "latest-run").resolve() == training.resolve()
    assert f"its files go to {run / 'diff' / 'wandb'}" in out
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
    # the same tables in a W&B run of its own beside the training run
    (diffed,) = wandb_records.offline_runs(run / "diff")
    info = wandb_records.run_info(diffed)
    assert info["name"] == f"run-diff-run@{early}_vs_run@last" and info["job_type"] == "diff"
    assert info["config"]["diff"]["a"] == f"{run}@{early}"
    assert info["config"]["diff"]["training_run_id"] == RunFolder(run).wandb_id()
    components = wandb_records.summary_table(diffed, "diff/components")
    assert components["columns"][:3] == ["component", "kind", "weight_abs"]
    assert [row[0] for row in components["data"]] == list(table)
    weight = components["columns"].index("weight_abs")
    assert components["data"][2][weight] == pytest.approx(float(table[components["data"][2][0]]["weight_abs"]),
                                                           rel=1e-5)
    assert len(wandb_records.summary_table(diffed, "diff/inputs")["data"]) == 10

    # the last checkpoint against itself: zero, and nothing to recover
    assert main(["diff", str(run), f"{run}@last", "--name", "same", "--no_wandb"]) == 0
    table = _table(run / "diff" / "same.csv")
    assert all(float(r["weight_abs"]) == 0 for r in table.values() if r["weight_abs"])
    assert all(r["patch_b_into_a"] == "" for r in table.values())
    assert "the two losses are equal" in capsys.readouterr().out


def test_diff_across_the_largest_transition_of_a_series(run, capsys):
    assert main(["diff", str(run), "--across", "train/loss", "--no_wandb"]) == 0
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


def test_the_report_shows_the_diffs(run, tmp_path, chromium):
    assert main(["diff", f"{run}@0", f"{run}@last", "--name", "from_init", "--no_wandb"]) == 0
    assert main(["report", str(run)]) == 0
    console, dom = open_page(chromium, run / "report.html", tmp_path)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    section = dom.split('<div id="diffs">', 1)[1]
    assert "Model diffs (phasewatch diff)" in section and ">from_init<" in section
    table = _table(run / "diff" / "from_init.csv")
    for component in ("L0H0", "L0.mlp", "unembed"):
        shown = float(f"{float(table[component]['weight_rel']):.3g}")
        assert re.search(rf"<td>{re.escape(component)}</td><td[^>]*>{shown:g}</td>", section), component

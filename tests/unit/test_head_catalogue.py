"""The per-head catalogue (report/heads.py) from a hand-written run folder: one row per head
per step, columns named by the keys without their head, composition in and out as the
largest over partners, the tracr probe's best compiled-head match per learned head, and the
report's heads x scores panel."""

import csv

import numpy as np
import pytest

from phasewatch.report.heads import catalogue_array, head_catalogue, head_scores, write_head_catalogue
from phasewatch.rundir import RunFolder


def test_scores_of_one_record():
    record = {"step": 10, "val/loss": 1.0, "heads/induction/L1H2": 0.8, "heads/induction/max": 0.8,
              "ablation/L0H1/acc": 0.5, "ablation/L0.attn/acc": 0.4,
              "comp/k/L0H1-L1H2": 0.3, "comp/k/L0H1-L1H0": 0.6, "comp/k/L0H0-L1H2": 0.2,
              "tracr/attn_match/L0H1": 0.99, "heads/flag/L0H0": True}
    assert head_scores(record) == {
        "L1H2": {"heads/induction": 0.8, "comp/k/in": 0.3},
        "L0H1": {"ablation/acc": 0.5, "comp/k/out": 0.6},
        "L1H0": {"comp/k/in": 0.6},
        "L0H0": {"comp/k/out": 0.2},
    }


def test_catalogue_of_a_run_folder(tmp_path):
    folder = RunFolder(tmp_path)
    folder.append(folder.metrics, {"step": 0, "train/loss": 3.0})
    folder.append(folder.metrics, {"step": 5, "heads/prev_token/L0H0": 0.9, "heads/prev_token/L0H1": 0.1})
    folder.append(folder.metrics, {"step": 5, "ablation/L0H1/acc": 0.25})  # a second line of the same step
    folder.append(folder.metrics, {"step": 9, "heads/prev_token/L0H0": 0.7})
    # compiled heads x learned layer x learned head: L0H1 best matches the second compiled head
    folder.save_array("tracr", "attn_match", 9, np.array([[[0.2, 0.3]], [[0.1, 0.95]]]))
    columns, rows = head_catalogue(folder)
    assert columns == ["step", "head", "ablation/acc", "heads/prev_token", "tracr/attn_match"]
    assert rows == [
        {"step": 5, "head": "L0H0", "heads/prev_token": 0.9},
        {"step": 5, "head": "L0H1", "heads/prev_token": 0.1, "ablation/acc": 0.25},
        {"step": 9, "head": "L0H0", "heads/prev_token": 0.7, "tracr/attn_match": 0.2},
        {"step": 9, "head": "L0H1", "tracr/attn_match": 0.95},
    ]
    write_head_catalogue(folder)
    with open(folder.head_catalogue) as f:
        lines = list(csv.DictReader(f))
    assert [(r["step"], r["head"], r["heads/prev_token"], r["ablation/acc"]) for r in lines] == [
        ("5", "L0H0", "0.9", ""), ("5", "L0H1", "0.1", "0.25"), ("9", "L0H0", "0.7", ""), ("9", "L0H1", "", "")]

    panel = catalogue_array(columns, rows)
    assert panel["steps"] == [5, 9] and panel["rows"] == ["L0H0", "L0H1"] and panel["cols"] == columns[2:]
    assert panel["data"][0] == [[None, 0.9, None], [0.25, 0.1, None]]
    # colours: each score over its own range across the run (prev_token 0.1..0.9; match 0.2..0.95)
    assert panel["shade"][0][1][1] == pytest.approx(0) and panel["shade"][0][0][1] == pytest.approx(1)
    assert panel["shade"][1][0][1] == pytest.approx(0.75) and panel["shade"][1][1][2] == pytest.approx(1)


def test_no_head_scores_no_file(tmp_path):
    folder = RunFolder(tmp_path)
    folder.append(folder.metrics, {"step": 1, "val/loss": 2.0})
    assert write_head_catalogue(folder) is None and not folder.head_catalogue.exists()

"""The watcher's log-spaced early logging (`transitions.logs_per_doubling`, callbacks/transitions.py
`logged_at`) in a real fit, its steps in chunks: the training metrics at exactly those steps."""

from phasewatch.callbacks.transitions import logged_at
from phasewatch.rundir import read_jsonl

from .test_step_chunks import STEPS, fit

EARLY = ("--transitions.logs_per_doubling", "4", "--probes.names", "[]")  # logging every 5 steps besides


def test_the_training_metrics_are_logged_log_spaced_early_with_steps_in_chunks(tmp_path, monkeypatch):
    chunked = fit(tmp_path, True, monkeypatch, *EARLY)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    # every step to 7, every 2nd to 15, every 4th to 31, and every 5th throughout (counted as
    # Lightning counts: a row's step is the update's before it, logged at 4, 9, ... every 5)
    assert [r["step"] + 1 for r in rows if "train/loss" in r] == [s for s in range(1, STEPS + 1) if logged_at(s, 5, 4)] \
        == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 16, 20, 24, 25, 28, 30]
    assert sum(chunked) == STEPS and max(chunked) > 1  # between the logged steps, steps still run in chunks

"""Phase-transition detection on synthetic curves with known change points, and on the
published per-token losses of 5-digit addition."""

import math

import numpy as np
import pytest

from phasewatch.probes.transitions import detect_transitions, lead_lag
from phasewatch.rundir import load_series

LOG_STEPS = np.unique(np.round(np.geomspace(1, 20000, 300)))
LINEAR_STEPS = np.arange(10, 20001, 10)


def sigmoid_in_log_steps(steps, centre, width=0.15):
    return 1 / (1 + np.exp(-(np.log10(steps) - np.log10(centre)) / width))


def checkpoints_between(steps, a, b):
    lo, hi = sorted((a, b))
    return int(((steps > lo) & (steps <= hi)).sum())


@pytest.mark.parametrize("centre", [100, 1000, 8000])
@pytest.mark.parametrize("steps", [LOG_STEPS, LINEAR_STEPS], ids=["log-spaced", "linear"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_noisy_sigmoid_drop_is_found_within_a_few_checkpoints(centre, steps, seed):
    rng = np.random.default_rng(seed)
    values = 2 - 1.5 * sigmoid_in_log_steps(steps, centre) + rng.normal(0, 0.03, len(steps))
    (event,) = detect_transitions(steps, values, "loss")
    assert event["direction"] == "down" and event["magnitude"] == pytest.approx(1.5, rel=0.3)
    # midpoint near the true centre: within a few checkpoints, or 10% in step for dense logging
    assert (checkpoints_between(LOG_STEPS, event["midpoint"], centre) <= 5
            or abs(event["midpoint"] - centre) <= 0.1 * centre)
    assert event["onset"] < centre < event["end"]


def test_two_transitions_in_opposite_directions():
    rng = np.random.default_rng(3)
    values = 1 + sigmoid_in_log_steps(LOG_STEPS, 200) - 0.8 * sigmoid_in_log_steps(LOG_STEPS, 5000)
    events = detect_transitions(LOG_STEPS, values + rng.normal(0, 0.02, len(LOG_STEPS)), "x")
    assert [e["direction"] for e in events] == ["up", "down"]
    assert abs(np.log10(events[0]["midpoint"] / 200)) < 0.1 and abs(np.log10(events[1]["midpoint"] / 5000)) < 0.1


@pytest.mark.parametrize("seed", range(3))
def test_a_peak_on_a_sparse_schedule_gives_its_rise_and_its_fall(seed):
    """A rise at step ~80 and a fall at ~800 on 30 log-spaced checkpoints (the LLC's
    shape over a grokking run): each transition is placed on its own side of the peak,
    not measured from the far side of the other."""
    rng = np.random.default_rng(seed)
    steps = np.unique(np.round(np.geomspace(1, 3000, 30)))
    values = 5 + 400 * sigmoid_in_log_steps(steps, 80, 0.1) - 390 * sigmoid_in_log_steps(steps, 800, 0.2)
    up, down = detect_transitions(steps, values + rng.normal(0, 2, len(steps)), "llc")
    assert (up["direction"], down["direction"]) == ("up", "down")
    assert 40 <= up["midpoint"] <= 160 and 400 <= down["midpoint"] <= 1600
    assert up["end"] < down["onset"]
    assert up["magnitude"] > 250 and down["magnitude"] > 250


@pytest.mark.parametrize("seed", range(5))
def test_no_events_on_flat_noise_or_slow_drift(seed):
    rng = np.random.default_rng(seed)
    for steps in (LOG_STEPS, LINEAR_STEPS):
        assert detect_transitions(steps, 1 + rng.normal(0, 0.05, len(steps)), "flat") == []
        # a slow, steady drift in log-step time
        drift = 3 - 0.3 * np.log10(steps) + rng.normal(0, 0.02, len(steps))
        assert detect_transitions(steps, drift, "drift") == []
    # a small linear drift in steps (5 noise levels over the whole run)
    small = 1 - 0.1 * LINEAR_STEPS / LINEAR_STEPS[-1] + rng.normal(0, 0.02, len(LINEAR_STEPS))
    assert detect_transitions(LINEAR_STEPS, small, "drift") == []


def test_lead_lag_orders_measures_before_the_loss():
    rng = np.random.default_rng(0)
    noise = lambda: rng.normal(0, 0.02, len(LOG_STEPS))  # noqa: E731
    events = (detect_transitions(LOG_STEPS, 3 - 2.5 * sigmoid_in_log_steps(LOG_STEPS, 5000) + noise(), "val/loss")
              + detect_transitions(LOG_STEPS, 3 - 2.5 * sigmoid_in_log_steps(LOG_STEPS, 1000) + noise(), "restricted")
              + detect_transitions(LOG_STEPS, 1 + 5 * sigmoid_in_log_steps(LOG_STEPS, 2000) + noise(), "excluded"))
    rows = lead_lag(events, "val/loss")
    assert [r["metric"] for r in rows] == ["restricted", "excluded"]
    assert rows[0]["lead"] > rows[1]["lead"] > 1000


def test_published_digit_addition_losses_drop_once_per_token_at_distinct_steps(reference_dir):
    data = load_series(reference_dir / "5_digit_addition_infinite_per_token.csv")
    assert sorted(data) == [f"answer_token_{i}" for i in range(6)]
    main_drops = {}
    for name, (steps, values) in data.items():
        events = [e for e in detect_transitions(steps, values, name) if e["direction"] == "down"]
        assert events, name
        main_drops[name] = max(events, key=lambda e: e["magnitude"])
        # it is the drop through half of the starting loss
        start = np.median(values[:3])
        half_step = steps[int(np.argmax(np.asarray(values) < start / 2))]
        assert main_drops[name]["onset"] <= half_step <= main_drops[name]["end"], (name, half_step)
    midpoints = sorted(e["midpoint"] for e in main_drops.values())
    assert len(set(midpoints)) == 6
    # the carry is learned first and token 1 second, as in the paper
    assert main_drops["answer_token_0"]["midpoint"] < main_drops["answer_token_1"]["midpoint"] < min(
        main_drops[f"answer_token_{i}"]["midpoint"] for i in (2, 3, 4, 5))


def test_live_watcher_waits_for_a_sparse_series_to_go_on_before_reporting(tmp_path):
    """The LLC of a real induction run on its 24-step schedule (phasewatch fit with the
    llc probe, configs/induction_2l.yaml), looked at every 200 steps as training would: the
    watcher reports its rise once, whole (midpoint ~1,470), not the first third of it."""
    import json

    import lightning.pytorch as pl

    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 46, 65, 92, 131, 185, 262, 372, 526, 745, 1056, 1495, 2118, 3000]
    llc = [5.2, 5.3, 5.5, 5.6, 5.9, 6.1, 6.4, 6.8, 6.9, 7.4, 7.3, 8.2, 9.0, 7.9, 9.1, 9.6, 14.2, 23.5, 42.6, 62.7,
           142.6, 222.3, 239.1]
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    watcher = TransitionWatcher()
    reported = []
    for now in range(200, 3001, 200):
        with open(tmp_path / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": s, "llc/estimate": v}) + "\n" for s, v in zip(steps, llc) if s <= now)
        reported += watcher.look(trainer, now, final=now == 3000)
    assert [(e["metric"], e["direction"]) for e in reported] == [("llc/estimate", "up")]
    assert 1000 <= reported[0]["midpoint"] <= 2000 and reported[0]["magnitude"] > 200


@pytest.mark.parametrize("steps", [list(range(51)), list(range(0, 510, 10)), list(range(0, 3001, 60))])
def test_a_constant_series_has_no_transition_whatever_its_steps(steps):
    """Binning equal values leaves last-digit differences (~1e-17 here); they are no change."""
    for value in (0.12453105357511532, 1e-12, -3.7, 0.0):
        assert detect_transitions(steps, [value] * len(steps), "c") == []


def test_a_small_real_change_on_a_large_baseline_is_still_found():
    """The flat-series guard is relative: a rise of 1e-6 on a baseline of 1 is a change."""
    steps = list(range(1, 3001, 10))
    values = [1.0 + 1e-6 / (1 + math.exp(-(math.log(s) - math.log(300)) * 6)) for s in steps]
    (event,) = detect_transitions(steps, values, "small")
    assert event["direction"] == "up" and 150 <= event["midpoint"] <= 600
    assert event["magnitude"] == pytest.approx(1e-6, rel=0.2)

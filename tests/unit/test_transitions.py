"""Phase-transition detection on synthetic curves with known change points, and on the
published per-token losses of 5-digit addition."""

import math

import numpy as np
import pytest

from phasewatch.phases.detector import detect_transitions, lead_lag
from phasewatch.phases.scale import LOG
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


def test_the_report_s_lead_lag_row_is_against_the_loss_s_fall_by_decades(capsys):
    """A test loss rises from 1 to 9 while the model memorises (the largest change in its units),
    falls to 2, then drops to 1e-4 (4.3 decades: its grokking drop); the restricted loss drops with
    memorisation, next to the rise, then falls by decades before the grokking drop. Found on the log
    scale, the report's row for the restricted loss is its fall against the grokking drop, and
    `phasewatch phases --series` marks that drop's rows as the report's."""
    from phasewatch.cli.main import _print_lead_lag

    rng = np.random.default_rng(1)
    noise = lambda: rng.normal(0, 0.02, len(LOG_STEPS))  # noqa: E731 - in decades
    change = lambda centre: sigmoid_in_log_steps(LOG_STEPS, centre, width=0.08)  # noqa: E731
    test = 0.95 * change(100) - 0.65 * change(400) - 4.3 * change(3000) + noise()
    restricted = 0.6 - 0.5 * change(110) - 3 * change(1200) + noise()
    data = {"val/loss": (LOG_STEPS, 10**test), "restricted": (LOG_STEPS, 10**restricted)}
    events = [e for name, (steps, values) in data.items() for e in detect_transitions(steps, values, name, scale=LOG)]
    drops = [e for e in events if e["metric"] == "val/loss"]
    assert [e["direction"] for e in drops] == ["up", "down", "down"]  # the three changes, in step order
    assert max(drops, key=lambda e: e["magnitude"]) is drops[0]  # in its units the rise is the largest
    rows = lead_lag(events, "val/loss", data["val/loss"])
    assert [(r["metric"], r["reference_midpoint"], r["direction"]) for r in rows] == [
        ("restricted", drops[2]["midpoint"], "down")]
    assert 2000 <= drops[2]["midpoint"] <= 4000 and 1000 <= rows[0]["midpoint"] <= 2000
    _print_lead_lag(events, "val/loss", data)
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lead/lag against")]
    marked = [line for line in headers if "the report's rows" in line]
    assert len(headers) >= 2 and marked == [h for h in headers if f"(midpoint {drops[2]['midpoint']})" in h]


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
    stages = [e["stage"] for e in reported]
    reported = [e for e in reported if e["stage"] == "confirmed"]
    assert [(e["metric"], e["direction"]) for e in reported] == [("llc/estimate", "up")]
    assert stages[0] == "onset" and stages.count("withdrawn") <= 1  # under way long before it is confirmed
    # most of the rise from ~10 to 239 (its slower start, steps ~300-900, is fitted as a change of its own)
    assert 1000 <= reported[0]["midpoint"] <= 2000 and reported[0]["magnitude"] > 0.75 * (239.1 - 9.6)


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


DENSE = np.arange(10, 10001, 10)
LOG_60 = np.unique(np.round(np.geomspace(1, 10000, 60)))


def transitions(steps, values, name="x"):
    return [e for e in detect_transitions(steps, values, name) if e["kind"] == "transition"]


@pytest.mark.parametrize("steps", [DENSE, LOG_60], ids=["dense", "log-spaced"])
def test_steady_trends_are_labelled_trends_not_transitions(steps):
    """A series linear in steps (e.g. a norm shrinking under weight decay) steepens all the way in
    log-step time; one linear in log-step never changes speed. Neither is a transition."""
    for seed in range(10):
        rng = np.random.default_rng(seed)
        for curve in (1 - 0.8 * steps / steps[-1], 1 - 0.2 * np.log10(steps)):
            values = curve + rng.normal(0, 0.02, len(steps))
            assert detect_transitions(steps, values, "trend") == []
            labelled = detect_transitions(steps, values, "trend", trends=True)
            assert labelled and {e["kind"] for e in labelled} == {"trend"}


def test_two_drops_on_a_sparse_log_schedule_are_two_transitions():
    """Drops of 0.5 at steps 150 and 3,000 on 60 log-spaced checkpoints, noise 0.05: each found on
    its own side in at least 9 of 10 series (the old detector joined them in 9 of 10). Where the
    second is missed, the fit has it still under way at the last checkpoint: a trend, not a
    wrong transition."""
    separated = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        values = 1 - 0.5 * sigmoid_in_log_steps(LOG_60, 150) - 0.5 * sigmoid_in_log_steps(LOG_60, 3000)
        events = transitions(LOG_60, values + rng.normal(0, 0.05, len(LOG_60)))
        assert 1 <= len(events) <= 2 and 70 <= events[0]["midpoint"] <= 320, (seed, events)
        assert all(e["magnitude"] == pytest.approx(0.5, rel=0.3) for e in events), (seed, events)
        if len(events) == 2:
            assert 1400 <= events[1]["midpoint"] <= 6400 and events[0]["end"] < events[1]["onset"], (seed, events)
            separated += 1
    assert separated >= 9


def test_a_steep_drop_does_not_take_in_the_slow_decline_after_it():
    """A drop of 0.6 at step 383 followed by a decline of 0.3 spread over steps 500-10,000: one
    transition, ending before the decline, of about the drop's size (the old detector reported
    343-409-4,519 with magnitude 0.895)."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        decline = np.clip((np.log10(DENSE) - np.log10(500)) / (4 - np.log10(500)), 0, 1)
        values = 1 - 0.6 * sigmoid_in_log_steps(DENSE, 383, 0.05) - 0.3 * decline + rng.normal(0, 0.02, len(DENSE))
        (event,) = transitions(DENSE, values)
        assert 330 <= event["midpoint"] <= 450 and event["end"] <= 600, event
        assert 0.45 <= event["magnitude"] <= 0.7, event


def test_a_completed_drop_is_reported_by_half_again_its_end_whatever_came_before():
    """What the live watcher sees: the series so far. A steep drop (centre 400, end ~540) after a
    gently sloping start, cut at 1.5 x its end step: found, with its own size, not dated from the
    slope before it."""
    end = 400 * 10 ** (0.06 * math.log(9))
    for seed in range(10):
        rng = np.random.default_rng(seed)
        values = 3 - 0.3 * np.log10(DENSE) - 1.5 * sigmoid_in_log_steps(DENSE, 400, 0.06) + rng.normal(0, 0.02, len(DENSE))
        keep = DENSE <= 1.5 * end
        (event,) = transitions(DENSE[keep], values[keep])
        assert 250 <= event["onset"] < 400 < event["end"] <= 700 and event["magnitude"] == pytest.approx(1.5, rel=0.2)


def test_the_published_token_1_drop_is_seen_on_the_series_so_far(reference_dir):
    """The authors' 5-digit answer token 1 falls steeply near step 390 after a gently sloping start:
    cut at steps 700 and 1,000 (the old detector saw it only from ~1,500), the drop is reported."""
    steps, values = (np.asarray(a) for a in load_series(reference_dir / "5_digit_addition_infinite_per_token.csv")["answer_token_1"])
    for cut in (700, 1000):
        keep = steps <= cut
        drops = [e for e in transitions(steps[keep], values[keep]) if e["direction"] == "down"]
        assert any(e["onset"] <= 390 <= e["end"] for e in drops), (cut, drops)


def test_events_carry_kind_steepest_snr_and_confidence():
    """A lopsided drop (fast, then a slow tail): the steepest point comes before the midpoint; a
    clear change has a high snr and confidence near 1, one near the noise a lower confidence."""
    rng = np.random.default_rng(0)
    lopsided = 2 - 0.8 * sigmoid_in_log_steps(DENSE, 300, 0.03) - 0.7 * sigmoid_in_log_steps(DENSE, 600, 0.2)
    (event,) = transitions(DENSE, lopsided + rng.normal(0, 0.01, len(DENSE)))
    assert event["kind"] == "transition" and event["onset"] < event["steepest"] < event["midpoint"] < event["end"]
    assert 250 <= event["steepest"] <= 360 and event["snr"] > 50 and event["confidence"] > 0.99
    weak = [e for seed in range(20) for e in transitions(
        LOG_60, 1 - 0.25 * sigmoid_in_log_steps(LOG_60, 500) + np.random.default_rng(seed).normal(0, 0.1, len(LOG_60)))]
    assert weak and all(0 <= e["confidence"] <= 1 for e in weak) and min(e["confidence"] for e in weak) < 0.99


def test_live_watcher_looks_at_long_series_again_only_once_they_grow_and_reports_no_later_than_that(tmp_path):
    """A series of 100+ points is detected again once it has 10% more points, or whenever it has
    new points while a change in it is under way: a drop ending near step 2,700 on a series
    logged every 10 steps is reported once, at the same look as when every look detects it."""
    import json

    import lightning.pytorch as pl

    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(10, 6001, 10)
    rng = np.random.default_rng(0)
    values = 2 - 1.5 * sigmoid_in_log_steps(steps, 2000, 0.06) + rng.normal(0, 0.02, len(steps))
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    reported = {}
    for regrow in (0.0, 0.1):
        watcher = TransitionWatcher(regrow=regrow)
        found = []
        for now in range(1000, 6001, 50):
            with open(tmp_path / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps({"step": int(s), "val/loss": v}) + "\n" for s, v in zip(steps, values) if s <= now)
            found += watcher.look(trainer, now, final=now == 6000)
        assert [e["stage"] for e in found] == ["onset", "confirmed"]
        found = found[1:]
        assert [(e["metric"], e["direction"]) for e in found] == [("val/loss", "down")]
        reported[regrow] = found[0]["detected_at"]
    assert reported[0.1] == reported[0.0]


def _watch(watcher, steps, values, looks, end=True):
    """Replay a growing series through the watcher, a look at each of `looks` (the last one
    final, as at the end of training, when `end`)."""
    events = []
    for now in looks:
        keep = steps <= now
        events += watcher.update({"val/loss": (steps[keep], values[keep])}, int(now), final=end and now == looks[-1])
    return events


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_onset_comes_before_the_midpoint_and_the_confirmation_by_1_2_x_the_end(seed):
    """A drop from ~560 to ~1,800 (0.5 decades, midpoint 1,000) logged every 25 steps, looked at
    every 25: the watcher says it is under way before its midpoint and confirms it by 1.2 x its
    end, once each, with nothing withdrawn."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(25, 4001, 25)
    width = 0.5 / (2 * math.log(9))
    values = 2 - sigmoid_in_log_steps(steps, 1000, width) + np.random.default_rng(seed).normal(0, 0.02, len(steps))
    events = _watch(TransitionWatcher(), steps, values, steps)
    # the drop's start (its exponential tail in log-step) can come out of the noise as a small
    # change of its own before the rest follows: it is confirmed as that, and the drop is a new one
    early = [e for e in events if e["stage"] == "confirmed" and e["magnitude"] < 0.1]
    assert all(e["end"] < 600 for e in early)
    events = [e for e in events if e not in early]
    assert [e["stage"] for e in events] == ["onset", "confirmed"], events
    onset, confirmed = events
    assert onset["detected_at"] < confirmed["midpoint"] and 500 <= confirmed["midpoint"] <= 1200
    assert confirmed["end"] < confirmed["detected_at"] <= 1.2 * confirmed["end"]
    assert onset["direction"] == confirmed["direction"] == "down"


@pytest.mark.parametrize("seed", range(4))
def test_no_onset_on_flat_noise_or_a_steady_trend(seed):
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(25, 3001, 25)
    noise = np.random.default_rng(seed).normal(0, 0.05, len(steps))
    for values in (1 + noise, 2 - 0.3 * np.log10(steps) + noise):
        assert _watch(TransitionWatcher(), steps, values, steps) == []


def test_a_change_still_under_way_when_training_stops_is_withdrawn_and_dense_until_then():
    """The run stops in the middle of a drop: its onset is reported, asks for dense probes and
    checkpoints on the grid while pending (never beyond `dense_for` x its step), and is withdrawn
    at the end ("training ended"), not confirmed."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(25, 1101, 25)
    values = 2 - sigmoid_in_log_steps(steps, 1000, 0.1) + np.random.default_rng(0).normal(0, 0.01, len(steps))
    watcher = TransitionWatcher(dense_for=1.5)
    watcher.plan(1100)
    grid = sorted(watcher._dense_steps)
    assert not any(watcher.dense_now(s) for s in grid)  # nothing pending yet
    events = _watch(watcher, steps, values, steps[:-1], end=False)
    assert [e["stage"] for e in events][-1:] == ["onset"] and len(watcher.pending) == 1
    assert not [e for e in events if e["stage"] == "confirmed" and e["end"] > 500]  # (a small early start may be)
    at = events[-1]["detected_at"]
    dense = [s for s in range(1, 1101) if watcher.dense_now(s)]
    assert dense and set(dense) <= set(grid) and max(dense) <= 1.5 * at
    assert all(watcher.dense_metrics(s) == {"val/loss"} for s in dense)  # what is in transition there
    assert len([s for s in grid if at < s <= 1.5 * at]) >= 8  # ~8 grid steps per factor 1.4
    final = watcher.update({"val/loss": (steps, values)}, 1100, final=True)
    assert [(e["stage"], e["reason"]) for e in final] == [("withdrawn", "training ended")]
    assert not watcher.pending and not any(watcher.dense_now(s) for s in grid)


def test_adaptive_resolution_runs_the_probes_whose_series_are_in_transition():
    """A transition in a probe's series makes that probe dense, and the cheap probes (those
    that run at every validation); one in a series that no probe logs (the loss, the
    accuracy) makes every probe dense."""
    from phasewatch.callbacks.transitions import dense_probes

    keys = {"tracr": {"tracr/agreement", "tracr/cka/resid_pre0"}, "ablation": {"ablation/L0.attn/acc"},
            "composition": {"comp/k/max"}, "heads": set()}  # heads: has not logged yet
    assert dense_probes(set(), keys) == set()
    assert dense_probes({"tracr/cka/resid_pre0"}, keys) == {"tracr"}
    assert dense_probes({"tracr/agreement", "comp/k/max"}, keys) == {"tracr", "composition"}
    assert dense_probes({"val/loss"}, keys) == set(keys)
    assert dense_probes({"comp/k/max", "train/acc"}, keys) == set(keys)
    cheap = {"composition", "heads"}
    assert dense_probes(set(), keys, cheap) == set()
    assert dense_probes({"tracr/agreement"}, keys, cheap) == {"tracr", "composition", "heads"}
    assert dense_probes({"ablation/L0.attn/acc"}, keys, cheap) == {"ablation", "composition", "heads"}


def test_the_probe_runner_keeps_which_probe_logs_which_series_across_a_resume():
    """What adaptive resolution needs to know (`ProbeRunner._keys`) is in the runner's checkpoint
    state; a checkpoint without it (an older phasewatch's) knows nothing yet."""
    from phasewatch.callbacks.probes import ProbeRunner

    runner = ProbeRunner(names=[])
    runner._keys = {"tracr": {"tracr/agreement", "tracr/cka/resid_pre0"}, "ablation": set()}
    resumed = ProbeRunner(names=[])
    resumed.load_state_dict(runner.state_dict())
    assert resumed._keys == runner._keys
    older = ProbeRunner(names=[])
    older.load_state_dict({"history": {}})
    assert older._keys == {}


def _departures(steps, values, start=5):
    """The departure test at every prefix of a series (a look after each logged point)."""
    from phasewatch.phases.detector import departure

    return [(int(steps[n - 1]), d) for n in range(start, len(steps) + 1)
            if (d := departure(steps[:n], values[:n], "x")) is not None]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("direction", ["down", "up"])
def test_a_departure_from_the_trend_is_seen_before_the_midpoint_of_a_drop_or_rise(seed, direction):
    """A step of 1 centred at 1,000 whose 10-90% part lasts 0.3 decades (700-1,400), noise 0.02,
    logged every 25 steps on a steady trend: the newest points leave the trend's extrapolation
    by 5 standard errors while the step is still under its midpoint, in its direction, with an
    onset inside its first half; nothing before it begins."""
    steps = np.arange(25, 3001, 25)
    sign = 1 if direction == "up" else -1
    values = (2 - 0.2 * np.log10(steps) + sign * sigmoid_in_log_steps(steps, 1000, 0.3 / (2 * math.log(9)))
              + np.random.default_rng(seed).normal(0, 0.02, len(steps)))
    found = _departures(steps, values)
    assert found, "no departure"
    at, first = found[0]
    assert 600 <= at < 1000 and first["direction"] == direction and 500 <= first["onset"] <= at
    assert first["snr"] >= 5 and 0.5 <= first["confidence"] <= 1


@pytest.mark.parametrize("seed", range(4))
def test_no_departure_on_flat_noise_a_steady_trend_or_the_levelling_after_a_drop(seed):
    """Flat noise and a steady trend in log-step never leave their trend; after a drop the series
    levels off, which departs from the drop's steep line upwards but is not a change of its own:
    no departure goes up."""
    steps = np.arange(25, 3001, 25)
    noise = np.random.default_rng(seed).normal(0, 0.05, len(steps))
    assert _departures(steps, 1 + noise) == []
    assert _departures(steps, 2 - 0.3 * np.log10(steps) + noise) == []
    drop = 2 - sigmoid_in_log_steps(steps, 600, 0.05) + 0.2 * noise
    found = _departures(steps, drop)
    assert found and all(d["direction"] == "down" for _, d in found)
    assert all(d["onset"] <= 900 for _, d in found)  # only while it drops


@pytest.mark.parametrize("seed", range(3))
def test_a_second_rise_soon_after_a_confirmed_one_gets_its_onset_at_the_first_look_that_sees_it(seed):
    """An accuracy-like series logged every 10 steps (so the detector looks at it again only once
    it has grown by 10%), looked at every 50: a small rise near step 500, confirmed, then one
    five times larger centred at 1,450 (10-90% over ~1,250-1,680). The second rise begins within
    `SAME` of the first one's end, yet it is a new change: its departure is said by step 1,250,
    at a look where the detector does not run (before, at 1,300-1,450), and it is confirmed once,
    with nothing withdrawn."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(10, 3001, 10)
    values = (0.1 + 0.1 * sigmoid_in_log_steps(steps, 500, 0.03) + 0.5 * sigmoid_in_log_steps(steps, 1450, 0.03)
              + np.random.default_rng(seed).normal(0, 0.005, len(steps)))
    events = _watch(TransitionWatcher(), steps, values, np.arange(50, 3001, 50))
    first = [e for e in events if e["stage"] == "confirmed" and e["end"] < 900]
    assert len(first) == 1 and first[0]["detected_at"] < 1000
    second = [e for e in events if e["onset"] > 1000]
    assert [e["stage"] for e in second] == ["onset", "confirmed"], second
    onset, confirmed = second
    assert onset["direction"] == confirmed["direction"] == "up"
    assert onset["detected_at"] <= 1250 and 1300 <= confirmed["midpoint"] <= 1600
    assert not [e for e in events if e["stage"] == "withdrawn"]


@pytest.mark.parametrize("seed", range(3))
def test_a_second_rise_after_a_confirmed_one_is_confirmed_as_its_own_also_when_not_much_larger(seed):
    """The second rise of the test above, only 2.5 times the first (not `GROWN` times larger):
    it comes after the first one (neither midpoint within the other's span), so it is a change
    of its own, confirmed with its onset. (Before, spans widened by `SAME` made it the first
    one again: its onset stayed pending until training ended and it was never confirmed; so
    on induction_2l the induction bump in val/acc, right after a slow earlier rise.) Every
    onset is closed."""
    from phasewatch.callbacks.transitions import TransitionWatcher, _continues

    steps = np.arange(10, 3001, 10)
    values = (0.1 + 0.1 * sigmoid_in_log_steps(steps, 500, 0.03) + 0.25 * sigmoid_in_log_steps(steps, 1450, 0.03)
              + np.random.default_rng(seed).normal(0, 0.005, len(steps)))
    watcher = TransitionWatcher()
    events = _watch(watcher, steps, values, np.arange(50, 3001, 50))
    assert not watcher.pending and not [e for e in events if e["stage"] == "withdrawn"]
    confirmed = [e for e in events if e["stage"] == "confirmed"]
    assert len(confirmed) == 2 and confirmed[0]["end"] < 900 and 1300 <= confirmed[1]["midpoint"] <= 1600, confirmed
    onsets = [e for e in events if e["stage"] == "onset"]
    assert any(e["onset"] > 1000 and e["detected_at"] < 1450 for e in onsets)  # the second rise, before its midpoint
    for onset in onsets:
        assert any(e["detected_at"] >= onset["detected_at"] and _continues(onset, e) for e in confirmed), onset


def test_a_confirmed_change_is_found_again_while_one_midpoint_lies_within_the_other_span():
    """A change found again is the confirmed one while one's midpoint lies within the other's
    span, widened to the logged steps around it (a later fit moves the ends; a jump between two
    logged steps can be fitted anywhere between them), and it is not `GROWN` times larger; one
    that follows the confirmed one is a new change, however close (`SAME` widens spans only to
    tie onsets and departures to a change)."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(10, 1001, 10)
    first = {"metric": "x", "direction": "down", "onset": 655, "midpoint": 694, "end": 736, "magnitude": 5.0,
             "stage": "confirmed"}
    watcher = TransitionWatcher()
    watcher.reported.append(first)
    again = {"metric": "x", "direction": "down", "onset": 700, "midpoint": 740, "end": 790, "magnitude": 5.5}
    assert watcher._confirmed(again, steps)
    after = {"metric": "x", "direction": "down", "onset": 814, "midpoint": 856, "end": 900, "magnitude": 4.4}
    assert not watcher._confirmed(after, steps)
    assert not watcher._confirmed({**again, "magnitude": 25.0}, steps)  # GROWN: the start of a bigger change
    # a count that jumps from 0 to 1 between its values at steps 350 and 400, fitted at
    # 376-425 when confirmed and at 331-370 later: the same jump (the spans do not even overlap)
    sparse = np.arange(50, 1001, 50)
    watcher.reported.append({"metric": "c", "direction": "up", "onset": 376, "midpoint": 400, "end": 425,
                             "magnitude": 1.0, "stage": "confirmed"})
    jump = {"metric": "c", "direction": "up", "onset": 331, "midpoint": 350, "end": 370, "magnitude": 1.0}
    assert watcher._confirmed(jump, sparse)
    assert not watcher._confirmed({**jump, "onset": 460, "midpoint": 480, "end": 495}, sparse)  # the next jump


def _settled_drop(seed=0):
    """A drop centred at 1,000 logged every 10 steps to 3,000, and a watcher that has looked at
    every 50 and confirmed it, with nothing pending."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(10, 3001, 10)
    values = 2 - sigmoid_in_log_steps(steps, 1000, 0.03) + np.random.default_rng(seed).normal(0, 0.01, len(steps))
    watcher = TransitionWatcher()
    events = _watch(watcher, steps, values, np.arange(50, 2501, 50), end=False)
    assert [e["stage"] for e in events if e["onset"] > 600] == ["onset", "confirmed"] and not watcher.pending
    return watcher, steps, values


def test_an_onset_not_found_again_is_withdrawn_at_the_first_look_past_withdraw_x_its_last_sighting():
    """A pending onset not found again is withdrawn at the first look at or past `WITHDRAW` x the
    step it was last seen: its series is looked at whenever it has new points while the onset is
    pending, also a long one that has grown by less than `regrow` (before, it waited for the
    detector's next look at the grown series, 450 steps later here)."""
    from phasewatch.callbacks.transitions import WITHDRAW

    watcher, steps, values = _settled_drop()
    stray = {"metric": "val/loss", "direction": "up", "onset": 600, "snr": 6.0, "confidence": 0.9,
             "stage": "onset", "detected_at": 900, "seen_at": 1260}
    watcher.pending.append(dict(stray))
    looked = watcher._looked["val/loss"]
    assert len(steps[steps <= 2550]) < 1.1 * looked  # too few new points for `regrow` alone
    keep = steps <= 2510
    assert watcher.update({"val/loss": (steps[keep], values[keep])}, 2510) == [] and len(watcher.pending) == 1
    assert watcher._looked["val/loss"] == int(keep.sum())  # the detector looked
    keep = steps <= 2550
    new = watcher.update({"val/loss": (steps[keep], values[keep])}, 2550)
    assert 2550 >= WITHDRAW * stray["seen_at"] > 2510
    assert [(e["stage"], e["reason"], e["onset"]) for e in new] == [("withdrawn", "not found again", 600)]
    assert not watcher.pending


def test_a_departure_is_the_confirmed_change_up_to_the_first_logged_step_after_its_end_also_in_the_same_look():
    """A jump between two logged steps (here 490 and 500) can be fitted to end before the first
    step that shows it (495): a departure starting at 500 is that change, one starting at the
    step after it is a new one. The confirmation may come in the same look as the departure
    (`also`: the look's new events), before it is among the reported ones."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(10, 601, 10)
    confirmed = {"metric": "x", "direction": "down", "onset": 464, "midpoint": 479, "end": 495,
                 "magnitude": 1.0, "stage": "confirmed"}
    watcher = TransitionWatcher()
    at = {"metric": "x", "direction": "down", "onset": 500}
    assert watcher._confirmed(at, steps, [confirmed])
    assert not watcher._confirmed(at, steps)  # not yet reported, not in this look
    assert not watcher._confirmed({**at, "onset": 510}, steps, [confirmed])
    assert not watcher._confirmed({**at, "direction": "up"}, steps, [confirmed])
    watcher.reported.append(confirmed)
    assert watcher._confirmed(at, steps) and not watcher._confirmed({**at, "onset": 510}, steps)


def test_a_transition_is_not_confirmed_in_a_look_where_the_series_departs_past_its_end_the_same_way():
    """A drop fitted to end at 126 while the series goes on falling (the quickstart's restricted
    loss: confirmed over 119-126 at step 150 while it fell until 159, and the rest of the drop
    was an onset that no confirmation could take up): a departure in the drop's direction that
    begins after the first logged step past its end holds the confirmation back, and the pending
    onset takes the departure in. Without it, with one the other way, or with one that begins
    at that first step (part of the drop), the drop is confirmed."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(10, 151, 10)
    drop = {"metric": "x", "direction": "down", "onset": 110, "midpoint": 120, "end": 126, "magnitude": 1.0,
            "kind": "transition", "steepest": 120, "snr": 50.0, "confidence": 1.0}

    def judge(left):
        watcher = TransitionWatcher()
        watcher.pending.append({"metric": "x", "direction": "down", "onset": 112, "snr": 20.0, "confidence": 1.0,
                                "stage": "onset", "detected_at": 125})
        return watcher._judge("x", steps, [dict(drop)], 150, False, left), watcher

    departure = {"metric": "x", "direction": "down", "onset": 140, "snr": 8.0, "confidence": 0.9}
    new, watcher = judge(departure)
    assert new == [] and [p["onset"] for p in watcher.pending] == [112]
    assert watcher.pending[0]["seen_at"] == 150
    for left in (None, {**departure, "direction": "up"}, {**departure, "onset": 130}):
        new, watcher = judge(left)
        assert [e["stage"] for e in new if e["direction"] == "down"] == ["confirmed"], left
        assert not [p for p in watcher.pending if p["direction"] == "down"]


def test_a_series_with_a_change_under_way_is_looked_at_whenever_it_has_new_points():
    """`regrow` spares the detector a long series that has grown little since its last look; a
    series with an onset pending (or a change waiting to be found again) is looked at whenever
    it has new points, so that its confirmation does not wait for 10% more of them: for as long
    as adaptive resolution lasts (`dense_for` x the step the onset was said at), after which a
    slow change waits for `regrow` again."""
    watcher, steps, values = _settled_drop()
    looked = watcher._looked["val/loss"]
    assert len(steps[steps <= 2600]) < 1.1 * looked

    def looks_at(now: int) -> bool:
        keep = steps <= now
        watcher.update({"val/loss": (steps[keep], values[keep])}, now)
        return watcher._looked["val/loss"] == int(keep.sum())

    assert not looks_at(2550)  # nothing under way
    assert watcher.dense_for == 3
    watcher.pending.append({"metric": "val/loss", "direction": "up", "onset": 700, "snr": 6.0, "confidence": 0.9,
                            "stage": "onset", "detected_at": 850})  # 3 x 850 < 2,600
    assert not looks_at(2560)
    watcher.pending.append({"metric": "val/loss", "direction": "up", "onset": 2400, "snr": 6.0, "confidence": 0.9,
                            "stage": "onset", "detected_at": 2500})
    assert looks_at(2570) and looks_at(2580)


def test_a_confirmed_change_found_again_keeps_alive_only_the_onsets_that_began_before_it_ended():
    """A later fit of a confirmed drop is that drop, not the change of an onset said after the
    drop had ended (a departure that came to nothing): such an onset is withdrawn as not found
    again at `WITHDRAW` x the step it was last seen, not left pending until training ends. One
    that began within the drop is still the drop's."""
    from phasewatch.callbacks.transitions import WITHDRAW

    watcher, steps, values = _settled_drop()
    drop = next(e for e in watcher.reported if e["stage"] == "confirmed" and e["onset"] > 600)
    first_after = steps[steps > drop["end"]][0]
    later = {"metric": "val/loss", "direction": "down", "onset": int(first_after) + 150, "snr": 6.0,
             "confidence": 0.9, "stage": "onset", "detected_at": int(first_after) + 150}
    within = {**later, "onset": drop["midpoint"], "detected_at": drop["midpoint"]}
    assert not watcher._confirmed(later, steps)  # a departure there: a change of its own
    watcher.pending += [dict(later), dict(within)]
    events = _watch(watcher, steps, values, np.arange(2550, 3001, 50), end=False)
    assert [(e["stage"], e["reason"], e["onset"]) for e in events] == [("withdrawn", "not found again", later["onset"])]
    assert WITHDRAW * later["detected_at"] <= events[0]["detected_at"]
    assert [p["onset"] for p in watcher.pending] == [within["onset"]]


def test_a_departure_after_a_confirmed_transition_ended_is_not_the_change_of_an_onset_from_before_its_end():
    """induction_2l's `val/acc`: a slow rise confirmed over 465-1,024, then an onset said at step
    1,200 from a later fit of it (onset 521), then at 1,300 the induction bump leaves the trend.
    The bump is a change of its own, said at once (before: taken for the pending onset's change,
    and said only at 1,700, past its midpoint at 1,441). With no confirmed end between them the
    departure is the pending onset's change; one up to the first logged step past the confirmed
    end is the confirmed transition's."""
    from phasewatch.callbacks.transitions import TransitionWatcher

    steps = np.arange(50, 1301, 50)
    confirmed = {"metric": "val/acc", "direction": "up", "onset": 465, "midpoint": 742, "end": 1024,
                 "magnitude": 0.02, "stage": "confirmed", "detected_at": 1150}
    stale = {"metric": "val/acc", "direction": "up", "onset": 521, "snr": 26.9, "confidence": 1.0,
             "stage": "onset", "detected_at": 1200, "seen_at": 1250}
    bump = {"metric": "val/acc", "direction": "up", "onset": 1300, "snr": 8.0, "confidence": 0.95}

    def judge(left, reported=(confirmed,)):
        watcher = TransitionWatcher()
        watcher.reported += [dict(r) for r in reported]
        watcher.pending.append(dict(stale))
        return watcher._judge("val/acc", steps, None, 1300, False, left), watcher

    new, watcher = judge(bump)
    assert [(e["stage"], e["onset"]) for e in new] == [("onset", 1300)]
    assert sorted(p["onset"] for p in watcher.pending) == [521, 1300]
    new, watcher = judge(bump, reported=())
    assert new == [] and [(p["onset"], p["seen_at"]) for p in watcher.pending] == [(521, 1300)]
    new, watcher = judge({**bump, "onset": 1050})
    assert new == [] and [p["onset"] for p in watcher.pending] == [521]



def test_the_departure_bar_is_the_users_choice():
    """`departure_z` sets the departure test's bar: flat noise (0.02) whose newest two points
    jumped by 0.1 leaves its trend by z ~ 10.5 standard errors, a departure for a bar just under
    z and not for one just over it; a watcher with the default bar says an onset from it at its
    first look (the detector, which needs a second look for a change this small, says nothing
    yet), one with the higher bar says nothing. A bar that is not a positive number is refused,
    naming the option."""
    from phasewatch.callbacks.transitions import TransitionWatcher
    from phasewatch.errors import ConfigError
    from phasewatch.phases.detector import departure

    steps = np.arange(25, 1001, 25)
    values = 1 + np.random.default_rng(0).normal(0, 0.02, len(steps))
    values[-2:] += 0.1
    z = departure(steps, values, "x")["snr"]
    assert 8 < z < 13
    assert departure(steps, values, "x", bar=z - 0.01)["onset"] == 975
    assert departure(steps, values, "x", bar=z + 0.01) is None
    said = TransitionWatcher().update({"x": (steps, values)}, 1000)
    assert [(e["stage"], e["onset"], e["snr"]) for e in said] == [("onset", 975, z)]
    assert TransitionWatcher(departure_z=z + 0.01).update({"x": (steps, values)}, 1000) == []
    for bad in (0, -1, "five"):
        with pytest.raises(ConfigError, match="transitions.departure_z"):
            TransitionWatcher(departure_z=bad)


# Outliers and heavy tails (issue 41, point 3): a loss spike or a bad batch is one point, not a
# change of the series; and a change is what the series shows, not a step the fit uses to offset
# the rest of its model where the series is flat.

LOG_54 = np.unique(np.round(np.geomspace(1, 10000, 60)))  # 60 log-spaced checkpoints, 54 distinct steps


@pytest.mark.parametrize("seed", range(8))
def test_one_outlier_on_a_flat_series_is_a_spike_not_a_transition(seed):
    rng = np.random.default_rng(4100 + seed)
    for _ in range(3):
        values = 1 + rng.normal(0, 0.01, len(LOG_54))
        i = int(rng.integers(0, len(LOG_54)))  # anywhere, the first and last points included
        values[i] += rng.choice([-0.5, 0.5])
        assert detect_transitions(LOG_54, values, "loss") == [], (i, LOG_54[i])
        if 0 < i < len(LOG_54) - 1:  # with neighbours on both sides: a spike (the ends cannot tell)
            (spike,) = detect_transitions(LOG_54, values, "loss", spikes=True)
            assert spike["kind"] == "spike" and spike["midpoint"] == LOG_54[i]
            assert spike["magnitude"] == pytest.approx(0.5, abs=0.05)
    # at the first point, with no points before it, an outlier is no transition either (at the last
    # one it can still be: docs/phases.md, where it is blind)
    values = 1 + rng.normal(0, 0.01, len(LOG_54))
    values[0] += 0.5
    assert detect_transitions(LOG_54, values, "loss") == []


def test_heavy_tailed_flat_noise_rarely_makes_a_transition():
    """Student-t noise with 2 degrees of freedom (infinite variance; about one point in 20 beyond 4
    noise scales). Gaussian noise of the same scale gives about 1 false transition in 100 series here
    (flat series' tests above)."""
    rng = np.random.default_rng(4200)
    found = 0
    for k in range(60):
        steps = (LOG_54, LOG_STEPS, LINEAR_STEPS[::2])[k % 3]
        found += bool(detect_transitions(steps, 1 + 0.01 * rng.standard_t(2, len(steps)), "flat"))
    assert found <= 3


@pytest.mark.parametrize("seed", range(4))
def test_no_change_is_invented_where_the_series_is_flat_beside_a_steep_drop_and_a_slow_decline(seed):
    """Flat to step ~300, a steep drop at 383, then a decline to the end: the fit's straight line
    for the decline, offset by a rise over the flat start, is no rise of the series."""
    rng = np.random.default_rng(4300 + seed)
    steps = np.arange(10, 10001, 10)
    decline = np.clip(np.log10(steps / 500) / np.log10(10000 / 500), 0, 1)
    values = 2 - sigmoid_in_log_steps(steps, 383, 0.05) - decline + rng.normal(0, 0.02, len(steps))
    events = detect_transitions(steps, values, "loss")
    assert all(e["direction"] == "down" and e["onset"] >= 250 for e in events), events
    drop = events[0]
    assert 300 <= drop["midpoint"] <= 500 and drop["magnitude"] == pytest.approx(1, rel=0.3)


@pytest.mark.parametrize("seed", range(6))
def test_a_spike_next_to_a_drop_leaves_the_drop_found_and_is_no_transition(seed):
    """A loss spike of twice the drop's size a few checkpoints before or after it (60 log-spaced
    checkpoints): one transition, the drop, where it is; the spike a spike."""
    rng = np.random.default_rng(4400 + seed)
    centre = 10 ** rng.uniform(2.3, 3.3)
    values = 2 - sigmoid_in_log_steps(LOG_54, centre) + rng.normal(0, 0.02, len(LOG_54))
    j = int(np.searchsorted(LOG_54, centre)) + int(rng.choice([-4, -3, 3, 4]))
    values[j] += 2.0 * rng.choice([-1, 1])
    (drop,) = detect_transitions(LOG_54, values, "loss")
    assert drop["direction"] == "down" and abs(np.log10(drop["midpoint"] / centre)) < 0.15
    assert drop["magnitude"] == pytest.approx(1, rel=0.3)
    events = detect_transitions(LOG_54, values, "loss", spikes=True)
    assert [e["midpoint"] for e in events if e["kind"] == "spike"] == [LOG_54[j]]


@pytest.mark.parametrize("seed", range(6))
def test_a_slow_oscillation_on_a_drop_makes_no_early_changes(seed):
    """A drop of 1.5 with an oscillation of one decade's period in log-step time. Its amplitude is
    5 x the noise (0.1 against 0.02): far out of the noise, so the fit has to account for it and the
    noise estimate (point against neighbours) does not absorb it; and its swings (0.2) are 13% of the
    drop, under `min_range_fraction` (30%), so none of them is a transition by the detector's own
    rule. Only the drop is one."""
    rng = np.random.default_rng(4500 + seed)
    steps = (LOG_STEPS, LINEAR_STEPS, LOG_54)[seed % 3]
    centre, phase = 10 ** rng.uniform(2.7, 3.5), rng.uniform(0, 2 * np.pi)
    values = (2 - 1.5 * sigmoid_in_log_steps(steps, centre) + 0.1 * np.sin(2 * np.pi * np.log10(steps) + phase)
              + rng.normal(0, 0.02, len(steps)))
    (drop,) = detect_transitions(steps, values, "loss")
    assert drop["direction"] == "down" and abs(np.log10(drop["midpoint"] / centre)) < 0.15


def test_the_watcher_says_a_stage_as_it_begins_and_once_it_is_confirmed():
    """Three series of two probes drop together (midpoint 1,000; train/loss, a headline key,
    among them) and a fourth, non-headline series of a third probe rises alone at 150: looked
    at every 25 steps, the watcher says one stage begins before its end and confirms it once after
    it, with the three series and nothing of the lone change; each said once."""
    from phasewatch.callbacks.transitions import TransitionWatcher
    import phasewatch.probes  # noqa: F401  (the key declarations: headline keys, families)

    steps = np.arange(25, 4001, 25)
    width = 0.5 / (2 * math.log(9))
    rng = np.random.default_rng(0)
    drop = 1 - sigmoid_in_log_steps(steps, 1000, width)
    curves = {"train/loss": 1 + 2 * drop, "val/loss": 2 + 3 * drop, "grok/gini_embed": 0.8 - 0.4 * drop,
              "icl/second_copy_loss": 0.3 + 0.2 * sigmoid_in_log_steps(steps, 150, width)}
    curves = {k: v + rng.normal(0, 0.01, len(steps)) for k, v in curves.items()}
    watcher, news = TransitionWatcher(), []
    for now in steps:
        keep = steps <= now
        final = now == steps[-1]
        watcher.update({k: (steps[keep], v[keep]) for k, v in curves.items()}, int(now), final=final)
        news += [(int(now), what, stage) for what, stage in
                 watcher.stage_news({k: (steps[keep], v[keep]) for k, v in curves.items()}, int(now), final)]
    said = [(what, stage.id) for _, what, stage in news]
    assert len(set(said)) == len(said), said  # each said once
    (stage,) = watcher.stages
    assert {m["series"] for m in stage.members} == {"train/loss", "val/loss", "grok/gini_embed"}
    assert 500 <= stage.midpoint <= 1500
    begins = [now for now, what, s in news if what == "begins" and s.id == stage.id]
    confirmed = [now for now, what, s in news if what == "confirmed" and s.id == stage.id]
    assert begins and begins[0] < stage.end, news
    assert confirmed and stage.end < confirmed[0] <= 1.5 * stage.end, news
    assert not [n for n in news if n[1] == "withdrawn"]


def test_the_detector_s_median_is_numpy_s_for_odd_and_even_counts_rows_and_nan():
    """`_median` (the detector's cheap median) gives np.median's numbers: the middle value, the
    mean of the two middle ones, per row of a 2-D array, NaN where a value is NaN; and the same
    bits as np.median on random arrays of every length a look meets."""
    from phasewatch.phases.detector import _median

    assert _median(np.array([3.0, 1.0, 2.0])) == 2.0
    assert _median(np.array([4.0, 1.0, 3.0, 2.0])) == 2.5
    assert list(_median(np.array([[5.0, 1.0, 3.0, 9.0], [2.0, 2.0, 8.0, 0.0]]))) == [4.0, 2.0]
    assert np.isnan(_median(np.array([1.0, np.nan, 2.0])))
    rows = _median(np.array([[1.0, np.nan, 2.0], [1.0, 7.0, 2.0]]))
    assert np.isnan(rows[0]) and rows[1] == 2.0
    rng = np.random.default_rng(0)
    for n in range(1, 42):
        x = rng.normal(0, 10.0 ** rng.uniform(-6, 6), n) + rng.uniform(-100, 100)
        assert _median(x) == np.median(x), n
        if n >= 5:
            windows = np.lib.stride_tricks.sliding_window_view(x, min(n, 5 + n % 4))
            assert np.array_equal(_median(windows), np.median(windows, axis=1)), n


def test_the_watcher_examines_only_the_watched_series_and_reads_each_key_s_declaration_once_a_run(monkeypatch):
    """By default a detail key (`lr`) is not watched, and `metrics` names the watched series
    otherwise; a look reads each key's declaration (`is_detail`, `declared_scale`) the first
    time it has new points, the later looks reuse it, and `plan` (a new run) reads it again."""
    import phasewatch.callbacks.transitions as live

    asked = []
    monkeypatch.setattr(live, "is_detail", lambda key, real=live.is_detail: asked.append(key) or real(key))
    steps = np.arange(1, 31)
    values = 1 + np.random.default_rng(0).normal(0, 0.01, len(steps))

    def look(watcher, n):
        watcher.update({"val/loss": (steps[:n], values[:n]), "lr": (steps[:n], values[:n])}, int(steps[n - 1]))
        return watcher._examined

    watcher = live.TransitionWatcher()
    assert look(watcher, 10) == ["val/loss"] and look(watcher, 11) == ["val/loss"]
    assert sorted(asked) == ["lr", "val/loss"]
    watcher.plan(100)
    assert look(watcher, 12) == ["val/loss"] and sorted(asked) == ["lr", "lr", "val/loss", "val/loss"]
    assert look(live.TransitionWatcher(metrics=["lr"]), 10) == ["lr"]

"""The scale a series is watched on (phases/scale.py), the Event type (phases/events.py), lead/lag
within one phase, and what the live watcher prints by default."""

import numpy as np
import pytest

from phasewatch.phases.detector import detect_all, detect_transitions, lead_lag, principal
from phasewatch.phases.events import Event
from phasewatch.phases.scale import LINEAR, LOG, watch_scale


def _logistic(t, centre, width=0.05):
    return 1 / (1 + np.exp(-(t - np.log10(centre)) / width))


def _two_falls(seed=0):
    """A loss that falls from 4 to 1 around step 50, then from 1 to 1e-6 around step 1,000 (2% noise)."""
    steps = np.unique(np.geomspace(1, 3000, 200).round())
    t = np.log10(steps)
    values = (1 + 3 * (1 - _logistic(t, 50))) * 10 ** (-6 * _logistic(t, 1000))
    return steps, values * 10 ** (0.02 * np.random.default_rng(seed).standard_normal(len(t)))


def _spans(events):
    return [(e["direction"], e["onset"], e["midpoint"], e["end"]) for e in events]


def test_a_loss_watched_in_log10_shows_both_falls():
    """The early drop (3 in the loss's units) and the later fall by six decades (1 in its units) are
    both transitions in log10 of the values; in the values, the second is 0.3% of the range and lost."""
    steps, values = _two_falls()
    found = detect_transitions(steps, values, "loss", scale=LOG)
    assert [e["direction"] for e in found] == ["down", "down"], _spans(found)
    early, late = found
    assert early["onset"] < 50 < early["end"] and late["onset"] < 1000 < late["end"], _spans(found)
    assert early["magnitude"] == pytest.approx(3, rel=0.1) and late["magnitude"] == pytest.approx(1, rel=0.1)
    assert all(e["scale"] == LOG for e in found)
    raw = detect_transitions(steps, values, "loss", scale=LINEAR)
    assert len(raw) == 1 and raw[0]["end"] < 100 and raw[0]["scale"] == LINEAR


def test_the_watch_scale_follows_the_declaration_then_the_data():
    falling = np.geomspace(4, 1e-4, 50)
    assert watch_scale(falling, LOG) == LOG
    assert watch_scale(falling, LINEAR) == LINEAR  # declared in its own units: kept so
    assert watch_scale(np.append(falling, 0.0), LOG) == LINEAR  # no log10 of 0
    assert watch_scale(falling) == LOG  # undeclared, positive, 4.6 decades
    assert watch_scale(np.linspace(0.05, 1, 50)) == LINEAR  # 1.3 decades
    assert watch_scale(np.linspace(-1, 1, 50)) == LINEAR
    assert watch_scale([np.nan, 1e-3, 1.0]) == LOG  # non-finite values are not looked at
    with pytest.raises(ValueError, match="declared scale"):
        watch_scale(falling, "logarithmic")


def test_detect_all_uses_each_series_declared_scale():
    steps, values = _two_falls()
    declared = {"val/loss": LOG, "val/acc": LINEAR}.get
    found = detect_all({"val/loss": (steps, values), "val/acc": (steps, values)}, declared=declared)
    by = {k: [e for e in found if e["metric"] == k] for k in ("val/loss", "val/acc")}
    assert [e["scale"] for e in by["val/loss"]] == [LOG, LOG] and [e["scale"] for e in by["val/acc"]] == [LINEAR]


def test_an_event_reads_back_as_it_was_written():
    line = {"metric": "val/loss", "direction": "down", "onset": 10, "midpoint": 20, "end": 40, "magnitude": 1.5,
            "kind": "transition", "scale": "log", "stage": "confirmed", "detected_at": 60, "members": ["a"]}
    event = Event.from_dict(line)
    assert event.midpoint == 20 and event.extra == {"members": ["a"]} and event.reason is None
    assert event.to_dict() == line and list(event.to_dict()) == list(line)  # same fields, same order
    assert set(Event("x", "up", 5, stage="onset").to_dict()) == {"metric", "direction", "onset", "stage"}
    with pytest.raises(KeyError, match="onset"):
        Event.from_dict({"metric": "x", "direction": "up"})


def _event(metric, onset, midpoint, end, direction="down"):
    return {"metric": metric, "direction": direction, "onset": onset, "midpoint": midpoint, "end": end,
            "kind": "transition"}


def test_lead_lag_compares_the_transitions_of_one_phase():
    """The restricted loss's early drop (memorisation) is not compared with the test loss's fall
    (later, another phase): its fall that overlaps the test loss's is; a series with no change
    in that phase has no row."""
    events = [_event("val/loss", 1500, 2200, 3100), _event("restricted", 117, 133, 152),
              _event("restricted", 690, 1200, 1780), _event("train/loss", 20, 30, 45)]
    rows = lead_lag(events, "val/loss")
    assert [(r["metric"], r["midpoint"], r["lead"], r["onset_lead"]) for r in rows] == [
        ("restricted", 1200, 1000, 810)]
    # two in the phase: the first (the series moved first there), not the one nearer by midpoint
    rows = lead_lag(events + [_event("restricted", 1900, 2150, 2400)], "val/loss")
    assert [(r["metric"], r["midpoint"]) for r in rows] == [("restricted", 1200)]


def test_the_report_compares_each_series_with_the_reference_s_largest_change_on_its_own_scale():
    """A test loss that rises during memorisation from 1 to 9 (the largest change in its units,
    under 1 decade), then falls from 2 to 1e-4 (4.3 decades: its grokking drop): its principal
    transition is the fall, and the report's rows are against it only, though the restricted
    loss's memorisation drop lies nearer the rise (the row once kept) than its fall does the drop."""
    steps = [10 * k for k in range(1, 301)]
    values = [1.0 if s < 100 else 9.0 if s < 160 else 2.0 if s < 2000 else 1e-4 for s in steps]
    rise = dict(_event("val/loss", 80, 100, 130, "up"), scale=LOG, magnitude=8.0)
    drop = dict(_event("val/loss", 1500, 2200, 2900), scale=LOG, magnitude=2.0)
    events = [rise, drop, _event("restricted", 90, 105, 120), _event("restricted", 700, 1200, 1800),
              _event("train/loss", 70, 90, 110)]
    assert principal(events, "val/loss", steps, values) is drop
    assert {r["reference_midpoint"] for r in lead_lag(events, "val/loss")} == {100, 2200}  # every phase's rows
    rows = lead_lag(events, "val/loss", (steps, values))
    assert [(r["metric"], r["midpoint"], r["lead"], r["onset_lead"]) for r in rows] == [("restricted", 1200, 1000, 800)]
    # on the linear scale the change is in the series' units: there the rise is the larger
    linear = [dict(e, scale=LINEAR) for e in (rise, drop)]
    assert principal(linear, "val/loss", steps, values)["midpoint"] == 100


def test_a_confirmed_stage_line_gives_the_levels_of_its_headline_series_that_moved():
    """By default the console gets stages; a confirmed stage's line gives the levels of its
    headline series that moved by more than a trifle (4 decades of the test loss, over the span of
    both its pieces in the stage), not of a trivial change (the accuracy's 0.01 of 0.51) nor of a
    series that is not a headline key; a per-series line is what `verbose` adds."""
    from phasewatch.callbacks.transitions import _line, _stage_line, worth_saying
    from phasewatch.phases.stages import Stage

    steps = np.arange(10, 1001, 10.0)
    series = {"val/loss": (steps, 4 * 10 ** (-4 * _logistic(np.log10(steps), 300))),
              "val/acc": (steps, 0.5 + 0.01 * _logistic(np.log10(steps), 300)),
              "grok/gini_embed": (steps, 0.2 + 0.5 * _logistic(np.log10(steps), 300))}

    def confirmed(metric, scale, onset=250, midpoint=300, end=360):
        return {**_event(metric, onset, midpoint, end), "stage": "confirmed", "scale": scale, "detected_at": 500,
                "magnitude": 1.0, "series": metric}

    assert worth_saying(confirmed("val/loss", LOG), series)  # 4 decades
    assert not worth_saying(confirmed("val/acc", LINEAR), series)  # 0.01 of 0.51: trivial
    assert not worth_saying(confirmed("grok/gini_embed", LINEAR), series)  # not a headline key
    assert not worth_saying({**confirmed("val/loss", LOG), "stage": "onset"}, series)
    members = [confirmed("val/loss", LOG, 200, 240, 280), confirmed("val/loss", LOG, 290, 330, 420),
               confirmed("val/acc", LINEAR), confirmed("grok/gini_embed", LINEAR)]
    stage = Stage(id=2, onset=200, midpoint=300, end=420, members=members, lead="val/loss", name="cleanup")
    line = _stage_line(None, 500, "confirmed", stage, series)
    loss = series["val/loss"][1]
    before, after = np.interp([200, 420], steps, loss)
    assert line.startswith("phasewatch: step 500: confirmed stage 2 cleanup: steps 200-420")
    assert line.endswith(f"; val/loss {before:.3g} -> {after:.3g} (log scale)")  # the one headline series worth it
    assert line.count(" -> ") == 1
    per_series = _line(None, confirmed("val/loss", LOG), series)
    assert per_series.startswith("phasewatch: step 500: transition in val/loss (down) from step 250 to 360, midpoint 300: ")
    assert "(log scale)" in per_series


def test_a_log_fit_whose_levels_lie_far_outside_the_data_gives_sizes_the_data_can_have():
    """quickstart_tiny seed 11's excluded loss up to step 750 (values to 6 digits), as the watcher saw
    it when the population crashed: a fit under way has two steps of about +-1,000 decades that
    cancel, whose levels (10**996) overflowed a float, and once held to 1e+-300, gave trends of
    size 1e+300 and 1.2e+30; the events still come, each no larger than the values' own range."""
    steps = [0, 25, 50, 75, 100, 125, 150, 175, 200, 207, 214, 222, 225, 229, 237, 246, 250, 254, 263, 272,
             275, 282, 291, 300, 301, 312, 323, 325, 334, 346, 350, 358, 370, 375, 383, 396, 400, 410, 424,
             425, 439, 450, 454, 470, 475, 486, 500, 503, 521, 525, 539, 550, 558, 575, 577, 597, 600, 618,
             625, 639, 650, 662, 675, 685, 700, 708, 725, 733]
    values = [3.44099, 2.6542, 3.47039, 2.51142, 3.30326, 3.74053, 4.15898, 4.38419, 4.38994, 4.37147,
              4.34716, 4.32266, 4.3179, 4.31245, 4.26872, 4.22089, 4.20331, 4.1852, 4.13805, 4.09564,
              4.08347, 4.05943, 4.02923, 4.00835, 4.00474, 3.97768, 3.95554, 3.95186, 3.93573, 3.91256,
              3.90377, 3.89348, 3.87702, 3.86778, 3.85724, 3.83832, 3.83192, 3.81859, 3.80847, 3.80675,
              3.79604, 3.79086, 3.78825, 3.77839, 3.77526, 3.77162, 3.76863, 3.76897, 3.77677, 3.77877,
              3.78646, 3.78938, 3.79383, 3.79908, 3.80094, 3.81196, 3.81131, 3.82555, 3.8291, 3.83677,
              3.84226, 3.8472, 3.85189, 3.85608, 3.86181, 3.86701, 3.86685, 3.86744]
    for in_progress in (True, False):
        events = detect_transitions(steps, values, "grok/excluded_loss", in_progress=in_progress, trends=True,
                                    scale=LOG)
        assert events
        assert all(0 < e["magnitude"] <= max(values) - min(values) for e in events)

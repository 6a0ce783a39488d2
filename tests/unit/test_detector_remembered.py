"""The detector's answers for the same points again (`_remembered`): the same events, with the
metric asked for, as copies a caller may change."""

import numpy as np

import phasewatch.phases.detector as detector


def _drop():
    steps = np.arange(1, 401, dtype=float)
    rng = np.random.default_rng(0)
    values = 2.0 - 1.5 / (1 + np.exp(-(np.log10(steps) - 2.0) / 0.05)) + 0.01 * rng.standard_normal(len(steps))
    return steps, values


def test_the_same_points_under_another_key_give_the_same_events_with_that_key():
    steps, values = _drop()
    first = detector.detect_transitions(steps, values, "a/loss")
    fitted = []
    afresh = detector._detect
    detector._detect = lambda *args: fitted.append(args) or afresh(*args)
    try:
        second = detector.detect_transitions(steps, values.copy(), "b/loss")
    finally:
        detector._detect = afresh
    assert first and not fitted  # a transition found, and not fitted again
    assert [{**e, "metric": "a/loss"} for e in second] == first
    assert all(e["metric"] == "b/loss" for e in second)


def test_a_changed_point_or_event_is_not_an_earlier_answer():
    steps, values = _drop()
    first = detector.detect_transitions(steps, values, "a/loss")
    first[0]["onset"] = -1  # a caller's change to its events ...
    again = detector.detect_transitions(steps, values, "a/loss")
    assert again[0]["onset"] > 0  # ... is not in the next answer
    values[-1] += 0.5  # another point: fitted afresh
    fitted = []
    afresh = detector._detect
    detector._detect = lambda *args: fitted.append(args) or afresh(*args)
    try:
        detector.detect_transitions(steps, values, "a/loss")
    finally:
        detector._detect = afresh
    assert len(fitted) == 1


def test_departure_of_the_same_points_under_another_key():
    steps = np.arange(1, 61, dtype=float)
    values = 1.0 + 0.01 * np.random.default_rng(0).standard_normal(60) - np.where(steps > 56, 0.5 * (steps - 56), 0)
    first = detector.departure(steps, values, "a")
    second = detector.departure(steps, values, "b")
    assert first is not None and {**second, "metric": "a"} == first and second["metric"] == "b"

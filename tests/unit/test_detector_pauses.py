"""A change that pauses is two transitions (phases/detector.py, `_Judge.pieces`): two drops with
a plateau between them, on hand-built series and on the published 5-digit addition token 2; a
steady or lopsided change, with noise on its slowing part, stays one."""

import numpy as np

from phasewatch.phases.detector import detect_transitions
from phasewatch.phases.scale import LOG
from phasewatch.rundir import load_series

EVERY_STEP = np.arange(1, 3001).astype(float)
LOG_300 = np.unique(np.round(np.geomspace(1, 20000, 300)))


def step_in_log_steps(steps, centre, width):
    return 1 / (1 + np.exp(-(np.log10(steps) - np.log10(centre)) / width))


def test_two_drops_with_a_plateau_between_are_two_transitions():
    """A loss logged every step (as the published per-token losses) falls by 0.45 decades at step
    1,550 (10-90% over 1,475-1,630), holds its level, and falls by 0.9 decades at 2,050
    (1,860-2,260); noise 0.02 decades. Two transitions, each on its own side of the plateau, in
    every seed (the detector without the pause rule joins them into one in 3 of these 6: a wide
    step across the plateau, into which the first drop is centred)."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        log_loss = (0.35 - 0.45 * step_in_log_steps(EVERY_STEP, 1550, 0.01) - 0.9 * step_in_log_steps(EVERY_STEP, 2050, 0.02)
                    + rng.normal(0, 0.02, len(EVERY_STEP)))
        events = detect_transitions(EVERY_STEP, 10**log_loss, "loss", scale=LOG)
        assert len(events) == 2, (seed, events)
        first, second = events
        assert 1475 <= first["midpoint"] <= 1630 and first["end"] <= 1750, (seed, first)
        assert 1860 <= second["midpoint"] <= 2260 and second["onset"] >= first["end"], (seed, second)


def test_a_lopsided_drop_with_noise_on_its_slowing_tail_is_one_transition():
    """A fast drop of 0.6 at step 400 inside a slower one of 0.6 centred at 700, on 300 log-spaced
    checkpoints with noise 0.02: the fall only slows down, so it is one transition in every seed,
    larger than the fast drop alone (its tail is part of it).
    Noise makes some stretch of the tail look flatter than a third of the drop's speed (without the
    `min_snr` standard errors the pause must clear, 2 of these 10 series split)."""
    for seed in range(10):
        rng = np.random.default_rng(seed)
        values = (1 - 0.6 * step_in_log_steps(LOG_300, 400, 0.03) - 0.6 * step_in_log_steps(LOG_300, 700, 0.15)
                  + rng.normal(0, 0.02, len(LOG_300)))
        (event,) = detect_transitions(LOG_300, values, "loss")
        assert event["onset"] < 400 < event["end"] and 0.75 < event["magnitude"] < 1.3, (seed, event)


def test_a_steady_fall_at_one_speed_in_log_steps_is_one_transition():
    """A fall of 1.5 spread evenly over steps 200-2,000 (one speed in log-step time, no plateau),
    every step logged, noise 0.1: one transition."""
    for seed in range(3):
        rng = np.random.default_rng(seed)
        ramp = np.clip(np.log10(EVERY_STEP / 200), 0, 1)
        (event,) = detect_transitions(EVERY_STEP, 1 - 1.5 * ramp + rng.normal(0, 0.1, len(EVERY_STEP)), "loss")
        assert event["onset"] < 400 and event["end"] > 1000, (seed, event)


def test_published_token_2_falls_to_ln_2_then_with_the_carry(reference_dir):
    """The authors' answer token 2: its loss falls from ln 10 (the digit unknown) to about ln 2
    (known but for its carry), where it pauses (steps ~1,650-1,800), then falls with the other
    tokens' carries. Two transitions: the first contains the step where the loss passes halfway
    (in log) from ln 10 to ln 2 and ends before the plateau does; the second contains the step
    where the loss passes 0.3 and begins after the first ends (was one transition, 1,514-1,995-2,293)."""
    steps, values = load_series(reference_dir / "5_digit_addition_infinite_per_token.csv")["answer_token_2"]
    steps, values = np.asarray(steps), np.asarray(values)
    smooth = np.array([np.median(values[max(0, i - 10):i + 11]) for i in range(len(values))])
    halfway = steps[np.argmax(smooth < np.sqrt(np.log(10) * np.log(2)))]
    carried = steps[np.argmax(smooth < 0.3)]
    first, second = detect_transitions(steps, values, "answer_token_2", scale=LOG)
    assert first["onset"] < halfway < first["end"] <= 1800, (halfway, first)
    assert first["end"] <= second["onset"] < carried < second["end"], (carried, second)

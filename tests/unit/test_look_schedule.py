"""When the live watcher looks (callbacks/transitions.py `look_steps`, `due_at`) and how its bars
rise with the number of looks a run plans (`bar_for`: Bonferroni over the planned looks)."""

import math

import numpy as np
import pytest

import phasewatch.probes  # noqa: F401  (the probes' declarations: headline keys, stage rules)
from phasewatch.callbacks.transitions import TransitionWatcher, bar_for, logged_at


def tail(z):
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("z", [1.645, 5.0, 10.0])
def test_the_bar_keeps_the_runs_false_alarm_chance_of_its_validations_alone(z):
    # with the validations' looks only the bar is the one given; with k times as many looks,
    # each look's test passes noise k times less often, so that k times the looks add up to
    # the same chance
    assert bar_for(z, 30, 30) == z
    for k in (2, 10, 100):
        raised = bar_for(z, k * 30, 30)
        assert raised > z
        assert k * tail(raised) == pytest.approx(tail(z), rel=1e-6)


def test_looks_are_log_spaced_besides_the_validations_and_the_population_skips_the_rest():
    w = TransitionWatcher(looks=60)
    validations = list(range(100, 3001, 100))
    steps = w.look_steps(3000, validations)
    assert set(validations) <= set(steps) and steps[-1] == 3000 and 0 not in steps
    early = [s for s in steps if s < 100]
    assert early[:10] == list(range(1, 11)) and len(early) > 20  # dense where validations are not yet
    gaps = np.diff([s for s in steps if s >= 1000])
    assert gaps.max() <= 100  # late on, the validations are the denser schedule
    w.plan(3000, len(steps), len(validations))
    assert all(w.due_at(s) for s in early) and not w.due_at(150) and not w.due_at(3000)
    assert TransitionWatcher(looks=0).look_steps(3000, validations) == validations
    assert w.look_steps(3000, validations, grid=False) == validations
    assert w.bar(5.0) == bar_for(5.0, len(steps), len(validations)) > 5.0


def logged(steps, f, seed):
    rng = np.random.default_rng(seed)
    return np.asarray(steps), f(np.asarray(steps, dtype=float)) + rng.normal(0, 0.01, len(steps))


def replay(watcher, series, looks, last, validations):
    """The watcher's stage news when it looks at `looks` (the look at `last` final), in a run
    that validates at `validations`."""
    watcher.plan(last, len(looks), len(validations))
    news = []
    for step in looks:
        cut = {k: (s[s <= step], v[s <= step]) for k, (s, v) in series.items() if (s <= step).any()}
        watcher.update(cut, step, final=step == last)
        news += [(step, what, stage) for what, stage in watcher.stage_news(cut, step, final=step == last)]
    return news


PROBES = np.unique(np.round(np.geomspace(1, 3000, 60)).astype(int))  # the probes' default schedule


def drop(centre, decades=0.3):
    width = decades / (2 * math.log(9))
    return lambda s: 2.0 - 1.0 / (1 + np.exp(-(np.log10(s) - math.log10(centre)) / width))


def test_a_planted_early_stage_is_announced_before_its_midpoint_by_the_log_spaced_looks():
    # two probe series fall together around step 60 (10-90% over 0.3 decades) in a run that
    # validates every 100 steps: only looks between validations can say it before step 60
    series = {key: logged(PROBES, drop(60), seed) for seed, key in
              enumerate(("grok/restricted_loss", "grok/excluded_loss"))}
    w = TransitionWatcher(looks=60)
    validations = list(range(100, 3001, 100))
    looks = [s for s in w.look_steps(3000, validations) if s <= 300]
    news = replay(w, series, looks, 3000, validations)
    first = min(step for step, what, _ in news if what == "begins")
    assert first < 60
    assert [what for _, what, _ in news].count("withdrawn") == 0


@pytest.mark.parametrize("per_doubling", [0, 16])
def test_noise_makes_no_stage_over_every_look_of_a_run(per_doubling):
    # flat noise logged as training (every 10 steps, and densely early: `logged_at`) and probes
    # log, looked at some 170 times: nothing to say
    steps = [s - 1 for s in range(1, 3001) if logged_at(s, 10, per_doubling)]  # a row's step: Lightning's
    series = {"train/loss": logged(steps, lambda s: 1 + 0 * s, 1),
              "grok/restricted_loss": logged(PROBES, lambda s: 1 + 0 * s, 2)}
    w = TransitionWatcher(looks=60)
    validations = list(range(25, 3001, 25))
    looks = w.look_steps(3000, validations)
    assert len(looks) > 160
    assert replay(w, series, looks, 3000, validations) == [] and w.reported == []


def test_metrics_are_logged_log_spaced_early_then_every_n_steps():
    # 16 a doubling: every step to 31, every 2nd to 63, every 4th to 127, every 8th to 255
    logged = [s for s in range(1, 601) if logged_at(s, 10, 16)]
    assert logged[:31] == list(range(1, 32)) and {34, 62, 68, 136, 248} <= set(logged)
    assert not {33, 63, 66, 132, 252} & set(logged)
    assert [s for s in logged if s > 255] == list(range(260, 601, 10))  # then the trainer's own spacing
    assert all(logged_at(s, 10, 16) for s in range(10, 601, 10))  # which it never leaves out
    for octave in (2, 4, 8):  # 16 points or more in each doubling of the step before that
        assert sum(16 * octave <= s < 32 * octave for s in logged) >= 16
    assert [s for s in range(1, 601) if logged_at(s, 10, 0)] == list(range(10, 601, 10))
    assert not any(logged_at(s, 0, 16) for s in range(1, 50))  # no logging stays none


def test_an_early_stage_is_announced_before_its_midpoint_only_when_the_metrics_are_logged_densely_early():
    # the training loss and accuracy change together around step 44 (as quickstart_tiny's
    # memorisation) in a 900-step run validating every 25 steps: logged every 10 steps they
    # have 4 points by the midpoint, too few for any test; logged 16 times a doubling, ~38
    validations = list(range(25, 901, 25))
    w = TransitionWatcher(looks=60)
    looks = [s for s in w.look_steps(900, validations) if s <= 300]
    said = {}
    for per_doubling in (0, 16):
        steps = np.array([s for s in range(1, 901) if logged_at(s, 10, per_doubling)])
        series = {"train/loss": logged(steps, drop(44, 0.4), 1),
                  "train/acc": logged(steps, lambda s: 3.0 - drop(44, 0.4)(s), 2)}
        news = replay(TransitionWatcher(looks=60), series, looks, 900, validations)
        said[per_doubling] = min((step for step, what, _ in news if what == "begins"), default=None)
        assert [what for _, what, _ in news].count("withdrawn") == 0
    assert said[16] < 44 and (said[0] is None or said[0] > 44)

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
    # a probe series and an accuracy logged on the probes' schedule change together around step
    # 60 (10-90% over 0.3 decades) in a run that validates every 100 steps: only looks between
    # validations can say it before step 60. (Until session 22 two grokking losses falling made
    # the stage, said as circuit formation: that name is no longer said before memorisation was,
    # and without it a loss halving is not yet worth saying before its midpoint, `evident`.)
    series = {"val/acc": logged(PROBES, lambda s: 3.0 - drop(60)(s), 0),
              "grok/excluded_loss": logged(PROBES, drop(60), 1)}
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


class LooksWhole(TransitionWatcher):
    """The watcher without its shortcut: every look made whole (`look`'s `_rest` never set)."""

    def look(self, trainer, step, final=False):
        self._rest = None
        return super().look(trainer, step, final)


def watch_a_run(watcher, folder, rows, looks):
    """The watcher's looks at `looks` (the last one final) in a run that has logged `rows`
    ({"step", key: value}) up to each look, as a trainer with its run folder at `folder`; the
    events, and how many looks were made whole (`stage_news` called)."""
    import json

    import lightning.pytorch as pl

    trainer = pl.Trainer(default_root_dir=folder, logger=False, enable_progress_bar=False)
    whole, stage_news = [], watcher.stage_news
    watcher.stage_news = lambda *a, **k: whole.append(a[1]) or stage_news(*a, **k)
    events = []
    for now in looks:
        with open(folder / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= now)
        events += watcher.look(trainer, now, final=now == looks[-1])
    return events, len(whole)


def test_a_look_with_nothing_new_to_see_is_cut_short_and_changes_nothing(tmp_path, capsys):
    # the training loss (logged every 10 steps) falls at 300 and again at 1,800, the validation
    # accuracy (every 100) rises at 300, the learning rate (a detail key) stays; looked at on the
    # grid and at the validations: the early looks, every step, see no new point most of the time.
    # The same events, stages, console lines, stage files and watcher state as with every look whole
    rng = np.random.default_rng(0)
    loss = lambda s: 3.0 - drop(300)(s) - 0.5 * (2.0 - drop(1800)(s))  # noqa: E731
    rows = [{"step": s, "train/loss": float(loss(s) + rng.normal(0, 0.01)), "lr": 1e-3} for s in range(10, 3001, 10)]
    rows += [{"step": s, "val/acc": float(drop(300)(s) * -1 + 2.0 + rng.normal(0, 0.01))} for s in range(100, 3001, 100)]
    rows.sort(key=lambda r: r["step"])
    validations = list(range(100, 3001, 100))
    out = {}
    for name, watcher in (("short", TransitionWatcher()), ("whole", LooksWhole())):
        (tmp_path / name).mkdir()
        looks = watcher.look_steps(3000, validations)
        watcher.plan(3000, len(looks), len(validations))
        events, whole = watch_a_run(watcher, tmp_path / name, rows, looks)
        out[name] = dict(events=events, whole=whole, console=capsys.readouterr().out, state=watcher.state_dict(),
                         stages=(tmp_path / name / "stages.jsonl").read_text())
    short, whole = out["short"], out["whole"]
    logged = [r["step"] for r in rows]
    quiet = sum(not any(a < s <= b for s in logged) for a, b in zip(looks, looks[1:]))  # no new point since the last
    assert whole["whole"] == len(looks) and quiet / 2 < len(looks) - short["whole"] <= quiet  # most of them cut short
    said = [e["stage"] for e in whole["events"]]
    assert said.count("confirmed") >= 2 and "onset" in said and "confirmed" in whole["stages"]  # something to say
    assert "stage" in whole["console"]
    for part in ("events", "console", "stages", "state"):
        assert short[part] == whole[part], part


def test_a_look_with_no_new_point_is_made_whole_where_an_onset_made_the_series_due(tmp_path):
    # 150 flat points looked at, then 5 falling ones: too few more for the detector (`regrow`),
    # enough for the departure test, whose onset makes the series due at every look (`_under_way`):
    # the next look, with no new point, runs the detector on it, as a whole look would
    rng = np.random.default_rng(1)
    rows = [{"step": s, "val/loss": 1.0 + float(rng.normal(0, 0.01))} for s in range(10, 1501, 10)]
    rows += [{"step": s, "val/loss": 1.0 - 0.1 * (s - 1500) / 10 + float(rng.normal(0, 0.01))} for s in range(1510, 1551, 10)]
    looks = [1500, 1550, 1555, 1560]
    states = {}
    for name, watcher in (("short", TransitionWatcher()), ("whole", LooksWhole())):
        (tmp_path / name).mkdir()
        watcher.plan(3000)
        events, _ = watch_a_run(watcher, tmp_path / name, rows, looks + [3000])
        states[name] = (events, watcher.state_dict())
    assert [e["stage"] for e in states["whole"][0]][:1] == ["onset"]
    assert states["short"] == states["whole"]

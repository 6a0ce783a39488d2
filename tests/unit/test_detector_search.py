"""The detector's step search with less host work (issue 45) answers as the search written out:
each set of steps' best addition is the candidate with the largest gain once every candidate that
overlaps a fitted step of the other direction is set to 0 (the search applies that only where it
blocks the best, `_StepModel._addition`), bit for bit; and numpy's error state around the QR and
least squares is set and put back as `np.errstate` does."""

import numpy as np
import pytest

import phasewatch.phases.detector as detector
from phasewatch.phases.detector import SPAN, _StepModel


def _series(seed: int, n: int):
    """Bins of a noisy rise then fall (or fall then rise), at times 0-3, weights 1-4."""
    rng = np.random.default_rng(seed)
    tb = np.sort(rng.uniform(0, 3, n))
    way = rng.choice([-1.0, 1.0])
    yb = way * (np.tanh((tb - rng.uniform(0.5, 1.5)) / rng.uniform(0.05, 0.3))
                - rng.uniform(0.2, 1.0) * np.tanh((tb - rng.uniform(1.7, 2.7)) / rng.uniform(0.05, 0.3)))
    return tb, yb + rng.normal(0, 10 ** rng.uniform(-3, -1), n), rng.integers(1, 5, n).astype(float)


def _written_out(model: _StepModel, steps: list, line: bool):
    """The best addition to `steps` by the rule written out with numpy's own QR and least squares:
    each candidate's gain (its squared projection on the residual over its squared norm outside the
    design; 0 where it has none), every candidate moving against a fitted step it overlaps set to 0."""
    root_w, tb = model.root_w, model.tb
    t_mean = model.t_mean
    x = np.array([root_w] + ([root_w * (tb - t_mean)] if line else [])
                 + [root_w * detector._logistic(tb, c, wd) for c, wd in steps]).T.copy()
    y = root_w * model.yb
    q = np.linalg.qr(x)[0]
    residual = y - q @ (q.T @ y)
    inner = q.T @ model.columns
    norm = model.column_norms - np.einsum("ij,ij->j", inner, inner)
    usable, norm = norm > 1e-9 * model.column_norms, np.maximum(norm, 1e-300)
    along = model.columns.T @ residual
    gain = np.where(usable, along**2 / norm, 0.0)
    unblocked = int(gain.argmax())
    heights = np.linalg.lstsq(x, y, rcond=None)[0][1 + line:]
    grid = model.grid
    overlaps = [np.abs(grid[:, 0] - c) < SPAN / 2 * (grid[:, 1] + wd) for c, wd in steps]
    for way, moving in ((along > 0, heights < 0), (along < 0, heights > 0)):
        for overlap, m in zip(overlaps, moving):
            if m:
                gain[way & overlap] = 0.0
    best = int(gain.argmax())
    return ((float(grid[best, 0]), float(grid[best, 1])), float(gain[best])), best != unblocked


def test_the_best_addition_is_the_rule_written_out_bit_for_bit_blocked_or_not():
    blocked = overlapping = asked = 0
    for seed in range(60):
        tb, yb, w = _series(seed, int(np.random.default_rng(seed).integers(10, 60)))
        detector._LAYOUTS.clear()
        model = _StepModel(tb, yb, w, 0.5)
        rng = np.random.default_rng(1000 + seed)
        for line in (False, True):
            model.line = line
            steps: list = []
            for _ in range(4):  # the greedy search's own sets, and sets with a step beside one of them
                want, was_blocked = _written_out(model, steps, line)
                got = model.best_addition(steps)
                assert got == want, (seed, line, steps)
                asked, blocked = asked + 1, blocked + was_blocked
                overlapping += any(abs(got[0][0] - c) < SPAN / 2 * (got[0][1] + wd) for c, wd in steps)
                near = rng.choice(len(model.grid))
                steps = steps + [got[0]] if rng.random() < 0.6 else steps + [tuple(map(float, model.grid[near]))]
    # both verdicts were asked: bests that overlap a fitted step and stay, and bests blocked
    assert asked == 480 and blocked >= 10 and overlapping >= 50, (blocked, overlapping)


def test_the_search_asks_each_set_once_and_a_new_series_afresh():
    """Answers kept per model are that model's: another series on the same bins (the same layout)
    gets its own residual, gain and heights, not the first's."""
    tb, yb, w = _series(3, 40)
    detector._LAYOUTS.clear()
    first = _StepModel(tb, yb, w, 0.5)
    steps = [first.best_addition([])[0]]
    answers = (first.best_addition(steps), first.sse(steps), first.heights(steps).tobytes())
    other = _StepModel(tb, -yb, w, 0.5)  # the same bins: the same layout, other values
    assert other.layout is first.layout
    mirrored = (other.best_addition(steps), other.sse(steps), other.heights(steps).tobytes())
    assert mirrored[1] == answers[1]  # the squared residual of -y is y's (every value negated exactly)
    assert mirrored[2] != answers[2]  # ... but the heights are its own
    assert (first.best_addition(steps), first.sse(steps), first.heights(steps).tobytes()) == answers


def test_the_linear_algebra_raises_as_numpy_does_and_puts_the_error_state_back():
    x = np.random.default_rng(0).normal(size=(12, 3))
    x[4, 1] = np.nan
    y = np.ones(12)
    with pytest.raises(np.linalg.LinAlgError):
        np.linalg.lstsq(x, y, rcond=None)
    outer = {"divide": "raise", "over": "warn", "under": "ignore", "invalid": "print"}
    with np.errstate(**outer):
        before = (np.geterr(), np.geterrcall())
        with pytest.raises(np.linalg.LinAlgError):
            detector._solve(x, y)
        assert (np.geterr(), np.geterrcall()) == before  # put back after the error too
        detector._orthonormal(np.abs(x[:, :2]) + 1.0)
        assert (np.geterr(), np.geterrcall()) == before
        with pytest.raises(FloatingPointError):  # the caller's state, not the linear algebra's
            np.array([1.0]) / 0.0


def test_einsum_without_its_wrapper_is_numpys():
    a = np.random.default_rng(1).normal(size=(7, 300)) * 1e3
    assert detector._EINSUM("ij,ij->j", a, a).tobytes() == np.einsum("ij,ij->j", a, a).tobytes()

"""The detector's step model (phases/detector.py, `_StepModel`) answers from what it computed
before: each set of steps' heights, fit, squared residual and best next step are those of least
squares on the design built here, asked once or again, with and without the line."""

import numpy as np

from phasewatch.phases.detector import _StepModel


def _bins(seed=0):
    """60 bins in log-step time (weights 1-4): a rise of 1 at t = 1 and a fall of 0.4 at t = 2, noise 0.02."""
    rng = np.random.default_rng(seed)
    tb = np.linspace(0, 3, 60)
    yb = 1 / (1 + np.exp(-(tb - 1) / 0.05)) - 0.4 / (1 + np.exp(-(tb - 2) / 0.1)) + rng.normal(0, 0.02, 60)
    return tb, yb, rng.integers(1, 5, 60).astype(float)


def _least_squares(tb, yb, w, steps, line):
    """Coefficients (level, slope or 0, heights) and the weighted squared residual, by np.linalg.lstsq
    on the design written out: 1, t - the weighted mean of t, a logistic 1 / (1 + exp(-(t - c) / wd))."""
    columns = [np.ones_like(tb)] + ([tb - np.average(tb, weights=w)] if line else [])
    columns += [1 / (1 + np.exp(-(tb - c) / wd)) for c, wd in steps]
    x = np.sqrt(w)[:, None] * np.column_stack(columns)
    coef = np.linalg.lstsq(x, np.sqrt(w) * yb, rcond=None)[0]
    residual = np.sqrt(w) * yb - x @ coef
    return (coef if line else np.insert(coef, 1, 0.0)), float(residual @ residual)


def test_heights_fit_and_residual_are_least_squares_asked_once_or_again_with_and_without_the_line():
    tb, yb, w = _bins()
    model = _StepModel(tb, yb, w, max_duration=0.5)
    steps = [(1.0, 0.05), (2.0, 0.1)]
    answers = {}
    for line in (False, True, False, True):  # asked again: the same answer as the first time
        model.line = line
        coef, sse = _least_squares(tb, yb, w, steps, line)
        assert np.allclose(model.heights(steps), coef[2:], rtol=0, atol=1e-9), line
        assert np.allclose(model.fit(steps)[0], coef, rtol=0, atol=1e-9), line
        assert np.isclose(model.sse(steps), sse, rtol=1e-9, atol=0), line
        first = answers.setdefault(line, (model.heights(steps), model.fit(steps)[0], model.sse(steps),
                                          model.best_addition(steps)))
        assert np.array_equal(first[0], model.heights(steps)) and np.array_equal(first[1], model.fit(steps)[0])
        assert first[2:] == (model.sse(steps), model.best_addition(steps))
    # the fit's coefficients are the caller's own: changing them changes no later answer
    model.fit(steps)[0][:] = 0.0
    assert np.allclose(model.fit(steps)[0], _least_squares(tb, yb, w, steps, True)[0], rtol=0, atol=1e-9)
    with np.testing.assert_raises(ValueError):  # what the model keeps is read-only
        model.heights(steps)[0] = 0.0


def test_the_best_next_step_is_the_one_that_lowers_the_squared_residual_most():
    """With the rise fitted, the best addition among the model's grid is the fall near t = 2, and its
    gain is the drop in the least-squares squared residual when it is added."""
    tb, yb, w = _bins(1)
    model = _StepModel(tb, yb, w, max_duration=0.5)
    step, gain = model.best_addition([(1.0, 0.05)])
    assert abs(step[0] - 2.0) < 0.2
    before = _least_squares(tb, yb, w, [(1.0, 0.05)], False)[1]
    after = _least_squares(tb, yb, w, [(1.0, 0.05), step], False)[1]
    assert np.isclose(gain, before - after, rtol=1e-6)
    assert model.best_addition([(1.0, 0.05)]) == (step, gain)

"""What the detector's step model computes from the bins alone (`_Layout`: the grid of candidate
steps, their columns, each set of steps' design and basis) is shared by the series binned the same
way, and only by them: a series gets the answers it gets alone, bit for bit, whatever was fitted
before it; bins at other times, with other weights or another `max_duration` get their own."""

import numpy as np
import pytest

import phasewatch.phases.detector as detector
from phasewatch.phases.detector import _StepModel


def _bins(seed=0, n=40):
    """Bins in log-step time (weights 1-4) of a rise at t = 1 and a fall at t = 2, noise 0.02."""
    rng = np.random.default_rng(seed)
    tb = np.linspace(0, 3, n)
    yb = 1 / (1 + np.exp(-(tb - 1) / 0.05)) - 0.4 / (1 + np.exp(-(tb - 2) / 0.1)) + rng.normal(0, 0.02, n)
    return tb, yb, rng.integers(1, 5, n).astype(float)


def _answers(tb, yb, w, max_duration=0.5):
    """Everything the search of one model answers: the chosen steps, line, coefficients, covariance,
    and the best next step and squared residual of a few sets of steps."""
    model = _StepModel(tb, yb, w, max_duration)
    steps = model.choose(0.01, 8)
    coef, cov = model.fit(steps)
    asked = [[], [(1.0, 0.05)], [(2.0, 0.1), (1.0, 0.05)]]
    return (steps, model.line, coef.tobytes(), cov.tobytes(),
            [(model.best_addition(s), model.sse(s)) for s in asked], model.columns.tobytes())


def _alone(*args, **kwargs):
    """`_answers` with nothing kept from earlier series."""
    detector._LAYOUTS.clear()
    return _answers(*args, **kwargs)


def test_series_binned_alike_share_the_layout_and_get_the_answers_they_get_alone():
    tb, yb, w = _bins()
    other = _bins(1)[1]  # other values at the same bins
    assert _StepModel(tb, yb, w, 0.5).layout is _StepModel(tb, other, w, 0.5).layout
    first_alone, other_alone = _alone(tb, yb, w), _alone(tb, other, w)
    detector._LAYOUTS.clear()
    assert _answers(tb, yb, w) == first_alone
    assert _answers(tb, other, w) == other_alone  # after the first, sharing its layout
    assert _answers(tb, yb, w) == first_alone  # and the first again, after the other
    assert first_alone[0] != other_alone[0] or first_alone[2] != other_alone[2]  # two different fits


@pytest.mark.parametrize("change", ["times", "weights", "max_duration", "fewer bins"])
def test_bins_at_other_times_with_other_weights_or_max_duration_get_their_own_columns(change):
    tb, yb, w = _bins()
    tb2, yb2, w2, duration = tb.copy(), yb, w.copy(), 0.5
    if change == "times":
        tb2[1:] += 1e-12  # the smallest difference there is at these times is still another layout
    elif change == "weights":
        w2[7] += 1.0
    elif change == "max_duration":
        duration = 0.25
    else:
        tb2, yb2, w2 = tb[:-1], yb[:-1], w[:-1]
    alone = _alone(tb2, yb2, w2, duration)
    detector._LAYOUTS.clear()
    first = _answers(tb, yb, w)
    assert _StepModel(tb2, yb2, w2, duration).layout is not _StepModel(tb, yb, w, 0.5).layout
    assert _answers(tb2, yb2, w2, duration) == alone  # not the first series' columns or bases
    assert alone[-1] != first[-1]  # their columns differ: the first's would have given other answers


def test_the_shared_arrays_are_read_only_and_the_kept_ones_bounded(monkeypatch):
    tb, yb, w = _bins()
    model = _StepModel(tb, yb, w, 0.5)
    for array in (model.tb, model.root_w, model.grid, model.columns, model.column_norms):
        with pytest.raises(ValueError):
            array[0] = 0.0
    alone = _alone(tb, yb, w)
    monkeypatch.setattr(detector, "BASES_BYTES", 20_000)  # a few sets of steps at a time: older ones made again
    detector._LAYOUTS.clear()
    assert _answers(tb, yb, w) == alone
    layout = _StepModel(tb, yb, w, 0.5).layout
    assert 0 < layout._bytes <= 20_000
    for seed in range(detector.LAYOUTS + 2):  # more layouts than are kept: the oldest go
        _StepModel(*_bins(seed, n=20 + seed), 0.5)
    assert len(detector._LAYOUTS) == detector.LAYOUTS and layout not in detector._LAYOUTS.values()


def test_its_qr_and_least_squares_are_numpys_bit_for_bit():
    rng = np.random.default_rng(0)
    for n, k in [(8, 1), (9, 3), (28, 6), (60, 10), (200, 9), (8, 10)]:  # the last: more columns than bins
        x = rng.normal(size=(n, k))
        x[:, -1] = x[:, 0] * (1 + 1e-13)  # nearly dependent columns, as narrow steps' can be
        y = rng.normal(size=n)
        assert np.array_equal(detector._orthonormal(x), np.linalg.qr(x)[0])
        assert np.array_equal(detector._solve(x, y), np.linalg.lstsq(x, y, rcond=None)[0])


def test_the_layouts_kept_between_fits_stay_within_their_byte_bound(monkeypatch):
    """Kept layouts (grid, columns and their bases' budget) never hold more than `KEPT_BYTES` in
    all: many bins (`DetectorConfig(bins=1000)` makes layouts of hundreds of MB) evict older ones,
    and a layout larger than the bound alone is used for its fit but not kept."""
    cases = [_bins(seed, n=20 + seed) for seed in range(6)] + [_bins(9, n=400)]  # the last alone over the bound
    alone = [_alone(*case) for case in cases]
    monkeypatch.setattr(detector, "KEPT_BYTES", 3 * detector._held(_StepModel(*cases[0], 0.5).layout))
    detector._LAYOUTS.clear()
    for case, answers in zip(cases, alone):
        assert _answers(*case) == answers
        assert sum(map(detector._held, detector._LAYOUTS.values())) <= detector.KEPT_BYTES
        if case is cases[-2]:
            assert 0 < len(detector._LAYOUTS) < detector.LAYOUTS  # the bytes, not the count, bound them here
    assert len(detector._LAYOUTS) > 0 and all(layout.tb.shape[0] != 400 for layout in detector._LAYOUTS.values())

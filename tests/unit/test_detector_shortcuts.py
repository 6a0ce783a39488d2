"""The detector's shortcuts around numpy's wrappers (issue 45: a live look pays them hundreds of
times on short series) give numpy's own answers bit for bit, and the departure test's early exit
(a split that misses the bar at the smallest noise it can have is not asked its median) answers
every split as the whole test does."""

import dataclasses
import math

import numpy as np
import pytest

import phasewatch.phases.detector as detector
from phasewatch.phases.detector import DEPARTURE_NEWEST, DEPARTURE_WINDOWS, DetectorConfig


@pytest.mark.parametrize("n, width", [(5, 5), (9, 5), (40, 21), (7, 7), (100, 3)])
def test_windows_are_numpys_sliding_windows(n, width):
    x = np.random.default_rng(n).normal(size=2 * n)
    for series in (x[:n], x[::2], x[:n].astype(np.float32)):  # contiguous, strided, another dtype
        got = detector._windows(series, width)
        want = np.lib.stride_tricks.sliding_window_view(series.astype(float), width)
        assert got.shape == want.shape and got.tobytes() == np.ascontiguousarray(want).tobytes()
        assert not got.flags.writeable


def test_ptp_and_settings_are_numpys_and_dataclasses():
    x = np.random.default_rng(0).normal(size=37) * 1e3
    assert detector._ptp(x) == float(np.ptp(x))
    cfg = DetectorConfig(bins=50, log_values="auto")
    assert detector._settings(cfg) == dataclasses.astuple(cfg)

    @dataclasses.dataclass
    class Listed(DetectorConfig):
        extra: list = dataclasses.field(default_factory=lambda: [1, 2])

    listed = Listed()
    assert detector._settings(listed) == dataclasses.astuple(listed)


def _split_z_whole(t, y, residuals, noise, start, k, bar):
    """The departure test of one split as session 20 made it: every quantity, then the verdict."""
    n = len(t)
    m = n - k - start
    tb, yb, tn, yn = t[start:n - k], y[start:n - k], t[n - k:], y[n - k:]
    t_mean, y_mean = float(tb.sum() / m), float(yb.sum() / m)
    sxx = float(((tb - t_mean) ** 2).sum())
    if sxx <= 0:
        return None
    slope = float(((tb - t_mean) * (yb - y_mean)).sum()) / sxx
    misfit = float(np.sqrt(((yb - y_mean - slope * (tb - t_mean)) ** 2).sum() / (m - 2))) if m > 2 else 0.0
    sigma = max(noise, misfit, float(np.median(np.abs(residuals[start:n - k - 1])) / 0.6745)
                if n - k - 1 > start else 0.0)
    r = yn - (y_mean + slope * (tn - t_mean))
    se = sigma * math.sqrt(k + k**2 * (1 / m + (float(tn.sum() / k) - t_mean) ** 2 / sxx))
    z = float(r.sum()) / se
    sign = 1.0 if z > 0 else -1.0
    before = yb[-max(k, 2):]
    moved = sign * (float(yn.sum() / k) - float(before.sum() / len(before))) / (sigma * math.sqrt(1 / k + 1 / len(before)))
    if abs(z) < bar or np.mean(np.sign(r) == sign) < 0.75 or abs(r[-1]) < abs(r[0]) or moved < 2:
        return None
    return z


def _series(seed):
    """A noisy log-spaced series; every third one jumps over its last few points (a departure)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(8, 90))
    steps = np.unique(np.geomspace(1, 10 ** rng.uniform(1.5, 3.5), n).round())
    y = 2 - 0.3 * np.log10(steps) + rng.normal(0, 10 ** rng.uniform(-3, -1), len(steps))
    if seed % 3 == 0:
        y[-int(rng.integers(1, 5)):] += rng.choice([-1, 1]) * rng.uniform(0.01, 0.5)
    return steps, y


def test_the_departure_tests_early_exit_answers_every_split_as_the_whole_test(monkeypatch):
    asked = departed = exited = 0
    scaled, robust_scale = [0], detector._robust_scale  # how many splits got as far as the median

    def counted(residual):
        scaled[0] += 1
        return robust_scale(residual)

    monkeypatch.setattr(detector, "_robust_scale", counted)
    for seed in range(300):
        steps, values = _series(seed)
        t, y, _ = detector._prepare(steps, values, False)
        residuals = detector._point_residuals(t, y)[1]
        noise = max(detector._robust_scale(residuals), detector.NOISE_FLOOR * float(np.ptp(y)))
        for window in DEPARTURE_WINDOWS:
            start = int(np.searchsorted(t, t[-1] - window))
            for k in range(1, DEPARTURE_NEWEST + 1):
                if len(t) - k - start < detector.DEPARTURE_BASELINE:
                    break
                for bar in (2.0, detector.DEPARTURE_Z):
                    want = _split_z_whole(t, y, residuals, noise, start, k, bar)
                    before = scaled[0]
                    assert detector._split_z(t, y, residuals, noise, start, k, bar) == want, (seed, window, k, bar)
                    asked, departed = asked + 1, departed + (want is not None)
                    exited += scaled[0] == before
    assert asked > 1000 and departed > 50  # both verdicts were asked
    assert asked > exited > asked // 10  # the early exit answered many splits, not all

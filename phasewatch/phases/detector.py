"""Phase-transition detection in any logged series (pure functions of steps and values).

`detect_transitions(steps, values)` works in log-step time: outliers (spikes: a point far from the
running median of its neighbours, in units of the local noise) are left out; the rest is binned,
fitted as a level, optionally a line, plus logistic steps chosen by a BIC-like price; steps moving
the same way at comparable speeds are one transition, two where the series pauses between them. A
transition is reported when its change is `min_snr` standard errors, `min_range_fraction` of the
fitted range, shown by the whole fitted curve over its 10-90% part, at most `max_duration` of the
run, and ended; otherwise it can be a trend (`trends=True`), a change under way
(`in_progress=True`); spikes are listed with `spikes=True`, never as transitions. Events are
`phases.events.Event`s as dicts (metric, direction, onset, midpoint, end, magnitude, kind, steepest,
snr, confidence, scale). `departure` tests whether a series' newest points have left their recent
trend (the live watcher's early onset). How and why, what each field means, and where it is blind:
docs/phases.md.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from phasewatch.phases.events import Event
from phasewatch.phases.scale import LINEAR, LOG, watch_scale


@dataclasses.dataclass
class DetectorConfig:
    """Tuning of `detect_transitions`; the defaults are measured in bench/detector.py
    (bench/README.md) and pass the known-answer tests of tests/unit/test_transitions.py.

    Attributes:
        bins: number of equal-width bins in log-step time.
        penalty: the reduction in squared residual a step must buy, in noise variances x log(bins).
        min_snr: a transition's change is at least this many standard errors...
        min_range_fraction: ... and at least this fraction of the fitted curve's range (in log10
            values: or `DECADE_CHANGE` decades, whichever is less).
        steepness: steps in one transition are at most this many times steeper than one another
            (a slow decline after a drop is not part of the drop).
        max_duration: a transition's 10-90% part lasts at most this fraction of the run's log-time.
        max_steps: at most this many steps are fitted to one series.
        log_values: False (default), True (log10 of the values), or "auto" (`watch_scale` of an
            undeclared series: log10 for positive series spanning two or more decades); a
            `scale` given to `detect_transitions` overrides it.
    """

    bins: int = 200
    penalty: float = 3.0
    min_snr: float = 5.0
    min_range_fraction: float = 0.3
    steepness: float = 6.0
    max_duration: float = 0.5
    max_steps: int = 8
    log_values: str | bool = False


#: a series whose binned values spread less than this fraction of their size is constant: averaging
#: equal values in bins leaves differences in the last digits (~1e-16 relative), which are no change
FLAT = 1e-9
#: the smallest noise assumed, as a fraction of the series' range (a clean curve is still fitted
#: with a finite number of steps)
NOISE_FLOOR = 2e-3
#: a change running past the end of the series has ended when it moves this many times slower
#: there than at its steepest (a logistic step is then ~90% done)
LEVELLING = 3.0
#: a spike (outlier) is a point this many noise scales from the median of itself and its 2 neighbours
#: on either side (Gaussian noise: 2e-5 of points; an outlier of 4.5 noise scales buys less than the
#: two narrow steps that would fit it cost, so what is left cannot make a transition)
SPIKE_Z = 4.5
#: the noise scale at a point: from the residuals within this many points either side
SPIKE_AROUND = 10
#: a point's residual against the median of 5 has a robust scale this fraction of the noise (Gaussian)
MEDIAN_RESIDUAL = 0.73
#: a transition's change is seen in the series: over its 10-90% part the whole fitted curve moves its
#: way by at least this fraction of the transition's own move (a step the fit uses to offset a line
#: or another step where the series is flat is no change of the series)
SUPPORT = 0.5
#: in log10 values, a change by this many decades (a factor of 2) is large enough whatever the range: a
#: loss that halves, then falls by six decades, has changed twice (`min_range_fraction` of the range
#: alone would hide the first change behind the second)
DECADE_CHANGE = math.log10(2)
#: a change pauses (and is two transitions) where the series moves at most 1/`LEVELLING` as fast as the change
#: at its steepest on either side over at least this many consecutive bins: a level seen at more points than
#: the two that any change passes between
PAUSE_BINS = 3
#: rounds of refinement after the greedy search
ROUNDS = 2
#: the 10-90% part of a logistic step lasts this many widths
SPAN = 2 * math.log(9)
#: step widths tried: from this fraction of the bin spacing (a step between two logged points) ...
NARROWEST = 0.15
#: ... to a 10-90% part of this fraction of `max_duration` of the run's log-time, in this many
#: geometric steps (wider steps would stand in for several transitions and the plateaus between
#: them; a slower change is fitted as overlapping steps, and a steady one as the line)
WIDEST, N_WIDTHS = 0.5, 14


def _prepare(steps: Sequence[float], values: Sequence[float], log_values) -> tuple[np.ndarray, np.ndarray, bool]:
    """Log-step times and values (log10 of the positive ones for `log_values` True, LOG, or "auto"
    where `watch_scale` says so), finite points only, in step order; and whether in log10."""
    s = np.asarray(steps, dtype=float)
    v = np.asarray(values, dtype=float)
    keep = np.isfinite(v) & np.isfinite(s) & (s >= 1)
    s, v = s[keep], v[keep]
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    use_log = log_values is True or log_values == LOG or (log_values == "auto" and watch_scale(v) == LOG)
    if use_log:
        keep = v > 0
        s, v = s[keep], np.log10(v[keep])
    return np.log10(s), v, use_log


def _bin(t: np.ndarray, y: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Means of t and y in equal-width bins of t, and the number of points in each (empty bins dropped)."""
    edges = np.linspace(t[0], t[-1] + 1e-12, n_bins + 1)
    idx = np.minimum(np.maximum(np.searchsorted(edges, t, side="right") - 1, 0), n_bins - 1)  # = np.clip
    counts = np.bincount(idx, minlength=n_bins)
    ok = counts > 0
    tb = np.bincount(idx, weights=t, minlength=n_bins)[ok] / counts[ok]
    yb = np.bincount(idx, weights=y, minlength=n_bins)[ok] / counts[ok]
    return tb, yb, counts[ok].astype(float)


def _point_residuals(t: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each interior point against the line through its two neighbours, scaled to one point's
    noise (the residual's variance is sigma^2 (1 + a^2 + b^2) for the interpolation weights
    a, b); with the points' t."""
    if len(y) < 3:
        return np.zeros(0), np.zeros(0)
    gap = t[2:] - t[:-2]
    a = np.where(gap > 0, (t[2:] - t[1:-1]) / np.where(gap > 0, gap, 1.0), 0.5)
    return t[1:-1], (y[1:-1] - a * y[:-2] - (1 - a) * y[2:]) / np.sqrt(1 + a**2 + (1 - a) ** 2)


def _outliers(t: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The points against their neighbourhood (a Hampel identifier): each point's
    residual r against the running median (`_running_median`: of 5 points, of 3 next to the ends; the
    first and last points are not judged), in units of the noise there, z. The median follows a step or any monotone stretch
    exactly, so a change has r = 0; an outlier (or two in a row) stands out. The noise
    there: the robust scale of the residuals r within `SPIKE_AROUND` points either side (a noisier
    stretch is not all outliers), at least the series' own point noise. Spikes (|z| > `SPIKE_Z`) are
    taken out the largest in its neighbourhood first, and the rest judged again without them (an
    outlier on a slope shifts its neighbours' medians). Returns the spikes, z and r."""
    n = len(y)
    spike, z, r = np.zeros(n, dtype=bool), np.zeros(n), np.zeros(n)
    floor = max(_robust_scale(_point_residuals(t, y)[1]), NOISE_FLOOR * _ptp(y))
    while floor > 0 and (m := int((~spike).sum())) >= 7:
        idx = np.flatnonzero(~spike)
        ys = y[idx]
        around = _running_median(ys)
        rs = ys - around
        width = min(2 * SPIKE_AROUND + 1, m)
        local = _median(np.abs(_windows(rs, width))) / 0.6745 / MEDIAN_RESIDUAL
        scale = np.maximum(local[np.minimum(np.maximum(np.arange(m) - width // 2, 0), len(local) - 1)], floor)
        zs = rs / scale
        r[idx], z[idx] = rs, zs
        big = np.abs(zs) * (np.abs(zs) > SPIKE_Z)
        first = (big > 0) & (big >= _MAX(_windows(np.concatenate((_TWO_ZEROS, big, _TWO_ZEROS)), 5), axis=1))
        if not first.any():
            break
        spike[idx[first]] = True
    return spike, z, r


def _running_median(y: np.ndarray) -> np.ndarray:
    """The median of each point and its two neighbours on either side, of three next to the ends; the
    first and last points are their own (with neighbours on one side only, an outlier there cannot be
    told from the start of a change): every value of a monotone stretch is its own median, an
    outlier is not."""
    out = y.astype(float).copy()
    out[2:-2] = _median(_windows(y, 5))
    out[1], out[-2] = _median(y[:3]), _median(y[-3:])
    return out


#: numpy's reductions without their Python wrappers (`ndarray.sum`, `np.max`, `np.ptp` call these): the same numbers
_ADD, _MAX, _MIN = np.add.reduce, np.maximum.reduce, np.minimum.reduce
_TWO_ZEROS = np.zeros(2)
_EPS = float(np.finfo(float).eps)


def _ptp(x: np.ndarray) -> float:
    """`float(np.ptp(x))` of a non-empty 1-D float array (the same number)."""
    return float(_MAX(x) - _MIN(x))


def _windows(x: np.ndarray, width: int) -> np.ndarray:
    """`np.lib.stride_tricks.sliding_window_view(x, width)` of a 1-D float array (the same values, read
    only), without its Python overhead, which a look pays hundreds of times on short series."""
    x = np.ascontiguousarray(x, dtype=float)
    view = np.ndarray((len(x) - width + 1, width), float, x, 0, (x.itemsize, x.itemsize))
    view.flags.writeable = False
    return view


def _median(x: np.ndarray):
    """`np.median` of a 1-D array, or of each row of a 2-D one: the same numbers (the middle
    value, or the mean of the two middle values, of the sorted values; NaN where one is NaN),
    without `np.median`'s fixed cost, which a look pays thousands of times on short series."""
    ordered = np.sort(x, axis=-1)
    n = ordered.shape[-1]
    half = ordered[..., n // 2] if n % 2 else (ordered[..., n // 2 - 1] + ordered[..., n // 2]) / 2
    return np.where(np.isnan(ordered[..., -1]), np.nan, half) if x.ndim > 1 else (
        np.nan if np.isnan(ordered[-1]) else half)


def _robust_scale(residual: np.ndarray) -> float:
    return float(_median(np.abs(residual)) / 0.6745) if len(residual) else 0.0


def _logistic(t: np.ndarray, centre, width) -> np.ndarray:
    return 0.5 * (1 + np.tanh((t - centre) / (2 * width)))


#: how many bin layouts (bin times, weights, `max_duration`) `_layout` keeps for the next series
#: binned the same way: every key of a run logged at a validation, every member of a population
LAYOUTS = 4
#: ... and, in each, how many bytes of what it computed for steps and sets of steps before the oldest go
BASES_BYTES = 1 << 22
#: ... and at most this many bytes in all, each layout counted at its grid and columns plus its
#: `BASES_BYTES` (a layout larger than this alone, e.g. of `DetectorConfig(bins=1000)`, is not kept)
KEPT_BYTES = 48 << 20
_LAYOUTS: dict[tuple, "_Layout"] = {}


def _layout(tb: np.ndarray, w: np.ndarray, max_duration: float) -> "_Layout":
    """The `_Layout` of these bins: one of the last `LAYOUTS` asked for when their bin times, weights and
    `max_duration` are the same, bit for bit (then so is everything computed from them); what is kept
    between fits stays within `KEPT_BYTES`."""
    key = (tb.tobytes(), w.tobytes(), float(max_duration))
    found = _LAYOUTS.pop(key, None)
    if found is None:
        found = _Layout(tb, w, max_duration)
    if _held(found) > KEPT_BYTES:  # used for this fit, not kept
        return found
    # the least recently asked for go
    while _LAYOUTS and (len(_LAYOUTS) >= LAYOUTS or sum(map(_held, _LAYOUTS.values())) + _held(found) > KEPT_BYTES):
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[key] = found
    return found


def _held(layout: "_Layout") -> int:
    """The most bytes a kept layout holds: its grid and columns, and its `BASES_BYTES`."""
    return (layout.grid.nbytes + layout.columns.nbytes + layout.column_norms.nbytes + layout.negligible.nbytes
            + layout.line_column.nbytes + BASES_BYTES)


class _Layout:
    """What the step model of bins at times `tb` with weights `w` computes from them alone, not from the
    values: the grid of candidate steps, their weighted columns and squared norms, and for each set of
    steps (with or without the line) the weighted design, its orthonormal basis and the part of each
    candidate's squared norm outside it. Shared (`_layout`) by every series binned the same way."""

    def __init__(self, tb: np.ndarray, w: np.ndarray, max_duration: float):
        self.tb, self.root_w = _frozen(tb.copy()), _frozen(np.sqrt(w))
        spacing = float(np.median(np.diff(tb))) if len(tb) > 1 else 1.0
        total = float(tb[-1] - tb[0])
        widths = np.geomspace(NARROWEST * spacing, max(WIDEST * max_duration * total / SPAN, NARROWEST * spacing * 2), N_WIDTHS)
        # steps may also sit between two bins: where bins are few, or sharp ones (a jump between two checkpoints)
        both = np.concatenate([tb, (tb[1:] + tb[:-1]) / 2])
        centres = [both if wd < spacing or len(tb) < 100 else tb for wd in widths]
        self.grid = _frozen(np.column_stack((np.concatenate(centres), np.repeat(widths, [len(c) for c in centres]))))
        self.spacing = spacing
        self.columns = _frozen(self.root_w[:, None] * _logistic(tb[:, None], self.grid[:, 0], self.grid[:, 1]))
        self.column_norms = _frozen(_EINSUM("ij,ij->j", self.columns, self.columns))
        self.t_mean = float(np.average(tb, weights=w))
        # the line's weighted column, and the squared norm outside a design below which a column has none
        # (computed once here: the same numbers as at each set of steps)
        self.line_column = _frozen(self.root_w * (self.tb - self.t_mean))
        self.negligible = _frozen(1e-9 * self.column_norms)
        self._bases: dict[tuple, tuple] = {}  # per step and per set of steps (`_kept`)
        # their bytes, the oldest first (an OrderedDict: a dict's first key after many taken from its
        # front is found by a scan past their empty slots)
        self._sizes: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._bytes = 0

    def step(self, step: tuple[float, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step's column at the bins, weighted, and which grid steps overlap it (their 10-90%
        parts), computed once."""
        if (found := self._bases.get(step)) is None:
            c, wd = step
            column = _logistic(self.tb, c, wd)
            found = self._kept(step, (column, self.root_w * column,
                                      np.abs(self.grid[:, 0] - c) < SPAN / 2 * (self.grid[:, 1] + wd)))
        return found

    def basis(self, steps: tuple[tuple[float, float], ...], line: bool) -> tuple[np.ndarray, np.ndarray]:
        """The weighted design of these steps (in this order) and line, and q of its QR."""
        if (found := self._bases.get(key := ("basis", steps, line))) is None:
            # the weighted columns side by side (the same numbers as root_w[:, None] * the design)
            x = np.array([self.root_w] + ([self.line_column] if line else [])
                         + [self.step(step)[1] for step in steps]).T.copy()
            found = self._kept(key, (x, _orthonormal(x)))
        return found

    def outside(self, steps: tuple[tuple[float, float], ...], line: bool) -> tuple[np.ndarray, np.ndarray]:
        """For these steps and line: where each grid step's column has a part outside the design
        (> 1e-9 of its squared norm), and that part's squared norm (at least 1e-300)."""
        if (found := self._bases.get(key := ("outside", steps, line))) is None:
            q = self.basis(steps, line)[1]
            inner = q.T @ self.columns
            norm = self.column_norms - _EINSUM("ij,ij->j", inner, inner)
            found = self._kept(key, (norm > self.negligible, np.maximum(norm, 1e-300)))
        return found

    def _kept(self, key: tuple, found: tuple) -> tuple:
        """`found`'s arrays (made read-only), kept for `key` (a step, or what, steps and line) while they
        fit in `BASES_BYTES` with the newer ones."""
        size = 0
        for array in found:  # read-only (`_frozen`), and their bytes
            array.setflags(write=False)
            size += array.nbytes
        while self._sizes and self._bytes + size > BASES_BYTES:  # the oldest go
            oldest, old_size = self._sizes.popitem(last=False)
            del self._bases[oldest]
            self._bytes -= old_size
        self._bases[key], self._sizes[key], self._bytes = found, size, self._bytes + size
        return found


def _frozen(array: np.ndarray) -> np.ndarray:
    """The array, read-only (shared by several models: none may change it)."""
    array.setflags(write=False)
    return array


def _raise(*_):
    raise np.linalg.LinAlgError("the step model's QR or least squares did not converge")


try:  # the gufuncs behind np.linalg.qr and np.linalg.lstsq: the same numbers without the wrappers' checks,
    # which cost more than the factorisation of a matrix of tens of bins (R, which np.linalg.qr forms, is not used)
    from numpy.linalg import _umath_linalg
    _QR, _LSTSQ = _umath_linalg.qr_r_raw, _umath_linalg.lstsq
except (ImportError, AttributeError):  # pragma: no cover (another numpy)
    _QR = _LSTSQ = None
try:  # np.einsum without its Python wrapper (np.einsum calls it: the same numbers), and the error state
    # np.linalg sets around its gufuncs, set as `np.errstate` sets it (without building one each call)
    from numpy._core.multiarray import c_einsum as _EINSUM
    from numpy._core.umath import _extobj_contextvar as _ERRORS, _make_extobj
    _LINALG_ERRORS = _make_extobj(call=_raise, invalid="call", over="ignore", divide="ignore", under="ignore")
except (ImportError, AttributeError, TypeError):  # pragma: no cover (another numpy)
    _EINSUM, _ERRORS = np.einsum, None
_OR = np.logical_or.reduce


def _orthonormal(x: np.ndarray) -> np.ndarray:
    """`np.linalg.qr(x)[0]` of a float matrix (the same numbers; with more columns than rows too)."""
    if _QR is None:  # pragma: no cover
        return np.linalg.qr(x)[0]
    a = x.copy()
    if _ERRORS is None:  # pragma: no cover
        with np.errstate(call=_raise, invalid="call", over="ignore", divide="ignore", under="ignore"):
            return _umath_linalg.qr_reduced(a, _QR(a, signature="d->d"), signature="dd->d")
    token = _ERRORS.set(_LINALG_ERRORS)
    try:
        return _umath_linalg.qr_reduced(a, _QR(a, signature="d->d"), signature="dd->d")
    finally:
        _ERRORS.reset(token)


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`np.linalg.lstsq(x, y, rcond=None)[0]` of a float matrix and vector (the same numbers)."""
    if _LSTSQ is None:  # pragma: no cover
        return np.linalg.lstsq(x, y, rcond=None)[0]
    if _ERRORS is None:  # pragma: no cover
        with np.errstate(call=_raise, invalid="call", over="ignore", divide="ignore", under="ignore"):
            return _LSTSQ(x, y[:, None], _EPS * max(x.shape), signature="ddd->ddid")[0][:, 0]
    token = _ERRORS.set(_LINALG_ERRORS)
    try:
        return _LSTSQ(x, y[:, None], _EPS * max(x.shape), signature="ddd->ddid")[0][:, 0]
    finally:
        _ERRORS.reset(token)


class _StepModel:
    """A level, optionally a line in t, plus logistic steps, fitted by weighted least squares to the bins."""

    def __init__(self, tb: np.ndarray, yb: np.ndarray, w: np.ndarray, max_duration: float):
        tb, w = np.asarray(tb, dtype=float), np.asarray(w, dtype=float)
        # what depends on the bins alone is shared with every series binned the same way (`_layout`)
        self.layout = layout = _layout(tb, w, max_duration)
        self.tb, self.yb, self.root_w = layout.tb, yb, layout.root_w
        self.grid, self.spacing, self.columns = layout.grid, layout.spacing, layout.columns
        self.column_norms, self.t_mean = layout.column_norms, layout.t_mean
        self.weighted_y = self.root_w * yb
        self.line = False
        # the search asks for the same steps' heights, residuals and best next step many times over:
        # each is computed once per model (the same numbers as computed afresh)
        self._memo: dict[tuple, list] = {}

    def _fitted(self, steps: list[tuple[float, float]], line: bool) -> list:
        """What this model computed for these steps and line, computed once as asked:
        [steps (a tuple), residual, squared residual, coefficients, best addition] (None: not yet)."""
        key = (tuple(steps), line)
        if (found := self._memo.get(key)) is None:
            found = self._memo[key] = [key[0], None, None, None, None]
        return found

    def _residual(self, fitted: list, line: bool) -> np.ndarray:
        """The weighted residual of `_fitted`'s steps and line (read-only)."""
        if (residual := fitted[1]) is None:
            q, y = self.layout.basis(fitted[0], line)[1], self.weighted_y
            residual = fitted[1] = _frozen(y - q @ (q.T @ y))
        return residual

    def _weighted(self, steps: list[tuple[float, float]], line: bool) -> np.ndarray:
        return self.layout.basis(tuple(steps), line)[0]

    def heights(self, steps: list[tuple[float, float]]) -> np.ndarray:
        """The fitted steps' heights (`fit`'s coefficients after the level and slope)."""
        return self._coef(steps, self.line)[1 + self.line:]

    def _coef(self, steps: list[tuple[float, float]], line: bool) -> np.ndarray:
        fitted = self._fitted(steps, line)
        if (coef := fitted[3]) is None:
            coef = fitted[3] = _frozen(_solve(self.layout.basis(fitted[0], line)[0], self.weighted_y))
        return coef

    def fit(self, steps: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
        """Coefficients (level, slope (0 without the line), steps) and their covariance in units of
        one point's noise variance (the slope's row and column are 0 without the line)."""
        x = self._weighted(steps, self.line)
        coef = self._coef(steps, self.line)
        cov = np.linalg.pinv(x.T @ x)
        if not self.line:
            coef = np.insert(coef, 1, 0.0)
            cov = np.insert(np.insert(cov, 1, 0.0, axis=0), 1, 0.0, axis=1)
        return coef.copy(), cov

    def curve(self, steps: list[tuple[float, float]], coef: np.ndarray, t: np.ndarray | None = None) -> np.ndarray:
        """The fitted curve of `fit`'s coefficients (level, slope, heights of `steps`) at t."""
        t = self.tb if t is None else t
        return coef[0] + coef[1] * (t - self.t_mean) + sum(
            (h * _logistic(t, c, wd) for h, (c, wd) in zip(coef[2:], steps)), np.zeros_like(t))

    def best_addition(self, steps: list[tuple[float, float]]) -> tuple[tuple[float, float], float]:
        """The grid step that most reduces the weighted SSE given `steps`, and by how much. A step
        may not overlap (10-90% parts) a step of the other direction: that pair would be a bump
        cancelling itself, which lets a wide step stand in for several narrow ones."""
        fitted = self._fitted(steps, self.line)
        if (found := fitted[4]) is None:
            found = fitted[4] = self._addition(fitted)
        return found

    def _addition(self, fitted: list) -> tuple[tuple[float, float], float]:
        steps, line, layout = fitted[0], self.line, self.layout
        usable, norm = layout.outside(steps, line)
        # each column's part orthogonal to the model (`norm`: its squared norm): the residual is
        # orthogonal to the model already
        along = self.columns.T @ self._residual(fitted, line)
        gain = np.where(usable, along**2 / norm, 0.0)
        best = int(gain.argmax())
        # no step overlapping one of `steps` the other way (along 0 gains nothing either way): only
        # the best needs the heights' directions, where it overlaps one (the others can only lose: the
        # gains are >= 0 and those of overlapping steps only set to 0, so an unblocked best stays the first)
        centre, width = self.grid[best].tolist()
        # the steps it overlaps (`_Layout.step`'s test, on the same floats)
        overlapping = [i for i, (c, wd) in enumerate(steps) if abs(centre - c) < SPAN / 2 * (width + wd)]
        if overlapping:
            heights = self._coef(steps, line)[1 + line:]
            if (along[best] > 0 and any(heights[i] < 0 for i in overlapping)) or (
                    along[best] < 0 and any(heights[i] > 0 for i in overlapping)):
                for way, moving in ((along > 0, heights < 0), (along < 0, heights > 0)):
                    if moving.any():
                        gain[way & _OR([layout.step(step)[2] for step, m in zip(steps, moving) if m])] = 0.0
                best = int(gain.argmax())
                centre, width = self.grid[best].tolist()
        return (centre, width), float(gain[best])

    def sse(self, steps: list[tuple[float, float]]) -> float:
        fitted = self._fitted(steps, self.line)
        if (found := fitted[2]) is None:
            residual = self._residual(fitted, self.line)
            found = fitted[2] = float(residual @ residual)
        return found

    def line_gain(self, steps: list[tuple[float, float]]) -> float:
        """How much adding the line reduces the weighted SSE given `steps`."""
        without = self._residual(self._fitted(steps, False), False)
        with_line = self._residual(self._fitted(steps, True), True)
        return float(without @ without - with_line @ with_line)

    def choose(self, price: float, max_steps: int) -> list[tuple[float, float]]:
        """Steps (each priced at 3 x `price`, for its height, centre and width) added greedily, the
        one buying most first, while one buys more than it costs; when none does, the line (priced
        at `price`) if it pays, and the steps again; and the same search starting from the line,
        the cheaper of the two kept. Then each step in turn is taken out and the
        greedy search resumed from the rest (a wide step chosen early can stand where two narrow
        ones belong), and neighbouring steps moving the same way are tried as one; each change kept
        when the priced squared residual falls."""
        best = None
        for line in (False, True):  # with and without a steady trend from the start; the cheaper wins
            self.line = line
            steps = self._search(price, max_steps)
            cost = self.sse(steps) + price * (3 * len(steps) + self.line)
            if best is None or cost < best[0]:
                best = (cost, steps, self.line)
        _, steps, self.line = best
        return steps

    def _search(self, price: float, max_steps: int) -> list[tuple[float, float]]:
        steps = self._grow([], price, max_steps)
        for _ in range(ROUNDS):
            changed = False
            for step in list(steps):
                if step not in steps:
                    continue
                rest = [x for x in steps if x != step]
                other = self._grow(rest, price, min(max_steps, len(steps) + 1), line=False)
                if self.sse(other) + 3 * price * len(other) < self.sse(steps) + 3 * price * len(steps) - 1e-9 * price:
                    steps, changed = other, True
            changed |= (merged := self._merged(sorted(steps), price)) != sorted(steps)
            steps = merged
            if not changed:
                break
        return sorted(self._without_bumps(steps))

    def _merged(self, steps: list[tuple[float, float]], price: float) -> list[tuple[float, float]]:
        """Neighbouring steps moving the same way replaced by the single step that fits best given
        the rest, where that lowers the priced squared residual (noise can split one step in two)."""
        i = 0
        while i + 1 < len(steps):
            heights = self.heights(steps)
            if np.sign(heights[i]) == np.sign(heights[i + 1]):
                rest = steps[:i] + steps[i + 2:]
                one = rest + [self.best_addition(rest)[0]]
                if self.sse(one) + 3 * price * len(one) < self.sse(steps) + 3 * price * len(steps):
                    steps = sorted(one)
                    continue
            i += 1
        return steps

    def _without_bumps(self, steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """Drop the smaller of any two overlapping steps the fit gives opposite directions (refitting
        can turn a step chosen one way the other way)."""
        while True:
            heights = self.heights(steps)
            pairs = [(i, j) for i in range(len(steps)) for j in range(i + 1, len(steps))
                     if np.sign(heights[i]) != np.sign(heights[j])
                     and abs(steps[i][0] - steps[j][0]) < SPAN / 2 * (steps[i][1] + steps[j][1]) + self.spacing]
            if not pairs:
                return steps
            i, j = pairs[0]
            drop = i if abs(heights[i]) < abs(heights[j]) else j
            steps = steps[:drop] + steps[drop + 1:]

    def _grow(self, steps: list[tuple[float, float]], price: float, max_steps: int,
              line: bool = True) -> list[tuple[float, float]]:
        """Add steps greedily to `steps` while one pays, then (if `line`) the line if it pays, and so on."""
        steps = list(steps)
        while len(steps) < max_steps:
            step, gain = self.best_addition(steps)
            if gain > 3 * price:
                steps.append(step)
            elif line and not self.line and self.line_gain(steps) > price:
                self.line = True
            else:
                break
        return steps


def detect_transitions(
    steps: Sequence[float], values: Sequence[float], metric: str = "", config: DetectorConfig | None = None,
    trends: bool = False, in_progress: bool = False, spikes: bool = False, scale: str | None = None,
) -> list[dict]:
    """The transitions in one series, as event dicts (phases/events.py), in step order, found on
    `scale` (LOG: log10 of the values, LINEAR: the values; None: `config.log_values`); with
    `trends=True` also the changes that cannot be told from a trend (`kind: "trend"`), with
    `in_progress=True` also the changes that pass every test but have not ended yet
    (`kind: "in_progress"`: a transition under way at the series' last point), with `spikes=True`
    also the outliers left out of the fit (`kind: "spike"`, onset = midpoint = end = its step)."""
    cfg = config or DetectorConfig()
    t, y, use_log = _prepare(steps, values, cfg.log_values if scale is None else scale)
    if len(t) < 8 or _ptp(t) == 0:
        return []
    return _remembered(("fit", t.tobytes(), y.tobytes(), use_log, _settings(cfg), trends, in_progress, spikes),
                       metric, lambda: _detect(t, y, use_log, metric, cfg, trends, in_progress, spikes))


def _settings(cfg: DetectorConfig) -> tuple:
    """`dataclasses.astuple(cfg)` of a config whose fields are numbers, strings or booleans (as
    `DetectorConfig`'s), without its deep copy; any other config as `astuple` gives it."""
    names = _FIELDS.get(type(cfg))
    if names is None:
        names = _FIELDS[type(cfg)] = tuple(f.name for f in dataclasses.fields(cfg))
    values = tuple(getattr(cfg, name) for name in names)
    return values if all(type(v) in (int, float, str, bool) for v in values) else dataclasses.astuple(cfg)


_FIELDS: dict[type, tuple[str, ...]] = {}  # each config class's field names (`_settings`)


#: how many recent results `_remembered` keeps
REMEMBERED = 64
_RECENT: dict[tuple, list[dict] | dict | None] = {}


def _remembered(key: tuple, metric: str, compute: Callable[[], list[dict] | dict | None]) -> list[dict] | dict | None:
    """`compute()`'s events (a list of event dicts, one dict, or None) for `key`, the same input
    as one of the last `REMEMBERED` calls' (points, scale, settings: e.g. two keys logging the same
    values, as the induction heads' counts can): that call's events as copies, with this `metric`."""
    found = _RECENT.pop(key, _RECENT)  # the dict itself: not there
    if found is _RECENT:
        found = compute()
        if len(_RECENT) >= REMEMBERED:  # the least recently asked for goes
            _RECENT.pop(next(iter(_RECENT)), None)
    _RECENT[key] = found
    renamed = lambda e: {**e, "metric": metric}  # noqa: E731
    return None if found is None else renamed(found) if isinstance(found, dict) else [renamed(e) for e in found]


def _detect(t: np.ndarray, y: np.ndarray, use_log: bool, metric: str, cfg: DetectorConfig, trends: bool,
            in_progress: bool, spikes: bool) -> list[dict]:
    """`detect_transitions` of prepared points (`_prepare`: 8 or more, over more than one step)."""
    spike, spike_z, spike_r = _outliers(t, y)
    found = [_spike_event(metric, use_log, t[i], y[i] - spike_r[i], y[i], spike_z[i]) for i in np.flatnonzero(spike)]
    found = found if spikes else []
    tb, yb, w = _bin(t[~spike], y[~spike], min(cfg.bins, len(t)))  # an outlier says nothing about the level
    t, y = t[~spike], y[~spike]
    if len(tb) < 8:
        return found
    span = _ptp(yb)
    if span <= FLAT * float(np.max(np.abs(yb))):  # a constant series: what binning leaves is rounding
        return found
    residual_t, residual = _point_residuals(t, y)
    noise = max(_robust_scale(residual), NOISE_FLOOR * span)
    if (scatter := _bin_noise(tb, yb, w)) > 1.5 * noise:  # correlated noise: trust the bins' scatter
        noise = scatter
    model, chosen, coef, cov, noise = _fit_steps(tb, yb, w, noise, cfg)
    judge = _Judge(t, tb, model, chosen, coef, cov, noise, residual_t, residual, cfg, use_log, metric,
                   (float(y.min()), float(y.max())))
    out = [e for group in _groups(chosen, coef[2:], cfg.steepness) for part in judge.pieces(group)
           if (e := judge.event(part)) is not None]
    if trends:
        out += judge.trend()
    out += found
    for e in out:
        if e["kind"] == "in_progress" and not in_progress:
            e["kind"] = "trend"  # offline, a change that runs into the series' end cannot be told from a trend
    wanted = ({"transition"} | ({"trend"} if trends else set()) | ({"in_progress"} if in_progress else set())
              | ({"spike"} if spikes else set()))
    return sorted((e for e in out if e["kind"] in wanted), key=lambda e: e["midpoint"])


def _spike_event(metric: str, use_log: bool, t: float, level: float, value: float, z: float) -> dict:
    """An outlier as an event of kind "spike": its step, direction and height above the points around it."""
    undo = (lambda v: 10**v) if use_log else (lambda v: v)
    step = int(round(10**t))
    return Event(metric, "up" if value > level else "down", step, midpoint=step, end=step,
                 magnitude=float(abs(undo(value) - undo(level))), kind="spike", steepest=step,
                 snr=round(abs(float(z)), 2), confidence=round(_normal_cdf(abs(float(z)) - SPIKE_Z), 4),
                 scale=LOG if use_log else LINEAR).to_dict()


def _fit_steps(tb: np.ndarray, yb: np.ndarray, w: np.ndarray, noise: float, cfg: DetectorConfig):
    """The step model of the bins: (model, steps, coefficients, covariance, noise used)."""
    model = _StepModel(tb, yb, w, cfg.max_duration)
    price = cfg.penalty / 3 * math.log(len(tb))  # per parameter
    chosen = model.choose(price * noise**2, cfg.max_steps)
    coef, cov = model.fit(chosen)
    return model, chosen, coef, cov, noise


def _bin_noise(tb: np.ndarray, yb: np.ndarray, w: np.ndarray) -> float:
    """The noise of one point implied by how the bin means scatter (each against the line through
    its neighbours, scaled by the variance independent points would give it): larger than the
    points' own estimate when noise is correlated from point to point, as in real training curves."""
    if len(tb) < 3:
        return 0.0
    gap = tb[2:] - tb[:-2]
    a = np.where(gap > 0, (tb[2:] - tb[1:-1]) / np.where(gap > 0, gap, 1.0), 0.5)
    variance = 1 / w[1:-1] + a**2 / w[:-2] + (1 - a) ** 2 / w[2:]
    return _robust_scale((yb[1:-1] - a * yb[:-2] - (1 - a) * yb[2:]) / np.sqrt(variance))


def _groups(steps: list[tuple[float, float]], heights: np.ndarray, steepness: float) -> list[list[int]]:
    """Indices of steps forming one transition: same direction, overlapping 10-90% parts, and
    either comparably steep or one centred within the other (a lopsided change: fast, then a
    slow tail around it); a much slower change beside a transition is not part of it. A group can
    still be two transitions where the series pauses (`_Judge.pieces`)."""
    groups: list[list[int]] = []
    speed = [abs(h) / (4 * wd) for h, (c, wd) in zip(heights, steps)]  # the steepest slope of each step
    for i, (c, wd) in enumerate(steps):
        if groups:
            j = groups[-1][-1]
            cj, wj = steps[j]
            fastest = max(speed[x] for x in groups[-1])
            inside = any(abs(c - steps[x][0]) <= SPAN / 2 * max(wd, steps[x][1]) for x in groups[-1])
            comparable = fastest / steepness <= speed[i] <= fastest * steepness
            if np.sign(heights[i]) == np.sign(heights[j]) and c - SPAN * wd / 2 <= cj + SPAN * wj / 2 \
                    and (inside or comparable):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


@dataclasses.dataclass
class _Judge:
    """Turns fitted steps into events."""

    t: np.ndarray
    tb: np.ndarray
    model: _StepModel
    steps: list[tuple[float, float]]
    coef: np.ndarray
    cov: np.ndarray
    noise: float
    residual_t: np.ndarray
    residual: np.ndarray
    cfg: DetectorConfig
    use_log: bool
    metric: str
    bounds: tuple[float, float]  # the lowest and highest value fitted (log10 for log values)

    def __post_init__(self):
        fitted = self.model.curve(self.steps, self.coef)
        self.range = float(np.ptp(fitted))
        self.needed = self.cfg.min_range_fraction * self.range  # the size a change needs
        if self.use_log:
            self.needed = min(self.needed, DECADE_CHANGE)
        self.total = float(self.tb[-1] - self.tb[0])

    def _test(self, change: float, variance: float, noise: float) -> tuple[bool, float, float]:
        """Whether a change passes the noise and size tests, its snr, and the confidence."""
        error = noise * math.sqrt(max(variance, 0.0))
        snr = abs(change) / error if error > 0 else math.inf
        needed = self.needed
        confidence = 1.0 if error == 0 else (
            _normal_cdf(snr - self.cfg.min_snr) * _normal_cdf((abs(change) - needed) / error))
        return snr >= self.cfg.min_snr and abs(change) >= needed, snr, confidence

    def pieces(self, group: list[int]) -> list[list[int]]:
        """A group of steps split where its change pauses: between two of its stretches the series
        itself moves its way at most 1/`LEVELLING` as fast as the change does at its steepest on
        either side (the speed at which a change has ended). The change's speed is its own fitted
        curve's from one logged point to the next (a step between two points moves no faster than
        the jump across them); the series' is the slope of a straight line fitted to at least
        `PAUSE_BINS` consecutive bins (the data, not the fit: a wide step can stand across a
        plateau), and `min_snr` standard errors of it below the bar (noise makes no pause). The
        steps centred before the pause are one transition, those after it another, when each
        passes `event`'s tests on its own (the clearest pause first: the lowest slope against the
        bar); each piece is split again the same way. A steady or lopsided change (fast, then a
        slowing tail) never pauses: nothing after its slow part is faster."""
        if len(group) < 2:
            return [group]
        lo = min(self.steps[i][0] - SPAN * self.steps[i][1] for i in group)
        hi = max(self.steps[i][0] + SPAN * self.steps[i][1] for i in group)
        inside = (self.tb >= lo) & (self.tb <= hi)
        tb, yb, wb = self.tb[inside], self.model.yb[inside], self.model.root_w[inside] ** 2
        t = np.unique(self.t[(self.t >= lo) & (self.t <= hi)])
        if len(tb) < PAUSE_BINS + 2 or len(t) < 3:
            return [group]
        way = np.sign(self.coef[2 + group[0]])
        own = self.model.curve([self.steps[i] for i in group], np.concatenate([[0.0, 0.0], self.coef[2 + np.array(group)]]),
                               t)
        speed = way * np.diff(own) / np.diff(t)  # the change's own, from point to point (at t[:-1] .. t[1:])
        before, after = np.maximum.accumulate(speed), np.maximum.accumulate(speed[::-1])[::-1]
        # every window of at least PAUSE_BINS consecutive bins: its weighted straight line (sums by cumsum)
        first, stop = np.triu_indices(len(tb) + 1, PAUSE_BINS)
        first, last = first[stop <= len(tb)], stop[stop <= len(tb)] - 1
        x = tb - tb.mean()
        sums = [np.concatenate([[0.0], np.cumsum(v)]) for v in (wb, wb * x, wb * x * x, wb * yb, wb * x * yb)]
        n, sx, sxx, sy, sxy = (c[last + 1] - c[first] for c in sums)
        spread = sxx - sx**2 / n
        slope = way * (sxy - sx * sy / n) / spread
        # the change's speed before the window and after it: gaps ending at its first bin, from its last
        before_at = np.searchsorted(t, tb[first]) - 1
        after_at = np.searchsorted(t, tb[last], side="right") - 1
        ok = (before_at >= 0) & (after_at < len(speed))
        bar = np.where(ok, np.minimum(before[np.clip(before_at, 0, None)],
                                      after[np.clip(after_at, None, len(speed) - 1)]), 0.0) / LEVELLING
        pause = (bar > 0) & (slope + self.cfg.min_snr * self.noise / np.sqrt(spread) <= bar)
        centre = tb.mean() + (sx / n)
        found = sorted(zip(slope[pause] / bar[pause], centre[pause]))
        tried = set()
        for _, at in found:
            cut = sum(self.steps[i][0] < at for i in group)  # steps are in centre order
            if cut in tried or not 0 < cut < len(group):
                continue
            tried.add(cut)
            if self.event(group[:cut]) is not None and self.event(group[cut:]) is not None:
                return self.pieces(group[:cut]) + self.pieces(group[cut:])
        return [group]

    def event(self, group: list[int]) -> dict | None:
        heights = self.coef[2 + np.array(group)]
        change = float(heights.sum())
        index = 2 + np.array(group)
        variance = float(self.cov[np.ix_(index, index)].sum())
        # the points around the transition: where they scatter more than the series, trust them less
        lo = min(self.steps[i][0] - SPAN * self.steps[i][1] for i in group)
        hi = max(self.steps[i][0] + SPAN * self.steps[i][1] for i in group)
        near = self.residual[(self.residual_t >= lo) & (self.residual_t <= hi)]
        noise = max(self.noise, _robust_scale(near)) if len(near) >= 5 else self.noise
        ok, snr, confidence = self._test(change, variance, noise)
        if not ok:
            return None
        grid = np.linspace(lo, hi, 1024)
        curve = sum(h * _logistic(grid, *self.steps[i]) for h, i in zip(heights, group))
        progress = np.maximum.accumulate((curve - curve[0]) / (curve[-1] - curve[0]))
        onset, midpoint, end = (float(grid[min(int(np.searchsorted(progress, f)), len(grid) - 1)])
                                for f in (0.1, 0.5, 0.9))
        # the series itself moves that way over the change, by enough (not a step offsetting the line or
        # another step where the series is flat): the whole fitted curve over its 10-90% part, per 80%
        whole = self.model.curve(self.steps, self.coef, np.array([onset, end]))
        seen = float(whole[1] - whole[0]) / 0.8 * np.sign(change)
        if seen < SUPPORT * abs(change) or seen < self.needed:
            return None
        slope = np.abs(np.gradient(curve, grid))
        steepest = float(grid[int(np.argmax(slope))])
        # ended: its 90% point is inside the series, or the series already shows it levelling off
        at_last = float(np.interp(self.t[-1], grid, slope)) if self.t[-1] < hi else 0.0
        seen_after = self.t[-1] - midpoint >= (end - onset) / 3 and int((self.t > midpoint).sum()) >= 5
        ended = end - onset > 0 and (end + (end - onset) / 10 <= self.t[-1]
                                     or (seen_after and at_last <= slope.max() / LEVELLING))
        # a change before the series begins is not seen; one with a single point after it is not yet
        # told from an outlier at the series' end (the last point is not judged as a spike)
        seen_before = int((self.t < midpoint).sum()) >= 2
        ended = ended and int((self.t > midpoint).sum()) >= 2
        if seen_before and end - onset <= self.cfg.max_duration * self.total:
            kind = "transition" if ended else "in_progress"
        else:
            kind = "trend"
        # the level it leaves: the rest of the model where it happens (matters only for log values)
        rest = [i for i in range(len(self.steps)) if i not in group]
        base = float(self.model.curve([self.steps[i] for i in rest],
                                      np.concatenate([self.coef[:2], self.coef[2 + np.array(rest, dtype=int)]]),
                                      np.array([midpoint]))[0])
        return self._event(kind, change, base, base + change, (onset, midpoint, end), steepest, snr, confidence)

    def trend(self) -> list[dict]:
        """The straight line's own change over the run, as a trend, when it passes the tests."""
        if not self.model.line:  # no line in the model: no trend (its change of 0 has no error either)
            return []
        change = float(self.coef[1] * self.total)
        ok, snr, confidence = self._test(change, float(self.cov[1, 1]) * self.total**2, self.noise)
        if not ok:
            return []
        t0, t1 = float(self.tb[0]), float(self.tb[-1])
        times = (t0 + 0.1 * self.total, t0 + 0.5 * self.total, t0 + 0.9 * self.total)
        start = float(self.coef[0] + self.coef[1] * (t0 - self.model.t_mean))
        return [self._event("trend", change, start, start + change, times, (t0 + t1) / 2, snr, confidence)]

    def _event(self, kind: str, change: float, before: float, after: float, times: tuple[float, float, float],
               steepest: float, snr: float, confidence: float) -> dict:
        # a fitted level can lie far outside the data (a change under way, extrapolated; a line offset by
        # steps): the levels are held to the values fitted, so a size is one the data can have
        low, high = self.bounds
        before, after = min(max(before, low), high), min(max(after, low), high)
        undo = (lambda v: 10**v) if self.use_log else (lambda v: v)
        onset, midpoint, end = (int(round(10**x)) for x in times)
        return Event(self.metric, "up" if change > 0 else "down", onset, midpoint=midpoint, end=end,
                     magnitude=float(abs(undo(after) - undo(before))), kind=kind,
                     steepest=int(round(10**steepest)), snr=round(float(snr), 2),
                     confidence=round(float(confidence), 4), scale=LOG if self.use_log else LINEAR).to_dict()


#: the windows of the departure test, in decades of steps back from the newest point
DEPARTURE_WINDOWS = (0.15, 0.3, 0.6, 1.0)
#: the departure test tries the newest 1 ... this many points as the part that left the trend
DEPARTURE_NEWEST = 4
#: ... fitting the trend to at least this many points before them
DEPARTURE_BASELINE = 4
#: a departure is this many standard errors from the trend's extrapolation (the test is made at
#: every look, on up to 4 windows x 4 splits; bench/live_latency.py counts the departures that
#: no transition follows)
DEPARTURE_Z = 5.0


def departure(steps: Sequence[float], values: Sequence[float], metric: str = "", log_values: bool = False,
              bar: float = DEPARTURE_Z) -> dict | None:
    """Whether the newest points of a series have left its recent trend: the early sign of a
    transition under way, before the detector can fit it (it needs most of a step).

    In log-step time, for each window of `DEPARTURE_WINDOWS` decades back from the newest
    point and each split of it into the newest k points (k <= `DEPARTURE_NEWEST`) and the
    ones before (at least `DEPARTURE_BASELINE`): a straight line (the trend) is fitted to the
    ones before by least squares and extrapolated; the newest points' summed residual against
    it, over its standard error (the points' noise plus the line's uncertainty at their
    t: sigma^2 (k + k^2 (1/m + (t_new - t_mean)^2 / Sxx))), is z. The noise sigma is the largest
    of the robust scale of the point residuals (each against the line through its neighbours,
    as in `detect_transitions`) in the window and over the whole series, and the scatter of the
    points before about their line (a robust scale from a few points can come out far too small
    by chance; and where they are no line, e.g. a window over the end of an earlier drop, the
    trend is no guide and z shrinks). A departure needs |z| >= `bar` (`DEPARTURE_Z` by default),
    at least 3/4 of the newest points on its side of the trend, the newest one as far out as
    the first, and the newest points' mean beyond the mean of as many points before them (at
    least 2) by 2 standard errors in that direction: the series moves that way (the end of a
    drop is also a departure from its steep line, upwards; the series slowing down is not a new
    change). The strongest split wins.

    Returns None or {metric, direction, onset (the first of the newest points that left the
    trend), snr (|z|), confidence (Gaussian probability that z passes the test again: 0.5
    at the threshold)}.
    """
    t, y, _ = _prepare(steps, values, log_values)
    n = len(t)
    if n < DEPARTURE_BASELINE + 1 or _ptp(y) <= FLAT * float(_MAX(np.abs(y))):
        return None
    return _remembered(("departure", t.tobytes(), y.tobytes(), bar), metric, lambda: _departure(t, y, metric, bar))


def _departure(t: np.ndarray, y: np.ndarray, metric: str, bar: float) -> dict | None:
    """`departure` of prepared points (`_prepare`: more than `DEPARTURE_BASELINE`, not constant)."""
    n = len(t)
    residuals = _point_residuals(t, y)[1]  # residuals[i] is point i + 1's: a window's are a slice of them
    noise = max(_robust_scale(residuals), NOISE_FLOOR * _ptp(y))
    best, starts = None, set()
    for window in DEPARTURE_WINDOWS:
        start = int(np.searchsorted(t, t[-1] - window))
        if start in starts:  # a wider window with the same points (a short series): the same tests again
            continue
        starts.add(start)
        for k in range(1, DEPARTURE_NEWEST + 1):
            if n - k - start < DEPARTURE_BASELINE:
                break
            z = _split_z(t, y, residuals, noise, start, k, bar)
            if z is not None and (best is None or abs(z) > best["snr"]):
                best = {"metric": metric, "direction": "up" if z > 0 else "down",
                        "onset": int(round(10 ** t[n - k])), "snr": abs(z),
                        "confidence": _normal_cdf(abs(z) - bar)}
    return best


def _split_z(t: np.ndarray, y: np.ndarray, residuals: np.ndarray, noise: float, start: int, k: int,
             bar: float) -> float | None:
    """`departure`'s test of one split: z of the newest `k` points against the trend of the
    points from `start` before them, or None where the split is no departure."""
    n = len(t)
    m = n - k - start
    tb, yb, tn, yn = t[start:n - k], y[start:n - k], t[n - k:], y[n - k:]
    t_mean, y_mean = float(_ADD(tb) / m), float(_ADD(yb) / m)  # = mean(), cheaper
    sxx = float(_ADD((tb - t_mean) ** 2))
    if sxx <= 0:
        return None
    slope = float(_ADD((tb - t_mean) * (yb - y_mean))) / sxx
    misfit = float(np.sqrt(_ADD((yb - y_mean - slope * (tb - t_mean)) ** 2) / (m - 2))) if m > 2 else 0.0
    r = yn - (y_mean + slope * (tn - t_mean))
    se = math.sqrt(k + k**2 * (1 / m + (float(_ADD(tn) / k) - t_mean) ** 2 / sxx))
    total = float(_ADD(r))
    # sigma is at least max(noise, misfit): a split that misses the bar with that misses it with sigma
    # (|z| only shrinks as sigma grows, rounding included), so the residuals' median is not needed
    if (low := max(noise, misfit)) > 0 and abs(total / (low * se)) < bar:
        return None
    sigma = max(noise, misfit, _robust_scale(residuals[start:n - k - 1]))
    z = total / (sigma * se)
    sign = 1.0 if z > 0 else -1.0
    if abs(z) < bar or np.count_nonzero(np.sign(r) == sign) / k < 0.75 or abs(r[-1]) < abs(r[0]):
        return None
    before = yb[-max(k, 2):]
    moved = sign * (float(_ADD(yn) / k) - float(_ADD(before) / len(before))) / (sigma * math.sqrt(1 / k + 1 / len(before)))
    return None if moved < 2 else z


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def detect_all(series: dict[str, tuple[Sequence[float], Sequence[float]]], config: DetectorConfig | None = None,
               trends: bool = False, declared: Callable[[str], str | None] | None = None) -> list[dict]:
    """Transitions (with `trends=True` also trends) of every series, ordered by midpoint. With
    `declared` (a key's declared scale: probes.keys.declared_scale), each series on its watch
    scale (`watch_scale`), as the live watcher does; without it, on `config.log_values`."""
    events = [e for name, (s, v) in series.items()
              for e in detect_transitions(s, v, name, config, trends,
                                          scale=watch_scale(v, declared(name)) if declared else None)]
    return sorted(events, key=lambda e: (e["midpoint"], e["metric"]))


#: two changes happen together (in one phase of the run) when their spans, each widened by this
#: factor in steps, overlap (the live watcher also takes two fits of one change for the same change so)
TOGETHER = 1.5


def together(a: dict, b: dict) -> bool:
    """The spans of two events (onset to end; an onset alone has only its step) overlap once each
    is widened by the factor `TOGETHER` on either side."""
    return (a["onset"] / TOGETHER <= b.get("end", b["onset"]) * TOGETHER
            and b["onset"] / TOGETHER <= a.get("end", a["onset"]) * TOGETHER)


def scale_change(event: dict, steps: Sequence[float], values: Sequence[float]) -> float:
    """How far a series moved over one of its events, on the event's own scale: for an event
    found on the log scale, the change in log10 between the logged values nearest its onset and
    its end (decades); otherwise its `magnitude` in the series' units. 0 without values."""
    if event.get("scale") != LOG:
        return abs(float(event.get("magnitude") or 0.0))
    s, v = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    keep = np.isfinite(v) & (v > 0)
    s, v = s[keep], np.log10(v[keep])
    if not len(v):
        return 0.0
    return abs(float(v[np.argmin(np.abs(s - event["end"]))] - v[np.argmin(np.abs(s - event["onset"]))]))


def principal(events: list[dict], reference: str, steps: Sequence[float], values: Sequence[float]) -> dict | None:
    """The reference's principal transition: of its transitions, the largest change on its own
    scale (`scale_change` over its `steps` and `values`; the earliest of equals); None without one.
    For a test loss that groks, its fall by decades, not its rise during memorisation."""
    mine = [e for e in events if e["metric"] == reference and e.get("kind", "transition") == "transition"]
    return max(mine, key=lambda e: (scale_change(e, steps, values), -e["midpoint"]), default=None)


def lead_lag(events: list[dict], reference: str, series: tuple[Sequence[float], Sequence[float]] | None = None,
             ) -> list[dict]:
    """For each transition of the `reference` metric, the transition of every other metric in the
    same phase of the run (`together` with it; of several, the first: earliest onset, as a stage's
    lead is the series that moved first), with how many steps it led: positive `lead` = its
    midpoint came earlier, `onset_lead` likewise for onsets. A metric with no transition in that
    phase has no row (a change in another phase is not compared: docs/phases.md, "Lead/lag").
    With `series` (the reference's steps and values), only the rows against its `principal`
    transition: one row per metric, the report's. The grokking story reads: the restricted loss
    falls and the excluded loss rises before the test loss collapses."""
    events = [e for e in events if e.get("kind", "transition") == "transition"]
    refs = [e for e in events if e["metric"] == reference]
    if series is not None:
        refs = [e for e in [principal(events, reference, *series)] if e is not None]
    out = []
    for ref in refs:
        nearest: dict[str, dict] = {}
        for other in events:
            if other["metric"] == reference or not together(ref, other):
                continue
            best = nearest.get(other["metric"])
            if best is None or (other["onset"], other["midpoint"]) < (best["onset"], best["midpoint"]):
                nearest[other["metric"]] = other
        for other in nearest.values():
            out.append({"reference": reference, "reference_direction": ref["direction"],
                        "reference_midpoint": ref["midpoint"], "metric": other["metric"],
                        "direction": other["direction"], "midpoint": other["midpoint"],
                        "lead": ref["midpoint"] - other["midpoint"], "onset_lead": ref["onset"] - other["onset"]})
    return sorted(out, key=lambda r: (r["reference_midpoint"], -r["lead"]))

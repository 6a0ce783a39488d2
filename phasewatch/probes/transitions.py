"""Phase-transition detection in any logged series (pure functions of steps and values).

Method, in log-step time (as docs/reference.md recommends; transitions in small models are
spread over orders of magnitude of steps):

1. t = log10(step) for steps >= 1. Values stay linear by default, so a loss's transition
   is where most of its value goes (`log_values=True` works in log10 of the value, which
   also finds the later drops of a loss by orders of magnitude).
2. The points are averaged into bins of equal width in t (so dense late logging does not
   outweigh sparse early logging) and the noise is estimated robustly (median absolute
   first difference).
3. Optimal partitioning into straight-line segments with a penalty per segment (dynamic
   programming; the penalty scales with the noise and log n), which found the 10-90%
   rise of synthetic grokking curves within a few checkpoints in docs/reference.md's test.
4. A transition grows from the steepest segment over neighbours that move the same way
   and are comparably steep (at least 1/`steepness` of its slope); it counts when its
   total change is large against both the noise and the series' own range and it takes
   up at most half of the run's log-time. A jump of the same size between two segments
   (a change between two logged points) is a transition too. Flat curves and slow
   drifts (one long, gentle segment) give no event.

Each transition is reported as the event of DESIGN.md: metric, direction ("down"/"up"),
onset, midpoint (where the curve crosses half of the change), end, magnitude (the change
in the series' own units), all in training steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class DetectorConfig:
    """Tuning of `detect_transitions`; the defaults pass the synthetic tests in
    tests/unit/test_transitions.py (sigmoids found, flat noise and drift left alone).

    Attributes:
        bins: number of equal-width bins in log-step time.
        penalty: cost of one more segment, in units of noise variance x log(bins).
        min_noise_multiple: a transition moves by at least this many noise levels.
        min_range_fraction: ... and by at least this fraction of the series' range.
        steepness: ... and is this many times steeper than the segments beside it.
        max_duration: ... and lasts at most this fraction of the run's log-time.
        log_values: False (default), True (log10 of the values), or "auto" (log10 for
            positive series spanning two or more decades).
    """

    bins: int = 200
    penalty: float = 12.0
    min_noise_multiple: float = 8.0
    min_range_fraction: float = 0.3
    steepness: float = 2.5
    max_duration: float = 0.5
    log_values: str | bool = False


def _prepare(steps: Sequence[float], values: Sequence[float], log_values) -> tuple[np.ndarray, np.ndarray, bool]:
    s = np.asarray(steps, dtype=float)
    v = np.asarray(values, dtype=float)
    keep = np.isfinite(v) & np.isfinite(s) & (s >= 1)
    s, v = s[keep], v[keep]
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    use_log = log_values is True or (
        log_values == "auto" and len(v) > 0 and np.all(v > 0) and np.max(v) / np.min(v) >= 100)
    return np.log10(s), (np.log10(v) if use_log else v), use_log


def _bin(t: np.ndarray, y: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    edges = np.linspace(t[0], t[-1] + 1e-12, n_bins + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n_bins - 1)
    counts = np.bincount(idx, minlength=n_bins)
    ok = counts > 0
    tb = np.bincount(idx, weights=t, minlength=n_bins)[ok] / counts[ok]
    yb = np.bincount(idx, weights=y, minlength=n_bins)[ok] / counts[ok]
    return tb, yb, counts[ok]


def _segments(t: np.ndarray, y: np.ndarray, penalty: float, min_len: int = 3) -> list[tuple[int, int]]:
    """Optimal partition of the points into [i, j) segments with a straight-line fit each."""
    n = len(t)
    c = [np.concatenate([[0.0], np.cumsum(a)]) for a in (np.ones(n), t, y, t * t, t * y, y * y)]

    def sse(i: int, j: int) -> float:
        k, st, sy, stt, sty, syy = (a[j] - a[i] for a in c)
        var_t = stt - st * st / k
        cov = sty - st * sy / k
        res = syy - sy * sy / k - (cov * cov / var_t if var_t > 1e-18 else 0.0)
        return max(res, 0.0)

    best = np.full(n + 1, np.inf)
    best[0] = -penalty
    prev = np.zeros(n + 1, dtype=int)
    for j in range(min_len, n + 1):
        for i in range(0, j - min_len + 1):
            if not np.isfinite(best[i]):
                continue
            cost = best[i] + sse(i, j) + penalty
            if cost < best[j]:
                best[j], prev[j] = cost, i
    cuts, j = [], n
    while j > 0:
        cuts.append((prev[j], j))
        j = prev[j]
    return cuts[::-1]


def _line(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if len(t) < 2 or np.ptp(t) == 0:
        return 0.0, float(np.mean(y))
    slope, intercept = np.polyfit(t, y, 1)
    return float(slope), float(intercept)


#: a series whose binned values spread less than this fraction of their size is constant: averaging
#: equal values in bins leaves differences in the last digits (~1e-16 relative), which are no change
FLAT = 1e-9


def detect_transitions(
    steps: Sequence[float], values: Sequence[float], metric: str = "", config: DetectorConfig | None = None
) -> list[dict]:
    """The transitions in one series, as event dicts (DESIGN.md), in step order."""
    cfg = config or DetectorConfig()
    t, y, use_log = _prepare(steps, values, cfg.log_values)
    if len(t) < 8 or np.ptp(t) == 0:
        return []
    tb, yb, counts = _bin(t, y, min(cfg.bins, len(t)))
    if len(tb) < 8:
        return []
    # noise of one binned point: robust first-difference scale of the raw points, shrunk by averaging
    raw_noise = np.median(np.abs(np.diff(y))) / (0.6745 * math.sqrt(2)) if len(y) > 2 else 0.0
    noise = raw_noise / math.sqrt(max(np.median(counts), 1.0))
    span = float(np.percentile(yb, 98) - np.percentile(yb, 2))
    if span <= FLAT * float(np.max(np.abs(yb))):  # a constant series: what binning leaves is rounding
        return []
    floor = max(noise, 1e-3 * span)
    segs = _segments(tb, yb, cfg.penalty * floor**2 * math.log(len(tb)))
    fits = []
    for i, j in segs:
        slope, intercept = _line(tb[i:j], yb[i:j])
        t0, t1 = tb[i], tb[j - 1]
        fits.append({"i": i, "j": j, "t0": t0, "t1": t1, "slope": slope,
                     "delta": slope * (t1 - t0), "y0": slope * t0 + intercept, "y1": slope * t1 + intercept})
    threshold = max(cfg.min_noise_multiple * noise, cfg.min_range_fraction * span)
    total = tb[-1] - tb[0]
    def local_noise(first: int, last: int) -> float:
        """The noise bar for a change measured on segments first..last: the fitted ends of
        a line through n raw points vary by about 2 sigma / sqrt(n)."""
        n = min(int(counts[fits[x]["i"]:fits[x]["j"]].sum()) for x in range(first, last + 1))
        return cfg.min_noise_multiple * 2 * raw_noise / math.sqrt(max(n, 1))

    # a segment moves when its change stands out of the noise
    moving = max(3 * noise, 0.05 * span)
    direction = [np.sign(f["delta"]) if abs(f["delta"]) >= moving else 0.0 for f in fits]
    used = [False] * len(fits)
    events = []
    for peak in sorted(range(len(fits)), key=lambda x: -abs(fits[x]["slope"])):
        if used[peak] or direction[peak] == 0:
            continue
        # grow around the steepest segment over neighbours moving the same way and
        # comparably steep; what lies beyond must be flatter (or move the other way)
        limit = abs(fits[peak]["slope"]) / cfg.steepness
        k = m = peak
        while k - 1 >= 0 and not used[k - 1] and direction[k - 1] == direction[peak] and abs(fits[k - 1]["slope"]) >= limit:
            k -= 1
        while m + 1 < len(fits) and not used[m + 1] and direction[m + 1] == direction[peak] and abs(fits[m + 1]["slope"]) >= limit:
            m += 1
        run = fits[k:m + 1]
        change = run[-1]["y1"] - run[0]["y0"]
        duration = run[-1]["t1"] - run[0]["t0"]
        has_context = k > 0 or m < len(fits) - 1
        if abs(change) >= max(threshold, local_noise(k, m)) and 0 < duration <= cfg.max_duration * total \
                and has_context:
            events.append((k, m))
            for x in range(k, m + 1):
                used[x] = True
    # one transition seen as two adjacent runs moving the same way is one transition
    merged: list[tuple[int, int]] = []
    for k, m in sorted(events):
        if merged and merged[-1][1] + 1 == k and direction[k] == direction[merged[-1][0]]:
            merged[-1] = (merged[-1][0], m)
        else:
            merged.append((k, m))
    out = []
    # a jump between two segments (the change happened between two logged points)
    for a in range(len(fits) - 1):
        jump = fits[a + 1]["y0"] - fits[a]["y1"]
        if not used[a] and not used[a + 1] and abs(jump) >= max(threshold, local_noise(a, a + 1)):
            before, after = float(np.mean(yb[fits[a]["i"]:fits[a]["j"]])), float(np.mean(yb[fits[a + 1]["i"]:fits[a + 1]["j"]]))
            if direction[a] != 0:
                before = fits[a]["y1"]
            if direction[a + 1] != 0:
                after = fits[a + 1]["y0"]
            undo = (lambda v: 10**v) if use_log else (lambda v: v)
            t_on, t_end = fits[a]["t1"], fits[a + 1]["t0"]
            out.append({"metric": metric, "direction": "up" if jump > 0 else "down", "onset": int(round(10**t_on)),
                        "midpoint": int(round(10 ** ((t_on + t_end) / 2))), "end": int(round(10**t_end)),
                        "magnitude": float(abs(undo(after) - undo(before)))})
    for k, m in merged:
        event = _event(metric, fits, direction, k, m, tb, yb, use_log)
        # the 10-90% change must be quick in log-step time: a slow drift spreads over the run
        if 0 < math.log10(event["end"] / event["onset"]) <= cfg.max_duration * total:
            out.append(event)
    return sorted(out, key=lambda e: e["midpoint"])


def _event(metric: str, fits: list[dict], direction: list[float], k: int, m: int, tb: np.ndarray, yb: np.ndarray,
           use_log: bool) -> dict:
    """The event of segments k..m: levels from the segments around them (where there
    are), onset / midpoint / end where the binned curve passes 10% / 50% / 90% of the way
    from the level before to the level after."""
    sign = direction[k]

    def level(index: int, side: str) -> tuple[float, bool]:
        """The level a neighbour gives, and whether the curve over it counts: a flat one's
        mean; one sloping the same way, its values at its far end (the plateau the
        transition leaves or reaches); one sloping the other way (a peak or a trough),
        its values next to the transition, and it does not count."""
        seg = fits[index]
        values = yb[seg["i"]:seg["j"]]
        if direction[index] == 0:
            return float(np.mean(values)), True
        same = direction[index] == sign
        first, last = float(np.mean(values[:3])), float(np.mean(values[-3:]))
        if side == "before":
            return (first if same else last), same
        return (last if same else first), same

    before, with_before = level(k - 1, "before") if k > 0 else (fits[k]["y0"], False)
    after, with_after = level(m + 1, "after") if m + 1 < len(fits) else (fits[m]["y1"], False)
    change = after - before
    lo = fits[k - 1]["i"] if with_before else fits[k]["i"]
    hi = fits[m + 1]["j"] if with_after else fits[m]["j"]
    progress = (yb[lo:hi] - before) / change if change else np.zeros(hi - lo)

    def first_past(frac: float, start: int = 0) -> float:
        """Where the curve first reaches `frac` of the change, interpolated between bins."""
        idx = np.nonzero(progress[start:] >= frac)[0]
        if not len(idx):
            return float(tb[hi - 1])
        i = start + idx[0]
        if i == 0 or progress[i] == progress[i - 1]:
            return float(tb[lo + i])
        w = (frac - progress[i - 1]) / (progress[i] - progress[i - 1])
        return float(tb[lo + i - 1] + min(max(w, 0.0), 1.0) * (tb[lo + i] - tb[lo + i - 1]))

    t_on = first_past(0.1)
    t_mid = first_past(0.5, int(np.searchsorted(tb[lo:hi], t_on)))
    t_end = first_past(0.9, int(np.searchsorted(tb[lo:hi], t_mid)))
    undo = (lambda v: 10**v) if use_log else (lambda v: v)
    return {
        "metric": metric,
        "direction": "up" if change > 0 else "down",
        "onset": int(round(10**t_on)),
        "midpoint": int(round(10**t_mid)),
        "end": int(round(10**t_end)),
        "magnitude": float(abs(undo(after) - undo(before))),
    }


def detect_all(series: dict[str, tuple[Sequence[float], Sequence[float]]], config: DetectorConfig | None = None) -> list[dict]:
    """Transitions of every series, ordered by midpoint."""
    events = [e for name, (s, v) in series.items() for e in detect_transitions(s, v, name, config)]
    return sorted(events, key=lambda e: (e["midpoint"], e["metric"]))


def lead_lag(events: list[dict], reference: str) -> list[dict]:
    """For each transition of the `reference` metric, the nearest transition (by
    midpoint) of every other metric, with how many steps it led: positive `lead` =
    its midpoint came earlier, `onset_lead` likewise for onsets. The grokking story
    reads: the restricted loss falls and the excluded loss rises before the test loss
    collapses."""
    out = []
    for ref in (e for e in events if e["metric"] == reference):
        nearest: dict[str, dict] = {}
        for other in events:
            if other["metric"] == reference:
                continue
            best = nearest.get(other["metric"])
            if best is None or abs(other["midpoint"] - ref["midpoint"]) < abs(best["midpoint"] - ref["midpoint"]):
                nearest[other["metric"]] = other
        for other in nearest.values():
            out.append({"reference": reference, "reference_direction": ref["direction"],
                        "reference_midpoint": ref["midpoint"], "metric": other["metric"],
                        "direction": other["direction"], "midpoint": other["midpoint"],
                        "lead": ref["midpoint"] - other["midpoint"], "onset_lead": ref["onset"] - other["onset"]})
    return sorted(out, key=lambda r: (r["reference_midpoint"], -r["lead"]))

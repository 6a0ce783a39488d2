"""The scale a series is watched on: log10 of its values, or the values themselves.

`watch_scale(values, declared)` is the one choice the live watcher, `phasewatch phases`,
`analyze` and the report make: a declared scale (what the key means: probes/keys.py
`declared_scale`, "log" for losses) is used, except that a series with a value <= 0 cannot
be watched in log10 and is watched as it is; an undeclared series is watched in log10 when
every value is > 0 and they span `DECADES` decades or more (max / min >= 100), else as it is.
Every event records the scale it was found on (`scale`). Why: docs/phases.md, "Scale".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

LOG, LINEAR = "log", "linear"
#: an undeclared positive series spanning this many decades or more is watched in log10
DECADES = 2.0


def watch_scale(values: Sequence[float], declared: str | None = None) -> str:
    """LOG or LINEAR for a series with these values (non-finite ones ignored) and this declared
    scale (LOG, LINEAR or None for a key that declares none)."""
    if declared not in (LOG, LINEAR, None):
        raise ValueError(f"declared scale {declared!r} is not {LOG!r}, {LINEAR!r} or None")
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    positive = len(v) > 0 and bool(np.all(v > 0))
    if declared is not None:
        return LOG if declared == LOG and positive else LINEAR
    return LOG if positive and np.max(v) / np.min(v) >= 10**DECADES else LINEAR

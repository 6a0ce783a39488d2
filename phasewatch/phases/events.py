"""The event: one line of a run folder's events (a phase transition, a change under way, its end).

`Event` names every field (its docstring is the schema); `to_dict` gives the line's JSON object
(unset fields left out) and `from_dict` reads one back (fields it does not know kept in `extra`),
so events.jsonl keeps its format. The detector (phases/detector.py) makes events with the
fields up to `scale`; the live watcher (callbacks/transitions.py) adds `stage`, `reason` and
`detected_at`. Readers elsewhere may index the dicts by these names. What each field means for
the detector: docs/phases.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Direction = Literal["up", "down"]


@dataclasses.dataclass
class Event:
    """Attributes (None: not set, left out of the line):
        metric: the series' key, e.g. "val/loss".
        direction: "up" or "down".
        onset: the step where the change began (its fitted curve's 10% point; for an onset
            from the departure test, the first point that left the trend).
        midpoint, end: its 50% and 90% points (transitions, trends, spikes; not onsets).
        magnitude: the change in the series' own units (|after - before|).
        kind: "transition", "in_progress" (not yet ended at the series' last point), "trend"
            (cannot be told from a steady change) or "spike" (one outlying point).
        steepest: the step where it changes fastest.
        snr: the change in standard errors; confidence: the probability it passes the tests again.
        scale: "log" (found in log10 of the values) or "linear" (phases/scale.py).
        stage: live only: "onset" (under way), "confirmed" or "withdrawn".
        reason: a withdrawn onset's: "not found again" or "training ended".
        detected_at: live only: the step at which the watcher reported it (absent offline).
        extra: fields of a line that this type does not name (kept, written back as they were).
    """

    metric: str
    direction: Direction
    onset: int
    midpoint: int | None = None
    end: int | None = None
    magnitude: float | None = None
    kind: str | None = None
    steepest: int | None = None
    snr: float | None = None
    confidence: float | None = None
    scale: str | None = None
    stage: str | None = None
    reason: str | None = None
    detected_at: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The event's line: its set fields in the order above, then `extra`'s."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {k: v for k, v in out.items() if v is not None} | self.extra

    @classmethod
    def from_dict(cls, line: dict[str, Any]) -> Event:
        """An event from its line; KeyError when `metric`, `direction` or `onset` is missing."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in line.items() if k in names}
        for required in ("metric", "direction", "onset"):
            if required not in known:
                raise KeyError(f"an event needs {required!r}; this one has {sorted(line)}")
        return cls(**known, extra={k: v for k, v in line.items() if k not in names})

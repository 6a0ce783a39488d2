"""Stages: the intervals of training in which several series change together (numpy only).

`detect_stages(events, series, rules)` takes the per-series transitions (dicts as in
events.jsonl or `detect_all`'s output, or objects with `to_dict`; trends, spikes, onsets and
withdrawn events are left out) and each series' (steps, values). Changes (a series' adjacent
pieces in one direction joined) whose midpoints are one time up to their own widths in log-step
time (a chi-squared test at `LEVEL`) form a group; a group is a stage when it holds series of
two families or a headline series (`StageRules`), and the lone changes of other groups are
taken out. Stages are named over the whole sequence by the declared `Signature`s they match
(`assign_names`: each name once, a sequence's in order; None otherwise, never forced); an
unnamed stage overlapping a named neighbour whose signature it matches joins it (`_one_phase`).
Where an LLC series exists a stage has a type ("A": loss falls, LLC rises; "B": loss flat, LLC
falls; Hoogland et al. 2024). `previous` carries ids between calls, `keep` holds stages already
said. A run folder's stages: `run_stages`, `record_stages`/`write_stages`, `read_stages`.
Method and measurements: docs/stages.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Iterable, Sequence

import numpy as np

from phasewatch.phases.detector import detect_all
from phasewatch.phases.scale import LOG, watch_scale
from phasewatch.rundir import read_jsonl

#: transitions are one stage while their midpoints are one time up to their own widths at this
#: level: the chi-squared of the midpoints about their mean (each in units of its change's
#: logistic width in log-step time) within this quantile (docs/stages.md)
LEVEL = 0.95
#: the smallest timing scale of a transition, in decades of steps (a jump between two logged
#: steps can have onset = end)
MIN_WIDTH = 0.05
#: a series "moves" over a stage (for its type) when it changes by this fraction of its range
MOVE = 0.1
#: the series the type of a stage is read from: the LLC estimate, and the first loss present
LLC_KEY = "llc/estimate"
LOSS_KEYS = ("train/loss", "val/loss")
_LN9 = math.log(9.0)


@dataclasses.dataclass(frozen=True)
class Signature:
    """A stage a probe knows, declared with its keys (probes/keys.py `KeyFamilies.stages`).

    Each entry of `moves` and `absent` is "PATTERN up|down", or several such joined by " | "
    (any of them; a pattern holds no spaces); PATTERN is a regular expression matched in full against a series' key. A
    stage matches when every entry of `moves` is among its members and no entry of `absent` is;
    `run_has` (a regular expression) limits the signature to runs logging a matching key. Each
    `outpaces` pair (PATTERN, KEY): a member whose key matches PATTERN counts only where it
    changes more in log10 than KEY over the member's own steps; each `steady` pair (PATTERN,
    KEY): only where most of its change came while KEY, what it is measured against, held one
    value, and then by that part alone (`counts`). Each `during` entry (as `moves`) names
    moves that count for `moves` also where the series changes so over the stage's span by
    `MOVE` of its range, a member or not (`spanned`). Each `reaches` entry, "KEY >= LEVEL" or
    "KEY <= LEVEL" (KEY a regular expression matched in full), is a level the run is at when the
    stage ends: every logged series matching KEY, read at the stage's end (`reached`), must be at
    or past LEVEL (a phase defined by what the model has come to do, e.g. memorisation: the
    training set fitted). Each `crosses` entry, written as `reaches`', is a level the run passes in
    the stage: past it at the stage's end and not yet at its onset (e.g. induction heads forming:
    the best head's induction score passing the threshold). A signature names at most one stage of a
    run; signatures declaring the same `sequence` name stages in their declared order
    (`assign_names`).
    """

    name: str
    moves: tuple[str, ...]
    absent: tuple[str, ...] = ()
    run_has: str | None = None
    source: str = ""
    sequence: str | None = None
    outpaces: tuple[tuple[str, str], ...] = ()
    steady: tuple[tuple[str, str], ...] = ()
    during: tuple[str, ...] = ()
    reaches: tuple[str, ...] = ()
    crosses: tuple[str, ...] = ()

    def __post_init__(self):
        for entry in self.moves + self.absent + self.during:
            for alternative in entry.split(" | "):
                parts = alternative.split()
                if len(parts) != 2 or parts[1] not in ("up", "down"):
                    raise ValueError(f"signature {self.name!r}: {alternative.strip()!r} is not 'PATTERN up|down'")
                re.compile(parts[0])
        for pattern, _ in self.outpaces + self.steady:
            re.compile(pattern)
        for entry in self.reaches + self.crosses:
            parts = entry.split()
            if len(parts) != 3 or parts[1] not in (">=", "<="):
                raise ValueError(f"signature {self.name!r}: {entry!r} is not 'KEY >=|<= LEVEL'")
            re.compile(parts[0])
            float(parts[2])

    def counts(self, member: dict, series: dict) -> bool:
        """Whether a member (an event with `metric`, `direction`, `onset`, `end`) counts as a move
        for this signature, its change measured in log10 from its onset to its end
        (`_log_change`): where a `steady` pattern matches its key, only if over half that change
        came between logged steps at which the pair's KEY had one value, and from then on its
        change is that part; where an `outpaces` pattern matches, only if its change, in its
        direction, is larger than the pair's KEY's. A test whose series are not logged (or not
        positive) is passed."""
        data, onset, end = series.get(member["metric"]), member["onset"], member["end"]
        own = _log_change(data, onset, end)
        for pattern, reference in self.steady:
            if re.fullmatch(pattern, member["metric"]) and own:
                steady = _log_change(data, onset, end, series.get(reference))
                if steady is not None and steady / own <= 0.5:
                    return False
                own = steady
        for pattern, reference in self.outpaces:
            if re.fullmatch(pattern, member["metric"]):
                other = _log_change(series.get(reference), onset, end)
                if own is not None and other is not None:
                    sign = 1.0 if member["direction"] == "up" else -1.0
                    return sign * own > sign * other
        return True

    def _has(self, entry: str, moved: set[tuple[str, str]]) -> bool:
        alternatives = [a.split() for a in entry.split(" | ")]
        return any(re.fullmatch(pattern, key) and direction == d
                   for pattern, d in alternatives for key, direction in moved)

    def matches(self, moved: set[tuple[str, str]], keys: Iterable[str] = (),
                spanned: set[tuple[str, str]] = frozenset(), vetoing: set[tuple[str, str]] | None = None,
                reached: bool = True) -> bool:
        """Whether a stage whose members moved so ((key, direction) pairs) matches, in a run
        logging `keys`; `spanned`: the `during` moves of its series over its span (`spanned`);
        `vetoing`: the moves `absent` is judged on (default `moved`; live, a member whose change
        goes on under way vetoes nothing: `detect_stages`); `reached`: whether the run is at the
        levels of `reaches` at the stage's end (`reached`)."""
        if not reached or self.run_has is not None and not any(re.fullmatch(self.run_has, k) for k in keys):
            return False
        return (all(self._has(e, moved | spanned) for e in self.moves)
                and not any(self._has(e, moved if vetoing is None else vetoing) for e in self.absent))

    def reached(self, series: dict, end: float, onset: float | None = None) -> bool:
        """Whether every series matching a `reaches` or `crosses` entry's KEY is at or past its
        LEVEL at step `end` (the stage's end; interpolated in log-step between logged steps, the
        last logged value after the series' last step: live, the level so far), and, for
        `crosses`, not yet at step `onset` (the stage's onset; not tested without one). A series
        not logged (no two finite points) passes: the level is not known."""
        def past(points, step: float, op: str, level: str) -> bool:
            value = _value_at(*points, step)
            return value >= float(level) if op == ">=" else value <= float(level)
        for entry, crossing in [(e, False) for e in self.reaches] + [(e, True) for e in self.crosses]:
            pattern, op, level = entry.split()
            for key in (k for k in series if re.fullmatch(pattern, k)):
                points = _points(series[key])
                if points is None:
                    continue
                if not past(points, end, op, level) or (crossing and onset is not None and past(points, onset, op, level)):
                    return False
        return True

    def spanned(self, series: dict, onset: int, end: int,
                elsewhere: set[tuple[str, str]] = frozenset()) -> set[tuple[str, str]]:
        """The moves of `during` that the series make from `onset` to `end`: a change in the
        entry's direction by `MOVE` of the series' range or more (`_relative_change`); not a
        (key, direction) in `elsewhere` (a transition of another stage over those steps: the
        move is that stage's)."""
        found = set()
        for entry in self.during:
            for pattern, direction in (a.split() for a in entry.split(" | ")):
                for key in (k for k in series if re.fullmatch(pattern, k) and (k, direction) not in elsewhere):
                    change = _relative_change(series[key], onset, end)
                    if change is not None and (change if direction == "up" else -change) >= MOVE:
                        found.add((key, direction))
        return found


def _first_part(key: str) -> str:
    return key.split("/", 1)[0]


@dataclasses.dataclass(frozen=True)
class StageRules:
    """What the keys mean to the stage detector (probes/keys.py `stage_rules()` builds it from
    the probes' declarations): the signatures, the headline keys (one of them alone makes a
    stage), each key's family (two families together make one; default: the key's first
    path part), which keys are detail (left out) and each key's declared scale (the detector's
    `declared`, for `run_stages`)."""

    signatures: tuple[Signature, ...] = ()
    headline: frozenset = frozenset()
    family: Callable[[str], str] = _first_part
    detail: Callable[[str], bool] = lambda key: False
    scale: Callable[[str], str | None] | None = None


@dataclasses.dataclass
class Stage:
    """One stage: steps `onset` (the earliest member's onset), `midpoint` (its members'
    midpoints averaged in log-step time, `_midpoint`), `end` (the latest member's end), onset and
    end within the steps each member's series logged (`_span`); `under_way_at_end`, a member's
    change had not ended at its series' last logged step (its fitted end after it); `members`,
    the per-series events with `series` and `size` (magnitude over the series' range) added, by
    midpoint; `lead`, the series that moved first (earliest onset); `name` of the matched
    signature or None; `type` "A", "B" or None; `id`, stable between calls given `previous`."""

    id: int
    onset: int
    midpoint: int
    end: int
    members: list[dict]
    lead: str
    name: str | None = None
    type: str | None = None
    under_way_at_end: bool = False

    @property
    def moved(self) -> set[tuple[str, str]]:
        """The (series, direction) pairs of its members."""
        return {(m["series"], m["direction"]) for m in self.members}

    @property
    def in_progress(self) -> bool:
        """A member is a change still under way (live)."""
        return any(m.get("kind") == "in_progress" for m in self.members)

    def summary(self) -> str:
        """One line: id, name, span (marked when a change is in progress, live, or was still
        under way at the end of the data), what moved (lead first; a series moving the same way
        in several pieces once), type."""
        moved = ", ".join(dict.fromkeys(f"{m['series']} {m['direction']}" for m in
                          sorted(self.members, key=lambda m: (m["series"] != self.lead, m["onset"], m["series"]))))
        label = f" {self.name}" if self.name else " (unnamed)"
        kind = f", type {self.type}" if self.type else ""
        more = " (in progress)" if self.in_progress else ""
        open_end = "; under way at the end" if self.under_way_at_end and not self.in_progress else ""
        return (f"stage {self.id}{label}: steps {self.onset}-{self.end} (midpoint {self.midpoint}{open_end}){more}"
                f"{kind}; led by {self.lead}; {moved}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> "Stage":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in fields})


def _event_dict(event) -> dict:
    """A plain dict of an event (a dict, or anything with `to_dict`)."""
    return dict(event) if isinstance(event, dict) else dict(event.to_dict())


def _usable(event: dict, rules: StageRules) -> bool:
    """A transition (ended or under way) of a series that is not detail."""
    return (event.get("kind", "transition") in ("transition", "in_progress")
            and event.get("stage", "confirmed") == "confirmed" and event.get("midpoint") is not None
            and event.get("onset") is not None and event.get("end") is not None
            and event.get("direction") in ("up", "down") and not rules.detail(event["metric"]))


def _times(event: dict) -> tuple[float, float, float]:
    """log10 of onset, midpoint and end, ordered, each at least step 1."""
    onset, mid, end = (math.log10(max(float(event[k]), 1.0)) for k in ("onset", "midpoint", "end"))
    mid = min(max(mid, onset), end)
    return onset, mid, end


def _chi2_quantile(p: float, dof: int) -> float:
    """The p quantile of chi-squared with `dof` degrees of freedom (Wilson-Hilferty: 2.4% under
    the exact value at 1 degree of freedom and the 95% level, under 1% from 2 on)."""
    z = math.sqrt(2) * _erfinv(2 * p - 1)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _erfinv(x: float) -> float:
    """The inverse error function, by Newton's method from Winitzki's approximation."""
    a = 0.147
    ln = math.log(1 - x * x)
    y = math.copysign(math.sqrt(math.sqrt((2 / (math.pi * a) + ln / 2) ** 2 - ln / a) - (2 / (math.pi * a) + ln / 2)), x)
    for _ in range(3):
        y -= (math.erf(y) - x) / (2 / math.sqrt(math.pi) * math.exp(-y * y))
    return y


def _step_gap(data, t: float) -> float:
    """The log10 gap between a series' logged steps around log10 step `t` (0 without two)."""
    if data is None or len(data[0]) < 2:
        return 0.0
    steps = np.log10(np.maximum(np.unique(np.asarray(data[0], dtype=float)), 1.0))
    k = int(np.clip(np.searchsorted(steps, t), 1, len(steps) - 1))
    return float(steps[k] - steps[k - 1])


def _scale(event: dict, series: dict) -> float:
    """How exactly an event's midpoint can stand for its time, in decades: its change's logistic
    width in log-step time, at least the log-gap between the series' logged steps around its
    midpoint (a jump between two logged steps is anywhere between them)."""
    onset, mid, end = _times(event)
    return max((end - onset) / (2 * _LN9), _step_gap(series.get(event["metric"]), mid), MIN_WIDTH)


def _clusters(events: list[dict], series: dict, level: float) -> list[list[dict]]:
    """Events whose midpoints are one time up to their own scales (`_scale`): `_agglomerate`d,
    then each group that is one time only through its wide changes split (`_unbridged`); each
    group in midpoint order."""
    groups = [part for group in _agglomerate(events, series, level) for part in _unbridged(group, series, level)]
    return sorted((sorted(g, key=lambda e: _times(e)[1]) for g in groups), key=lambda g: _times(g[0])[1])


def _agglomerate(events: list[dict], series: dict, level: float) -> list[list[dict]]:
    """Neighbours in midpoint order merged, the pair adding least chi-squared first, while the
    merged group's chi-squared (of its midpoints about their weighted mean) stays within its
    `level` quantile (n - 1 degrees of freedom)."""
    events = sorted(events, key=lambda e: _times(e)[1])
    t = np.array([_times(e)[1] for e in events])
    weight = 1 / np.array([_scale(e, series) for e in events]) ** 2
    sums = [np.concatenate([[0.0], np.cumsum(x)]).tolist() for x in (weight, weight * t, weight * t * t)]

    def misfit(i: int, j: int) -> float:  # events i..j-1
        w, wt, wtt = (c[j] - c[i] for c in sums)
        return max(wtt - wt * wt / w, 0.0)

    bar = [0.0] + [_chi2_quantile(level, n) for n in range(1, len(events))]
    cuts = list(range(len(events) + 1))  # group k is events cuts[k]..cuts[k+1]-1
    while len(cuts) > 2:
        best, k_best = math.inf, None
        for k in range(len(cuts) - 2):
            i, m, j = cuts[k], cuts[k + 1], cuts[k + 2]
            chi2 = misfit(i, j)
            if chi2 <= bar[j - i - 1] and chi2 - misfit(i, m) - misfit(m, j) < best:
                best, k_best = chi2 - misfit(i, m) - misfit(m, j), k
        if k_best is None:
            break
        del cuts[k_best + 1]
    return [events[i:j] for i, j in zip(cuts, cuts[1:])]


def _misfit(events: list[dict], series: dict) -> float:
    """The chi-squared of the events' midpoints (log10 steps) about their weighted mean, each in
    units of its scale (`_scale`)."""
    t = np.array([_times(e)[1] for e in events])
    weight = 1 / np.array([_scale(e, series) for e in events]) ** 2
    return max(float(np.sum(weight * t * t) - np.sum(weight * t) ** 2 / np.sum(weight)), 0.0)


def _one_time(events: list[dict], series: dict, level: float) -> bool:
    """The events' midpoints are one time up to their scales (`_clusters`' test)."""
    return len(events) < 2 or _misfit(events, series) <= _chi2_quantile(level, len(events) - 1)


def _unbridged(group: list[dict], series: dict, level: float) -> list[list[dict]]:
    """A group split where it is one time only through its wide changes. A change whose 10-90%
    span holds every other member's midpoint (a bridge) is consistent with any time among them:
    it adds degrees of freedom and little chi-squared, and can carry the join of changes that are
    not one time without it. Where the members that are no bridge are not one time
    (`_one_time`), they are grouped without the bridges (`_agglomerate`), each bridge joins the
    part to which it adds least chi-squared (no two parts merged), and each part is split so in
    turn; otherwise the group stays whole."""
    times = [_times(e) for e in group]
    bridges = [e for k, e in enumerate(group)
               if all(times[k][0] <= t[1] <= times[k][2] for j, t in enumerate(times) if j != k)]
    core = [e for e in group if not any(e is b for b in bridges)]
    if len(group) < 3 or len(core) < 2 or _one_time(core, series, level):
        return [group]
    parts = _agglomerate(core, series, level)
    for bridge in sorted(bridges, key=lambda e: _times(e)[1]):
        min(parts, key=lambda p: _misfit(p + [bridge], series) - _misfit(p, series)).append(bridge)
    return [piece for part in parts for piece in _unbridged(part, series, level)]


def _qualifies(members: list[dict], rules: StageRules) -> bool:
    """Series of two families, or a headline series."""
    return (len({rules.family(m["metric"]) for m in members}) >= 2
            or any(m["metric"] in rules.headline for m in members))


def _joined(events: list[dict], series: dict) -> list[dict]:
    """Events with each series' pieces of one change joined: transitions of one series in one
    direction, each beginning where the last ended up to the timing resolution (`MIN_WIDTH`, or
    the gap between its logged steps there), are one change (the detector cuts a fall through
    decades where its rate changes). A joined event is one change over its pieces' span, its
    midpoint where the series has made half of that change (`_half_way`, as the detector's
    midpoint of one piece), its `pieces` the events it joins."""
    out, runs = [], {}
    for e in sorted(events, key=lambda e: (_times(e)[0], _times(e)[2])):
        if e.get("kind", "transition") != "transition":
            out.append(e)
            continue
        runs.pop((e["metric"], "up" if e["direction"] == "down" else "down"), None)  # a reversal ends a change
        last = runs.get((e["metric"], e["direction"]))
        if last is not None and _times(e)[0] - _times(last)[2] <= max(
                MIN_WIDTH, _step_gap(series.get(e["metric"]), _times(last)[2])):
            last["pieces"].append(e)
            last["end"] = max(last["end"], e["end"])
        else:
            runs[e["metric"], e["direction"]] = {**e, "pieces": [e]}
            out.append(runs[e["metric"], e["direction"]])
    for e in out:
        if len(e.get("pieces", ())) > 1:
            e["midpoint"] = _half_way(series.get(e["metric"]), e)
    return out


def _half_way(data, event: dict) -> int:
    """The step at which a series has made half of its change from an event's onset to its end,
    on the scale the detector watched it (the event's `scale`, else `watch_scale`'s), interpolated
    in log-step between its logged steps (the detector's midpoint of a change); the span's
    centre in log-step time where the series cannot tell."""
    onset, end = (math.log10(max(float(event[k]), 1.0)) for k in ("onset", "end"))
    centre = int(round(10 ** ((onset + end) / 2)))
    points = _points(data)
    if points is None:
        return centre
    t, values = np.log10(np.maximum(points[0], 1.0)), points[1]
    if (event.get("scale") or watch_scale(values)) == LOG and np.all(values > 0):
        values = np.log10(values)
    grid = np.linspace(onset, end, 512)
    curve = np.interp(grid, t, values)
    if curve[-1] == curve[0]:
        return centre
    progress = np.maximum.accumulate((curve - curve[0]) / (curve[-1] - curve[0]))
    return int(round(10 ** grid[min(int(np.searchsorted(progress, 0.5)), len(grid) - 1)]))


def _group(events: list[dict], series: dict, rules: StageRules, level: float) -> list[list[dict]]:
    """The events of each stage (`_clusters` of the changes `_joined`, each then given back as its
    pieces); groups that do not qualify are taken out and the rest grouped again, until every
    group qualifies."""
    families = {e["metric"]: rules.family(e["metric"]) for e in events}
    rules = dataclasses.replace(rules, family=families.__getitem__)
    events = _joined(events, series)
    while events:
        groups = _clusters(events, series, level)
        kept = [e for g in groups if _qualifies(g, rules) for e in g]
        if len(kept) == len(events):
            return [[p for e in g for p in e.get("pieces", [e])] for g in groups]
        events = kept
    return []


def _value_at(steps: np.ndarray, values: np.ndarray, step: float) -> float:
    return float(np.interp(math.log10(max(step, 1.0)), np.log10(np.maximum(steps, 1.0)), values))


def _points(data, positive: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """A series' finite (and, if asked, positive) points in step order; None under two."""
    if data is None:
        return None
    steps, values = (np.asarray(x, dtype=float) for x in data)
    ok = np.isfinite(values) & np.isfinite(steps) & ((values > 0) if positive else True)
    order = np.argsort(steps[ok])
    return (steps[ok][order], values[ok][order]) if ok.sum() >= 2 else None


def _relative_change(data, onset: int, end: int) -> float | None:
    """A series' change from `onset` to `end` (interpolated in log-step) over its range."""
    points = _points(data)
    if points is None or np.ptp(points[1]) == 0:
        return None
    steps, values = points
    return (_value_at(steps, values, end) - _value_at(steps, values, onset)) / float(np.ptp(values))


def _log_change(data, onset: int, end: int, held=None) -> float | None:
    """A positive series' change in log10 from `onset` to `end` (interpolated in log-step);
    with `held` (a series), less its changes between consecutive logged steps at which `held`
    (interpolated in steps) differs, the part of each within `onset`-`end`. None without two
    positive values."""
    points = _points(data, positive=True)
    if points is None:
        return None
    steps, values = points[0], np.log10(points[1])
    change = _value_at(steps, values, end) - _value_at(steps, values, onset)
    other = _points(held)
    if other is not None:
        t = np.log10(np.maximum(steps, 1.0))
        lo, hi = math.log10(max(onset, 1)), math.log10(max(end, 1))
        for k in np.nonzero(np.diff(np.interp(steps, *other)) != 0)[0]:
            part = min(t[k + 1], hi) - max(t[k], lo)
            if part > 0 and t[k + 1] > t[k]:
                change -= (values[k + 1] - values[k]) * part / (t[k + 1] - t[k])
    return change


def stage_type(onset: int, end: int, series: dict) -> str | None:
    """Hoogland et al. 2024's type of a stage from `onset` to `end`: "A" when the loss falls and
    the LLC rises, "B" when the loss barely moves and the LLC falls, each by `MOVE` of the
    series' range over the run; None otherwise, or without an LLC series."""
    loss_key = next((k for k in LOSS_KEYS if k in series), None)
    if LLC_KEY not in series or loss_key is None:
        return None
    llc, loss = _relative_change(series[LLC_KEY], onset, end), _relative_change(series[loss_key], onset, end)
    if llc is None or loss is None:
        return None
    if llc >= MOVE and loss <= -MOVE:
        return "A"
    if llc <= -MOVE and abs(loss) < MOVE:
        return "B"
    return None


def _evidence(signature: Signature, members: list[dict], others: Iterable[list[dict]], series: dict,
              unsettled: set[int] = frozenset()) -> tuple:
    """What a stage (its `members`) shows of a signature: the (series, direction) pairs of its
    members that count (`Signature.counts`), its series' `during` moves over its span (its
    members' earliest onset to latest end) that are no transition of the `others` (other stages'
    members) over those steps (`Signature.spanned`), the pairs that veto (`absent`): those of
    the members that count and are not in `unsettled` (ids of members whose change goes on), and
    whether the run is at the signature's levels at the span's end (`Signature.reached`)."""
    span = (min(m["onset"] for m in members), max(m["end"] for m in members)) if members else (0, 0)
    elsewhere = {(m["metric"], m["direction"]) for other in others for m in other
                 if m["onset"] < span[1] and m["end"] > span[0]}
    counting = [m for m in members if signature.counts(m, series)]
    moved = {(m["metric"], m["direction"]) for m in counting}
    vetoing = {(m["metric"], m["direction"]) for m in counting if id(m) not in unsettled}
    return moved, signature.spanned(series, *span, elsewhere), vetoing, signature.reached(series, span[1], span[0])


def _one_phase(stages: list[Stage], rules: StageRules, keys: list[str], series: dict,
               kept: Sequence[Stage] = ()) -> list[Stage]:
    """Stages of one phase joined (docs/stages.md, Names: one phase, one interval). An unnamed
    stage next to a named one in time order, their spans overlapping, that matches the named
    stage's signature by itself (`_evidence`, the named stage's transitions counting as its own
    phase's `during` moves) is more of that phase: its members join the named stage (span,
    midpoint, lead and type redone; a stage in `kept`, said live, keeps its lead and type, and
    never joins another), until no such pair is left. Live, stages with a change in progress or
    not yet confirmed (`under_way`) neither join nor are joined. The stages left, in order."""
    signatures = {s.name: s for s in rules.signatures}
    stages = sorted(stages, key=lambda s: (s.midpoint, s.onset))
    moving = {id(s) for s in stages if s.in_progress or any(m.get("under_way") for m in s.members)}

    def continues(named: Stage, other: Stage) -> bool:
        signature = signatures.get(named.name)
        if (signature is None or other.name is not None or id(other) in moving or id(named) in moving
                or any(other is k for k in kept) or other.onset > named.end or named.onset > other.end):
            return False
        moved, spanned, _, reached = _evidence(signature, other.members, [s.members for s in stages if s is not other
                                                                          and s is not named], series)
        return signature.matches(moved, keys, spanned, reached=reached)

    while True:
        pair = next(((n, o) for a, b in zip(stages, stages[1:]) for n, o in ((a, b), (b, a)) if continues(n, o)), None)
        if pair is None:
            return stages
        named, other = pair
        named.members = sorted(named.members + other.members, key=lambda m: (m["midpoint"], m["metric"]))
        named.onset, named.end, named.under_way_at_end = _span(named.members, series)
        named.midpoint = _midpoint(named.members, series)
        if not any(named is k for k in kept):
            named.lead = lead_member(named.members)["series"]
            named.type = stage_type(named.onset, named.end, series)
        stages = sorted((s for s in stages if s is not other), key=lambda s: (s.midpoint, s.onset))


def assign_names(stages: Sequence[list[dict]], rules: StageRules, keys: Iterable[str] = (),
                 fixed: dict[int, str | None] | None = None, series: dict | None = None,
                 unsettled: set[int] = frozenset()) -> list[str | None]:
    """The names of a run's stages (each a list of members, in time order), assigned over the
    whole sequence: each stage takes the name of a signature it matches (its members that count,
    `Signature.counts` on `series`, and its series' `during` moves over its span that are no
    other stage's transition) or none; a signature names at most one stage, and the signatures
    of one `sequence` name stages in their declared order. Of the assignments, the one naming most stages; of those, the one naming
    most by their members alone; then the one naming earlier stages, then giving a stage the
    signature with more `moves` entries, then the one declared first (docs/stages.md, Names). `fixed`: stage index -> its name, kept as it is (a stage
    already said, live). `unsettled`: ids of members whose change goes on under way (live): they
    count for `moves`, and veto nothing (`absent`), their change's stage not yet known."""
    keys, fixed, series = list(keys), fixed or {}, series or {}
    order = {s.name: k for k, s in enumerate(rules.signatures)}
    sequences = sorted({s.sequence for s in rules.signatures if s.sequence is not None})
    matched, strong = [], []
    for i, members in enumerate(stages):
        evidence = {s.name: _evidence(s, members, [o for j, o in enumerate(stages) if j != i], series, unsettled)
                    for s in rules.signatures}
        matched.append([s for s in rules.signatures if s.matches(evidence[s.name][0], keys, *evidence[s.name][1:])])
        strong.append({s.name for s in matched[-1] if s.matches(evidence[s.name][0], keys, vetoing=evidence[s.name][2],
                                                                reached=evidence[s.name][3])})
    for i, name in fixed.items():
        matched[i], strong[i] = [s for s in rules.signatures if s.name == name], {name}
    sequence_of = {s.name: s.sequence for s in rules.signatures}
    held = set(fixed.values())

    def allowed(i: int, sig: Signature, used: frozenset, last: tuple) -> bool:
        """A name stage i may take: unused, held by no fixed stage, in its sequence's order (after
        the names taken before, before the fixed stages' after it)."""
        if i in fixed:
            return True
        if sig.name in used or sig.name in held:
            return False
        return sig.sequence is None or (order[sig.name] > last[sequences.index(sig.sequence)] and all(
            order[name] > order[sig.name] for j, name in fixed.items() if j > i and sequence_of.get(name) == sig.sequence))
    memo: dict = {}

    def best(i: int, used: frozenset, last: tuple) -> tuple:
        """(count, named flags, preferences, names) for stages i.. given the names used and the
        last declared position taken in each sequence."""
        if i == len(stages):
            return 0, 0, (), (), ()
        if (i, used, last) not in memo:
            options = []
            if fixed.get(i) is None or not matched[i]:
                count, members, flags, ranks, names = best(i + 1, used, last)
                options.append((count, members, (0,) + flags, ((0, 0),) + ranks, (None,) + names))
            for sig in matched[i]:
                if not allowed(i, sig, used, last):
                    continue
                slot = sequences.index(sig.sequence) if sig.sequence is not None else None
                after = last if slot is None else last[:slot] + (order[sig.name],) + last[slot + 1:]
                count, members, flags, ranks, names = best(i + 1, used | {sig.name}, after)
                options.append((count + 1, members + (sig.name in strong[i]), (1,) + flags,
                                ((len(sig.moves), -order[sig.name]),) + ranks, (sig.name,) + names))
            memo[i, used, last] = max(options, key=lambda o: o[:4])
        return memo[i, used, last]

    return list(best(0, frozenset(), (-1,) * len(sequences))[4])


def lead_member(members: list[dict]) -> dict:
    """The member that leads a stage: the earliest onset (then midpoint, then key); its series
    is the stage's `lead`."""
    return min(members, key=lambda m: (m["onset"], m["midpoint"], m["metric"]))


def _midpoint(members: list[dict], series: dict) -> int:
    """The stage's time: its members' midpoints averaged in log-step time, each weighted by
    1 / its scale squared (the centre the chi-squared test measures from)."""
    t = np.array([_times(m)[1] for m in members])
    weight = 1 / np.array([_scale(m, series) for m in members]) ** 2
    return int(round(10 ** float(np.sum(weight * t) / np.sum(weight))))


def _size(event: dict, series: dict) -> float | None:
    data = series.get(event["metric"])
    if data is None or event.get("magnitude") is None:
        return None
    values = np.asarray(data[1], dtype=float)
    values = values[np.isfinite(values)]
    span = float(np.ptp(values)) if len(values) else 0.0
    return round(float(event["magnitude"]) / span, 4) if span > 0 else None


def _carry_ids(stages: list[Stage], previous: Sequence[Stage], taken: set[int] = frozenset()) -> None:
    """Give each stage the id of a previous stage (spans overlapping in steps, a moved series in
    common): the pairs with the same name first, then those sharing most moved series; one to
    one, ids in `taken` excepted; new ids after the largest used."""
    taken, given = set(taken), {}
    next_id = max([s.id for s in previous] + list(taken) + [0]) + 1
    pairs = []
    for k, stage in enumerate(stages):
        mine = stage.moved
        for old in previous:
            common = len(mine & old.moved)
            if common and not (old.end < stage.onset or stage.end < old.onset):
                pairs.append(((stage.name is not None and old.name == stage.name, common), -k, old.id))
    for _, k, old_id in sorted(pairs, reverse=True):
        if -k not in given and old_id not in taken:
            given[-k] = old_id
            taken.add(old_id)
    for k, stage in enumerate(stages):
        if k in given:
            stage.id = given[k]
        else:
            stage.id, next_id = next_id, next_id + 1


def _span(members: list[dict], series: dict) -> tuple[int, int, bool]:
    """A stage's onset and end, within the steps the run logged: its members' earliest onset and
    latest end, each transition's fitted 10% and 90% points held within its series' first and
    last logged steps (`_logged`; any series', for a series not given); and whether a
    transition was still under way at its series' last logged step (its 90% point after it: the
    detector fits that point, docs/stages.md). A change in progress (live) keeps its fitted
    points: the stage is said in progress, its end a forecast."""
    onsets, ends, open_end = [], [], False
    for m in members:
        first, last = (-math.inf, math.inf) if m.get("kind") == "in_progress" else _logged(series.get(m["metric"]))
        if math.isinf(first) and m.get("kind") != "in_progress":  # the series not given
            first, last = _logged(*series.values())
        onsets.append(min(max(float(m["onset"]), first), last))
        ends.append(min(max(float(m["end"]), first), last))
        open_end = open_end or float(m["end"]) > last
    return int(round(min(onsets))), int(round(max(ends))), open_end


def _logged(*data) -> tuple[float, float]:
    """The first and last step at which any of these series has a finite value (unbounded
    without one)."""
    steps = [points[0] for points in map(_points, data) if points is not None]
    return (min(float(s[0]) for s in steps), max(float(s[-1]) for s in steps)) if steps else (-math.inf, math.inf)


def _key(event: dict) -> tuple:
    return tuple(event.get(k) for k in ("metric", "direction", "onset", "midpoint", "end"))


def _one_change(a: dict, b: dict, series: dict) -> bool:
    """Two changes of one series in one direction are pieces of one change: their spans overlap
    or one begins where the other ended, up to the timing resolution (`MIN_WIDTH`, or the gap
    between the series' logged steps there): `_joined`'s test, in either order."""
    if a["metric"] != b["metric"] or a["direction"] != b["direction"]:
        return False
    (a0, _, a1), (b0, _, b1) = _times(a), _times(b)
    gap = max(MIN_WIDTH, _step_gap(series.get(a["metric"]), min(a1, b1)))
    return b0 - a1 <= gap and a0 - b1 <= gap


def _absorbed(rest: list[dict], keep: list[Stage], series: dict, level: float) -> tuple[list[dict], dict]:
    """Live: the events of `rest` that are more of a kept stage's changes, joined to it (its
    members, span and midpoint grow; its id and name stay); the others, returned, and of them the
    pieces of a kept stage's change that has moved on ({id: (event, stage)}, `_still_at`). An
    event joins a kept stage when it is a piece of one of the stage's changes (`_one_change`, with
    a member or with an event joined before it) that is still at the stage's time, or, a
    transition, when it is of one of the stage's series and at one time with its members
    (`_one_time`); a change under way (a fit in progress, or one not yet confirmed: marked
    `under_way`) that is a piece of one is left out (no stage of its own) but not joined until it
    is a confirmed transition."""
    taken, moved_on = set(), {}
    for e in sorted(rest, key=_times) if keep else ():
        settled = e.get("kind", "transition") == "transition" and not e.get("under_way")
        home = [k for k in keep if any(_one_change(m, e, series) for m in k.members)]
        if settled and home:  # a change that has moved on to a time of its own is that time's
            later = [k for k in home if not _still_at(k, e, series, level)]
            home = [k for k in home if all(k is not o for o in later)]
        else:
            later = [k for f, k in moved_on.values() if settled and _one_change(f, e, series)]
        if later and not home:
            moved_on[id(e)] = (e, later[0])
            continue
        if not home and settled:
            home = [k for k in keep if any(m["metric"] == e["metric"] for m in k.members)
                    and _one_time(k.members + [e], series, level)]
        if home:
            taken.add(id(e))
        if home and settled:
            _join(min(home, key=lambda k: abs(_times(e)[1] - math.log10(max(k.midpoint, 1)))), e, series)
    return [e for e in rest if id(e) not in taken], moved_on


def _join(stage: Stage, event: dict, series: dict) -> None:
    """An event joined to a kept stage: a member; the span and midpoint redone."""
    stage.members.append({**event, "series": event["metric"], "size": _size(event, series)})
    stage.onset, stage.end, stage.under_way_at_end = _span(stage.members, series)
    stage.midpoint = _midpoint(stage.members, series)


def _still_at(stage: Stage, event: dict, series: dict, level: float) -> bool:
    """Live: a kept stage's change with `event`, a later piece of it, joined (`_joined`: one change
    over its pieces' span, at the step where half of it is made) is still one time with the
    stage's other members (`_one_time`): offline the joined change belongs to the stage at its
    half-way point, so a change that has moved on (a rise begun in one stage and made mostly in
    a later one) is not the kept stage's to take up."""
    change = next(c for c in _joined(stage.members + [event], series) if any(p is event for p in c.get("pieces", [c])))
    pieces = change.get("pieces", [change])
    return _one_time([m for m in stage.members if not any(m is p for p in pieces)] + [change], series, level)


def _going_on(events: list[dict], series: dict) -> set[int]:
    """Live: the ids of the events whose change goes on: a later fit of the same series in the
    same direction, a change in progress, is a piece of one change with it (`_one_change`). The
    change's stage is not known until it is over (offline, the joined change is the stage's at
    its half-way step: `_joined`). Offline, none."""
    going = [e for e in events if e.get("kind") == "in_progress"]
    return {id(m) for m in events if any(g is not m and _times(g)[0] > _times(m)[0] and _one_change(m, g, series)
                                         for g in going)}


def one_activity(a: Stage, b: Stage, series: dict, level: float = LEVEL) -> bool:
    """Live: two stages overlap in steps and their members' midpoints are one time up to their
    own widths (`_one_time`, the grouping's test): the one is more of the other's activity that
    the live fits left apart (a piece formed beside a stage already kept, or cut off by a look)."""
    return a.onset <= b.end and b.onset <= a.end and _one_time(a.members + b.members, series, level)


def detect_stages(events: Iterable, series: dict, rules: StageRules | None = None,
                  previous: Sequence[Stage] | None = None, level: float = LEVEL,
                  keep: Sequence[Stage] = ()) -> list[Stage]:
    """The stages of a run, in order (module docstring). `events`: per-series transitions;
    `series`: metric -> (steps, values) (for sizes, signatures' `run_has` and types);
    `previous`: the stages of an earlier call, whose ids carry over; `keep`: stages kept with
    their ids, names and members (live: those already confirmed), their members' events left
    out of the grouping, and more of their changes joined to them (`_absorbed`; stages of their
    phase, `_one_phase`). A piece of a kept stage's change that has moved on (`_still_at`) is
    grouped as any event; a group of such pieces alone (even of different kept stages) makes no
    stage, and each of its pieces joins its own kept stage."""
    rules = rules or StageRules()
    kept = {_key(m) for stage in keep for m in stage.members}
    usable = [e for e in map(_event_dict, events) if _usable(e, rules)]
    keep = [dataclasses.replace(stage, members=list(stage.members)) for stage in keep]
    rest, moved_on = _absorbed([e for e in usable if _key(e) not in kept], keep, series, level)
    groups = [g for g in _group(rest, series, rules, level) if not all(id(m) in moved_on for m in g)]
    grouped = {id(m) for g in groups for m in g}
    for e, stage in (v for k, v in moved_on.items() if k not in grouped):  # no stage of their own: the kept
        _join(stage, e, series)                                             # stage's, as before
    new = []
    for members in groups:
        members = sorted(members, key=lambda m: (m["midpoint"], m["metric"]))
        for m in members:
            m["series"], m["size"] = m["metric"], _size(m, series)
        lead = lead_member(members)
        onset, end, open_end = _span(members, series)
        new.append(Stage(id=0, onset=onset, midpoint=_midpoint(members, series), end=end, members=members,
                         lead=lead["series"], type=stage_type(onset, end, series), under_way_at_end=open_end))
    stages = sorted([*keep, *new], key=lambda s: (s.midpoint, s.onset))
    fixed = {i: s.name for i, s in enumerate(stages) if any(s is k for k in keep)}
    keys = list(series) + [e["metric"] for e in usable]
    for stage, name in zip(stages, assign_names([s.members for s in stages], rules, keys, fixed, series,
                                                _going_on(usable, series))):
        stage.name = name
    stages = _one_phase(stages, rules, keys, series, keep)
    new = [s for s in new if any(s is t for t in stages)]
    if previous is not None or keep:
        _carry_ids(new, [s for s in previous or () if all(s.id != k.id for k in keep)], {k.id for k in keep})
    else:
        for k, stage in enumerate(stages, start=1):
            stage.id = k
    return stages


def run_stages(folder, rules: StageRules | None = None, events: Iterable | None = None) -> list[Stage]:
    """A run folder's stages: of `events`, by default the detector's transitions (on each
    series' declared scale) in every series that is not detail (what `phasewatch phases RUN` shows)."""
    return series_stages(folder.series(), rules, events)


def series_stages(series: dict, rules: StageRules | None = None, events: Iterable | None = None) -> list[Stage]:
    """`run_stages` of series already read ({key: (steps, values)})."""
    rules = rules or StageRules()
    series = {k: v for k, v in series.items() if not rules.detail(k)}
    found = detect_all(series, declared=rules.scale) if events is None else events
    return detect_stages(found, series, rules)


def record_stages(folder, rules: StageRules | None = None, events: Iterable | None = None) -> list[Stage]:
    """`run_stages`, written into the folder (`write_stages`) for the report and the summary."""
    stages = run_stages(folder, rules, events)
    write_stages(folder, stages)
    return stages


def write_stages(folder, stages: Sequence[Stage]) -> None:
    """Write a run's stages into its folder (`RunFolder.stages`), one JSON line each."""
    folder.rewrite(folder.stages, [s.to_dict() for s in stages])


def read_stages(folder) -> list[Stage]:
    """The stages written into a run folder (none when it has no stages file)."""
    return [Stage.from_dict(r) for r in read_jsonl(folder.stages)]

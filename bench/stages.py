"""Stages (phasewatch/phases/stages.py) on planted multi-series cases and on real runs.

    python bench/stages.py [--seeds 8] [--runs RUN_DIR ...] [--keys KEY ...] [--write]

Synthetic: per seed, series logged at 100 log-spaced steps (1-10,000) holding three planted
stages about a decade apart (2-4 series each, of different families; logistic steps in log-step time whose 10-90% part
lasts 0.06-0.2 decades, midpoints scattered by half a logistic width about the stage's time, noise 4% of the
step), two lone changes (series of their own family, 0.35-0.55 decades from the stages),
two noise series and two trends (linear in steps, linear in log-steps); the "close" case puts
two of the stages 0.35 decades apart with changes lasting 0.1-0.3 decades (their spans overlap);
"close, slow" adds to the middle stage a slow change lasting 0.6 decades (a Gini coefficient
rising through two phases). The detector's transitions (`detect_all`) go to
five groupings, the same qualification rule (two families or a headline series; none here)
after each: phasewatch's (chi-squared at 95%), the same at 99%, the same with wide changes
bridging stages (no `_unbridged`: the grouping before session 15), the per-series list (every
transition its own stage: what `phasewatch phases` printed before stages) and the 10-90%
spans that overlap joined (single linkage). A found stage matches a planted one when their
series overlap by half or more (Jaccard); precision = matched found / found, recall = matched
planted / planted; a lone change inside a found stage is counted; a boundary (onset, end) is
recovered within 0.1 decades (26%). Real runs: the stages of each run folder (or metrics or CSV
file, as `phasewatch phases` reads it), named or not, in order, and for grokking runs the steps
the progress measures' definitions give (docs/reference.md), each with the stages whose span
holds it. Prints markdown (with --write: into bench/README.md between its stages markers).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from phasewatch.phases import stages as S  # noqa: E402
from phasewatch.phases.detector import detect_all  # noqa: E402

STEPS = np.unique(np.round(np.geomspace(1, 10_000, 100)))
RECOVERED = 0.1  # decades
_LN9 = math.log(9)


@dataclasses.dataclass
class Planted:
    members: set
    onset: float
    end: float


def logistic(t: np.ndarray, centre: float, width: float) -> np.ndarray:
    return 1 / (1 + np.exp(-(t - centre) / width))


def synthetic_run(seed: int, close: bool, slow: bool = False) -> tuple[dict, list[Planted], set]:
    """(series, planted stages, lone series) of one synthetic run."""
    rng = np.random.default_rng(seed)
    t = np.log10(STEPS)
    times = [rng.uniform(1.2, 1.5)]
    times.append(times[0] + rng.uniform(0.9, 1.1))
    times.append(times[1] + (0.35 if close else rng.uniform(0.9, 1.1)))
    lone_times = [(times[0] + times[1]) / 2 + rng.uniform(-0.1, 0.1),
                  times[2] + 0.5 if close else (times[1] + times[2]) / 2 + rng.uniform(-0.1, 0.1)]
    series, planted, family = {}, [], 0
    for k, centre in enumerate(times):
        names = set()
        low, high = math.inf, -math.inf
        for j in range(rng.integers(2, 5) + (slow and k == 1)):
            family += 1
            span = rng.uniform(0.1, 0.3) if close else rng.uniform(0.06, 0.2)  # decades from 10% to 90%
            span = 0.6 if slow and k == 1 and j == 0 else span
            scale = span / (2 * _LN9)
            mid = centre + rng.normal(0, 0.5 * scale)
            name = f"f{family}/stage{k}"
            sign = rng.choice([-1, 1])
            series[name] = (STEPS, sign * logistic(t, mid, scale) + 0.04 * rng.standard_normal(len(t)))
            names.add(name)
            low, high = min(low, mid - span / 2), max(high, mid + span / 2)
        planted.append(Planted(names, 10**low, 10**high))
    lone = set()
    for j, mid in enumerate(lone_times):
        name = f"lone{j}/x"
        series[name] = (STEPS, logistic(t, mid, rng.uniform(0.06, 0.2) / (2 * _LN9)) + 0.04 * rng.standard_normal(len(t)))
        lone.add(name)
    for j in range(2):
        series[f"noise{j}/x"] = (STEPS, rng.standard_normal(len(t)))
    series["trend0/x"] = (STEPS, STEPS / STEPS[-1] + 0.03 * rng.standard_normal(len(t)))
    series["trend1/x"] = (STEPS, t / 4 + 0.03 * rng.standard_normal(len(t)))
    return series, planted, lone


def _overlap_clusters(events, series, level):
    """Single linkage of the 10-90% spans (a naive grouping, for comparison)."""
    events = sorted(events, key=lambda e: e["onset"])
    groups, reach = [], -math.inf
    for e in events:
        if groups and e["onset"] <= reach:
            groups[-1].append(e)
            reach = max(reach, e["end"])
        else:
            groups.append([e])
            reach = e["end"]
    return groups


GROUPINGS = {
    "phasewatch (95%)": {},
    "phasewatch at 99%": {"level": 0.99},
    "phasewatch, wide changes bridging": {"bridging": True},
    "per-series list": {"clusters": lambda events, series, level: [[e] for e in events], "qualify": True},
    "overlapping spans": {"clusters": _overlap_clusters},
}


def grouped(events, series, how: dict) -> list:
    saved = S._clusters, S._qualifies, S._unbridged
    try:
        if "clusters" in how:
            S._clusters = how["clusters"]
        if how.get("qualify"):
            S._qualifies = lambda members, rules: True
        if how.get("bridging"):  # the grouping before session 15: a wide change can join two times
            S._unbridged = lambda group, series, level: [group]
        return S.detect_stages(events, series, level=how.get("level", S.LEVEL))
    finally:
        S._clusters, S._qualifies, S._unbridged = saved


def score(found, planted: list[Planted], lone: set) -> dict:
    matched, hits, onset_err, end_err = set(), 0, [], []
    for stage in found:
        names = {m["series"] for m in stage.members}
        best = max(range(len(planted)), key=lambda k: len(names & planted[k].members) / len(names | planted[k].members),
                   default=None)
        if best is None:
            continue
        jaccard = len(names & planted[best].members) / len(names | planted[best].members)
        if jaccard >= 0.5:
            hits += 1
            matched.add(best)
            onset_err.append(abs(math.log10(stage.onset / planted[best].onset)))
            end_err.append(abs(math.log10(stage.end / planted[best].end)))
    return {"found": len(found), "true": hits, "planted": len(planted), "recalled": len(matched),
            "lone_in": sum(len({m["series"] for m in s.members} & lone) for s in found), "lone": len(lone),
            "onset_err": onset_err, "end_err": end_err}


def synthetic_table(seeds: int) -> str:
    rows = []
    for case, (close, slow) in {"apart": (False, False), "close": (True, False), "close, slow": (True, True)}.items():
        runs = [synthetic_run(seed, close, slow) for seed in range(seeds)]
        events = [detect_all(series) for series, _, _ in runs]
        for label, how in GROUPINGS.items():
            total: dict = {}
            start = time.perf_counter()
            for (series, planted, lone), found_events in zip(runs, events):
                for key, value in score(grouped(found_events, series, how), planted, lone).items():
                    total[key] = total.get(key, 0 if not isinstance(value, list) else []) + value
            took = (time.perf_counter() - start) / seeds * 1000
            errors = total["onset_err"] + total["end_err"]
            rows.append(f"| {case} | {label} | {total['found']} | "
                        f"{total['true'] / max(total['found'], 1):.2f} | {total['recalled'] / total['planted']:.2f} | "
                        f"{total['lone_in']}/{total['lone']} | "
                        f"{np.mean(np.array(errors) <= RECOVERED) if errors else float('nan'):.2f} | "
                        f"{np.median(errors) if errors else float('nan'):.3f} | {took:.1f} |")
    head = ("| stages | grouping | found | precision | recall | lone changes in a stage | boundaries within 0.1 dec | "
            "median boundary error (dec) | ms per run |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    return head + "\n" + "\n".join(rows)


def _first(series, key, test) -> int | None:
    if key not in series:
        return None
    steps, values = series[key]
    hit = [s for s, v in zip(steps, values) if test(v)]
    return int(min(hit)) if hit else None


def _holding(stages, step: int | None) -> str:
    """The stages whose span (onset to end) holds a step, by name ("unnamed" if none)."""
    held = [s.name or "unnamed" for s in stages if step is not None and s.onset <= step <= s.end]
    return ", ".join(held) or "in no stage"


def real_table(runs: list[str], keys: list[str] | None = None) -> str:
    import phasewatch.probes  # noqa: F401
    from phasewatch.probes.keys import stage_rules
    from phasewatch.rundir import RunFolder, load_series

    rows = []
    for run in runs:
        all_series = RunFolder(run).series() if Path(run).is_dir() else load_series(run)
        rules = stage_rules()
        start = time.perf_counter()
        stages = S.series_stages({k: v for k, v in all_series.items() if not keys or k in keys}, rules)
        took = time.perf_counter() - start
        events = sum(len(s.members) for s in stages)
        sequence = " -> ".join(f"{s.name or 'unnamed'} ({s.onset}-{s.end}, lead {s.lead})" for s in stages) or "none"
        reference = ""
        if "grok/restricted_loss" in all_series:
            marks = {"train acc >= 0.99": _first(all_series, "train/acc", lambda v: v >= 0.99),
                     "test loss < 1": _first(all_series, "val/loss", lambda v: v < 1),
                     "test acc >= 0.95": _first(all_series, "val/acc", lambda v: v >= 0.95)}
            reference = "; ".join(f"{k} at {v} ({_holding(stages, v)})" for k, v in marks.items())
        rows.append(f"| {Path(run).name} | {len(stages)} | {events} | {sequence} | {reference} | {took:.1f} |")
    head = ("| run | stages | transitions in them | stages in order (steps, lead) | progress-measure steps "
            "(docs/reference.md) | s (with detection) |\n| --- | --- | --- | --- | --- | --- |")
    return head + "\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8, help="synthetic runs per case (0: none)")
    parser.add_argument("--runs", nargs="*", default=[],
                        help="run folders, metrics files or CSV files (the published per-token digit losses)")
    parser.add_argument("--keys", nargs="*", default=None,
                        help="the real runs' stages from these series only (e.g. the quickstart's headline series)")
    parser.add_argument("--write", action="store_true", help="write the tables into bench/README.md")
    args = parser.parse_args()
    parts = [f"Synthetic planted stages ({args.seeds} seeds per case):\n\n{synthetic_table(args.seeds)}"] if args.seeds else []
    if args.runs:
        parts.append("Real runs:\n\n" + real_table(args.runs, args.keys))
    text = "\n\n".join(parts)
    print(text)
    if args.write:
        readme = REPO / "bench" / "README.md"
        body = readme.read_text()
        begin, end = "<!-- stages:begin -->", "<!-- stages:end -->"
        if begin not in body:
            raise SystemExit(f"bench/README.md has no {begin} marker")
        head, rest = body.split(begin, 1)
        readme.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    main()

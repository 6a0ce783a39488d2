"""When live detection speaks, against what the offline detector finds on the finished run.

For every transition that `detect_transitions` finds on a finished series, this reads when the
live watcher (`TransitionWatcher`) said it: the step of the first `onset` event as a fraction of
the transition's midpoint, and the step of the `confirmed` event as a fraction of its end; and it
counts the `withdrawn` onsets. Targets (issue 20): an onset before the midpoint for >= 80% of
transitions, confirmed by 1.2 x end, at most one withdrawn onset per real run and none on a
series without a transition.

1. Synthetic series with known transitions (sigmoids in log-step time with noise, two
   transitions in one series, a trend without a transition, flat noise), logged the way training
   logs them (every 25 steps, as validation; or on 60 log-spaced steps, as probes) and replayed
   look by look (a look at every validation) through `TransitionWatcher.update`, with today's
   settings, without the departure test (`departures=False`: onsets only from the detector's
   changes under way) and with the previous ones (report once the run is at 1.5 x the end with
   3 more points, look every 4th validation; no onset stage).
2. Real runs (`phasewatch fit`, W&B off) of the quickstart, induction_2l and digit_addition configs with
   adaptive resolution on and off: their events.jsonl against the offline detector on the
   finished series, the probe points and checkpoints inside each transition, the wall time, and
   the onsets before the midpoint among the transitions with at least 2 of the series' points
   from their onset to their midpoint (with fewer, e.g. a count that jumps between two probe
   steps, no live test has anything to go on before the midpoint). A run folder already in
   `--out` is scored again, not rerun.

3. With `--frontier`: the real runs with adaptive resolution on replayed look by look with
   other bars for the departure test (`--transitions.departure_z`; none: without it), to show
   what each costs in false starts and buys in early onsets.
4. With `--stages RUN ...`: finished run folders (a population's: each member) replayed look by
   look through the watcher's stage news (`update`, then `stage_news`, as a fit does), at the
   looks of `--looks` (`validations`: the steps of `val/loss`; `watcher`: the watcher's own
   schedule, `TransitionWatcher.look_steps`, as in a fit; `logged`: every step a watched series
   has a point, the most a look can see). Per stage of the offline answer (`series_stages` of
   the finished series): the first announcement of a live stage that shares a moved series with
   it and overlaps it, over its midpoint, counted only if that stage was later confirmed as one
   that still matches (in brackets: any announcement); that stage's confirmation over its end; per run the
   withdrawn stages and the default console lines (stage lines) per offline stage; per set, the
   offline stages with a name confirmed live under it, and the live names the offline answer
   does not give (`offline_names`).
   Targets (issue 43): announced before the midpoint for >= 80% of stages, confirmed by
   1.2 x end, at most one withdrawn stage per run, at most 3 lines per stage. With `--show`,
   per run also what the lines claimed (`name_checks`: stages named at "begins", of them
   confirmed under another name, leads changed, names confirmed twice); `--lines`, the lines;
   `--settle F ...`, a row per confirmation wait (the watcher's `settle`, x a change's end).
5. With `--early K ...`: what logging the training metrics densely early costs: fits of
   `--configs` with `--transitions.logs_per_doubling K`, each K in turn (the order rotated each
   repeat), each in a process of its own: CPU time (user + system) against the first K's, the
   training-loss rows, probe steps, checkpoints and console stage lines (kept: each run folder,
   its console.txt); `--calls`: also one profiled fit each, its Python calls (the whole process).

    python bench/live_latency.py [--seeds 3] [--real quickstart induction_2l digit_addition]
                                 [--steps 3000] [--out /tmp/live_latency] [--frontier]
    python bench/live_latency.py --stages RUN [RUN ...] [--looks validations watcher] [--settle 1.1 1.19] [--show] [--lines]
    python bench/live_latency.py --early 0 16 [--configs quickstart_tiny induction_tiny] [--repeats 2] [--calls]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from phasewatch.callbacks.transitions import SAME, TransitionWatcher, _refit, _stage_line
from phasewatch.probes.keys import is_detail, stage_rules
from phasewatch.phases.detector import detect_transitions
from phasewatch.phases.stages import series_stages
from phasewatch.rundir import RunFolder

DENSE = np.arange(25, 3001, 25)
LOG60 = np.unique(np.round(np.geomspace(1, 3000, 60)).astype(int))


def sigmoid(steps, centre, decades, height):
    """A logistic step in log10-step time whose 10-90% part lasts `decades`."""
    width = decades / (2 * np.log(9))
    return height / (1 + np.exp(-(np.log10(steps) - np.log10(centre)) / width))


KINDS = ("single drops", "drop then rise", "trend", "flat")
#: (centre, 10-90% decades, noise) of the single drops
DROPS = [(centre, decades, noise) for centre in (150, 600, 1500) for decades in (0.15, 0.5) for noise in (0.02, 0.1)]


def ceiling(schedule: np.ndarray, z: float = 5.0) -> int:
    """How many of the single drops an ideal test could call before their midpoint: one that knows
    the drop's shape, the level before it and the noise, and looks at every point logged by the
    last look (every 25 steps) before the midpoint (the matched filter: sqrt(sum of the drop's
    squared depths so far) / noise, against `z` standard errors, the departure test's bar)."""
    count = 0
    for centre, decades, noise in DROPS:
        looks = DENSE[DENSE < centre]
        seen = schedule[schedule <= looks[-1]].astype(float) if len(looks) else np.zeros(0)
        count += np.sqrt((sigmoid(seen, centre, decades, 1.0) ** 2).sum()) / noise >= z
    return count


def shapes(seed: int) -> list[tuple[str, callable]]:
    """(kind, values at steps) of each synthetic series: drops centred at 150, 600 and 1,500
    steps lasting 0.15 or 0.5 decades with noise 2% or 10% of the drop; a drop at 200 and a
    rise at 1,500; a steady trend in log-step; flat noise."""
    rng = np.random.default_rng(seed)

    def noisy(f, noise):
        return lambda s: f(s) + rng.normal(0, noise, len(s))
    out = [("single drops", noisy(lambda s, c=centre, d=decades: 2 - sigmoid(s, c, d, 1.0), noise))
           for centre, decades, noise in DROPS]
    out.append(("drop then rise", noisy(lambda s: 2 - sigmoid(s, 200, 0.3, 1.0) + sigmoid(s, 1500, 0.3, 0.8), 0.05)))
    out.append(("trend", noisy(lambda s: 2 - 0.3 * np.log10(s), 0.05)))
    out.append(("flat", noisy(lambda s: 1 + 0 * s, 0.05)))
    return out


def replay(schedule: np.ndarray, f, watcher: TransitionWatcher, looks: np.ndarray,
           adaptive: bool = False) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """The watcher's events when it looks at `looks` (the last one final), the series logged on
    `schedule` (values `f(steps)`) and, with `adaptive`, also at the watcher's dense steps while
    it asks for them; and the series logged."""
    last = int(looks[-1])
    watcher.plan(last)
    on_schedule = set(int(s) for s in schedule)
    steps: list[int] = []
    events: list[dict] = []
    look_at = set(int(x) for x in looks)
    for k in range(1, last + 1):
        if k in on_schedule or (adaptive and watcher.dense_now(k)):
            steps.append(k)
        if k in look_at:
            s = np.array(steps)
            events += watcher.update({"x": (s, values_at(f, s))}, k, final=k == last)
    s = np.array(steps)
    return events, s, values_at(f, s)


def values_at(f, steps: np.ndarray) -> np.ndarray:
    """f's values at steps, each step's value drawn once (the noise stays put as the series grows)."""
    memo = f.__dict__.setdefault("memo", {})
    new = [int(s) for s in steps if int(s) not in memo]
    if new:
        memo.update(zip(new, f(np.array(new, dtype=float))))
    return np.array([memo[int(s)] for s in steps])


def matches(event: dict, t: dict, steps) -> bool:
    """A live event is the offline transition `t` (same metric and direction): a confirmed one
    when one's midpoint lies within the other's span, widened to the series' logged `steps`
    around it (`_refit`: the watcher's own test of one change fitted twice); an onset when it
    began by t's end and no earlier than one 10-90% width of t before its onset, in log-step
    (where a logistic is at ~0.1% of its change), or `SAME` x before it, whichever is earlier: a
    departure is seen at the first point that left the trend, which can come before the fitted
    10% point. An event of another change of the series, before or after, is not t's."""
    if event["metric"] != t["metric"] or event["direction"] != t["direction"]:
        return False
    if event.get("stage", "confirmed") == "confirmed":
        return _refit(event, t, steps)
    return min(t["onset"] / SAME, t["onset"] ** 2 / t["end"]) <= event["onset"] <= t["end"]


def score(truth: list[dict], events: list[dict], steps: dict) -> list[dict]:
    """Per offline transition: the first onset event that `matches` it, its step / midpoint; the
    first confirmed one, its step / end (`steps`: each metric's logged steps)."""
    rows = []
    for t in truth:
        mine = [e for e in events if e.get("stage") != "withdrawn" and matches(e, t, steps[t["metric"]])]
        onset = next((e["detected_at"] for e in mine if e.get("stage") == "onset"), None)
        confirmed = next((e["detected_at"] for e in mine if e.get("stage", "confirmed") == "confirmed"), None)
        rows.append({"metric": t["metric"], "midpoint": t["midpoint"], "end": t["end"],
                     "onset_at": onset, "onset/mid": None if onset is None else onset / t["midpoint"],
                     "confirmed_at": confirmed, "confirmed/end": None if confirmed is None else confirmed / t["end"]})
    return rows


def unfound(truth: list[dict], events: list[dict], steps: dict) -> int:
    """Confirmed events that match no transition of the finished series (e.g. the start of a
    slow change confirmed as a small one of its own before the rest came)."""
    return sum(not any(matches(e, t, steps[e["metric"]]) for t in truth)
               for e in events if e.get("stage", "confirmed") == "confirmed")


def summary(rows: list[dict], withdrawn: list[dict], label: str, extra: int = 0) -> str:
    n = len(rows)
    early = sum(r["onset/mid"] is not None and r["onset/mid"] < 1 for r in rows)
    conf = [r["confirmed/end"] for r in rows if r["confirmed/end"] is not None]
    by = sum(c <= 1.2 for c in conf)
    med = f"{np.median(conf):.2f}" if conf else "-"
    onsets = [r["onset/mid"] for r in rows if r["onset/mid"] is not None]
    omed = f"{np.median(onsets):.2f}" if onsets else "-"
    late = sum(e.get("reason") == "training ended" for e in withdrawn)
    return (f"| {label} | {n} | {early}/{n} | {omed} | {by}/{n} | {med} | {len(conf)}/{n} | "
            f"{len(withdrawn) - late} / {late} | {extra} |")


HEADER = ("| series | transitions | onset before midpoint | median onset / midpoint | confirmed by 1.2 x end "
          "| median confirmed / end | confirmed at all | withdrawn onsets (not found again / training ended) "
          "| confirmed, not found offline |\n"
          "|---|---|---|---|---|---|---|---|---|")


def synthetic(seeds: int) -> None:
    print("## Synthetic series\n")
    settings = {"today": dict(), "no departure test": dict(departures=False),
                "previous": dict(settle=1.5, points_after=3, dense=False, departures=False)}
    for schedule_name, schedule in (("every 25 steps", DENSE), ("60 log-spaced steps", LOG60)):
        print(f"### logged {schedule_name}, a look at every validation (every 25 steps)"
              f"{' (today: with adaptive resolution)' if schedule is LOG60 else ''}\n")
        print(HEADER)
        for kind in KINDS:
            results = {name: ([], [], 0) for name in settings}
            for seed in range(seeds):
                for this, f in shapes(seed):
                    if this != kind:
                        continue
                    for setting, kwargs in settings.items():
                        watcher = TransitionWatcher(**kwargs)
                        looks = DENSE[3::4] if setting == "previous" else DENSE
                        events, steps, values = replay(schedule, f, watcher, looks, adaptive=schedule is LOG60)
                        truth = detect_transitions(steps, values, "x")
                        if setting == "previous":
                            events = [e for e in events if e["stage"] == "confirmed"]
                        rows, withdrawn, extra = results[setting]
                        rows += score(truth, events, {"x": steps})
                        results[setting] = (rows, withdrawn + [e for e in events if e["stage"] == "withdrawn"],
                                            extra + unfound(truth, events, {"x": steps}))
            for setting, (rows, withdrawn, extra) in results.items():
                print(summary(rows, withdrawn, f"{kind}, {setting}", extra))
        print(f"\nAn ideal test (the drop's shape, the level before it and the noise known; 5 standard "
              f"errors) could say {ceiling(schedule)} of the {len(DROPS)} single drops of a seed before "
              f"their midpoint on this schedule.\n")


def real(configs: list[str], steps: int, out: Path) -> None:
    print("## Real runs\n")
    rows_all = []
    for config in configs:
        for dense in (True, False):
            run = out / f"{config}-{'dense' if dense else 'schedule'}"
            if not (run / "metrics.jsonl").exists():
                cmd = [sys.executable, "-m", "phasewatch", "fit", "--config", f"configs/{config}.yaml", "--no_wandb",
                       "--run_dir", str(run), "--trainer.max_steps", str(steps), "--transitions.dense", str(dense).lower(),
                       "--trainer.enable_progress_bar", "false"]
                start = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                (run / "bench_wall_s").write_text(f"{time.perf_counter() - start:.1f}")
            folder = RunFolder(run)
            series, truth = offline(run)
            events = list(folder.read_events())
            logged = {k: s for k, (s, v) in series.items()}
            rows = score(truth, events, logged)
            ckpts = [int(p.stem.split("=")[1]) for p in folder.checkpoints.glob("step=*.ckpt")]
            for r, t in zip(rows, truth):
                s = series[t["metric"]][0]
                r["points"] = int(sum(t["onset"] <= x <= t["end"] for x in s))
                r["before_mid"] = int(sum(t["onset"] <= x < t["midpoint"] for x in s))
                r["checkpoints"] = sum(t["onset"] <= x <= t["end"] for x in ckpts)
            withdrawn = [e for e in events if e.get("stage") == "withdrawn"]
            rows_all.append((config, dense, rows, withdrawn, float((run / "bench_wall_s").read_text()),
                             unfound(truth, events, logged)))
    print(HEADER)
    for config, dense, rows, withdrawn, _, extra in rows_all:
        print(summary(rows, withdrawn, f"{config}, adaptive {'on' if dense else 'off'}", extra))
    print("\n| run | wall time (s) | transitions | with >= 8 probe points / checkpoints inside "
          "| median points / checkpoints inside | onset before midpoint, of those with >= 2 points "
          "from onset to midpoint |\n|---|---|---|---|---|---|")
    for config, dense, rows, _, wall, _ in rows_all:
        n = len(rows)
        probe = [r for r in rows if not r["metric"].startswith(("train/", "val/"))]
        eight_p = sum(r["points"] >= 8 for r in probe)
        eight_c = sum(r["checkpoints"] >= 8 for r in rows)
        mp = np.median([r["points"] for r in probe]) if probe else float("nan")
        mc = np.median([r["checkpoints"] for r in rows]) if rows else float("nan")
        seen = [r for r in rows if r["before_mid"] >= 2]  # a live test can say something before the midpoint
        early = sum(r["onset/mid"] is not None and r["onset/mid"] < 1 for r in seen)
        print(f"| {config}, adaptive {'on' if dense else 'off'} | {wall:.0f} | {n} ({len(probe)} of probes) | "
              f"{eight_p}/{len(probe)} / {eight_c}/{n} | {mp:.0f} / {mc:.0f} | {early}/{len(seen)} |")
    with open(out / "rows.json", "w") as f:
        json.dump([{"config": c, "dense": d, "rows": r} for c, d, r, *_ in rows_all], f, indent=1, default=str)


def offline(run: Path) -> tuple[dict, list[dict]]:
    """A finished run folder's watched series ({key: (steps, values)}, every series but the
    detail keys) and the transitions the offline detector finds in them."""
    series = {k: (np.asarray(s), np.asarray(v)) for k, (s, v) in RunFolder(run).series().items() if not is_detail(k)}
    return series, [e for k, (s, v) in series.items() for e in detect_transitions(s, v, k)]


def replay_folder(run: Path, watcher: TransitionWatcher) -> tuple[list[dict], list[dict], dict]:
    """A finished run folder's watched series replayed look by look through `watcher`, a look at
    every validation (the steps of `val/loss`; the last one final): its events, the offline
    transitions of the finished series (`offline`), and each series' logged steps."""
    series, truth = offline(run)
    looks = series["val/loss"][0]
    watcher.plan(int(looks[-1]))
    events = []
    for look in looks:
        cut = {k: (s[s <= look], v[s <= look]) for k, (s, v) in series.items() if (s <= look).any()}
        events += watcher.update(cut, int(look), final=look == looks[-1])
    return events, truth, {k: s for k, (s, v) in series.items()}


#: the departure test's bars that `frontier` tries (None: no departure test)
BARS = (5.0, 6.0, 7.0, 8.0, 10.0, None)


def frontier(configs: list[str], out: Path) -> None:
    """Onsets before the midpoint against false starts, for departure tests of other bars: the
    real runs with adaptive resolution on (run by `real` into `out`) replayed through the
    watcher with each bar in `BARS`. A replay keeps the series the run logged, so the steps
    that adaptive resolution added are those of the run with today's bar (5)."""
    print("## Real runs replayed with other departure bars\n")
    print(HEADER.replace("| series |", "| series | departure bar |").replace("|---|", "|---|---|", 1))
    for bar in BARS:
        for config in configs:
            watcher = TransitionWatcher(departures=bar is not None, departure_z=bar or 5.0)
            events, truth, logged = replay_folder(out / f"{config}-dense", watcher)
            withdrawn = [e for e in events if e.get("stage") == "withdrawn"]
            row = summary(score(truth, events, logged), withdrawn, config, unfound(truth, events, logged))
            print(row.replace(f"| {config} |", f"| {config} | {'none' if bar is None else f'{bar:g}'} |", 1))


class _Console:
    """What `_stage_line` reads of a trainer (a replay has none)."""
    member = None


def watched(run: Path) -> dict:
    """A run folder's watched series ({key: (steps, values)}: every series but the detail keys)."""
    return {k: (np.asarray(s), np.asarray(v)) for k, (s, v) in RunFolder(run).series().items() if not is_detail(k)}


def look_steps(series: dict, looks: str, watcher: TransitionWatcher) -> list[int]:
    """The steps a replay looks at (`--looks`, module docstring); the last logged step last."""
    last = int(max(s.max() for s, _ in series.values()))
    if looks == "validations":
        steps = series["val/loss"][0]
    elif looks == "logged":
        steps = np.unique(np.concatenate([s for s, _ in series.values()]))
    else:
        steps = [s for s in watcher.look_steps(last, [int(x) for x in series["val/loss"][0]]) if s <= last]
    return sorted({int(x) for x in steps if x > 0} | {last})


def stage_replay(run: Path, looks: str = "validations", **settings) -> dict:
    """A finished run replayed look by look through the watcher's stage news: {"news": [(step,
    what, stage)], "lines": the default console lines, "looks": the number of looks, "offline":
    the finished series' stages}."""
    series = watched(run)
    watcher = TransitionWatcher(**settings)
    steps = look_steps(series, looks, watcher)
    validations = [int(x) for x in series["val/loss"][0]]
    watcher.plan(steps[-1], len(steps), len(watcher.look_steps(steps[-1], validations, grid=False)))
    news, lines = [], []
    for look in steps:
        final = look == steps[-1]
        cut = {k: (s[s <= look], v[s <= look]) for k, (s, v) in series.items() if (s <= look).any()}
        watcher.update(cut, look, final=final)
        for what, stage in watcher.stage_news(cut, look, final):
            news.append((look, what, stage))
            lines.append(_stage_line(_Console(), look, what, stage, cut, watcher.begun_as(what, stage)))
    return {"news": news, "lines": lines, "looks": len(steps), "offline": series_stages(series, stage_rules())}


def _moved(stage) -> set:
    return {(m["series"], m["direction"]) for m in stage.members}


def _match(live, truth) -> bool:
    """A live stage is about an offline one: a moved series (and direction) in common, spans overlapping."""
    return bool(_moved(live) & _moved(truth)) and live.onset <= truth.end and truth.onset <= live.end


def stage_scores(result: dict) -> list[dict]:
    """Per offline stage: the first live news (begins or confirmed) of a stage that shares a
    moved series (and direction) with it and overlaps it in steps, over its midpoint, counted
    only when it held: that stage (its id) was later confirmed, and confirmed as one that still
    matches the offline stage (a stage said to begin and then withdrawn, taken up by another
    or confirmed as something else claimed nothing that held; "said, any": every such news);
    the first confirmation of such a stage, over its end (None when none)."""
    held = {}  # live stage id -> its first confirmation
    for step, what, live in result["news"]:
        if what == "confirmed":
            held.setdefault(live.id, live)
    rows = []
    for truth in result["offline"]:
        mine = [(step, what, live) for step, what, live in result["news"] if what != "withdrawn" and _match(live, truth)]
        said = min((step for step, _, live in mine if live.id in held and _match(held[live.id], truth)), default=None)
        any_said = min((step for step, _, _ in mine), default=None)
        confirmed = min((step for step, what, _ in mine if what == "confirmed"), default=None)
        rows.append({"stage": truth.name or "(unnamed)", "onset": truth.onset, "midpoint": truth.midpoint,
                     "end": truth.end, "said": said, "said/mid": None if said is None else said / truth.midpoint,
                     "said, any": any_said,
                     "confirmed": confirmed, "confirmed/end": None if confirmed is None else confirmed / truth.end})
    return rows


STAGE_HEADER = ("| runs | looks | offline stages | said before midpoint (any) | median said / midpoint | "
                "confirmed by 1.2 x end | median confirmed / end | withdrawn stages per run (max) | "
                "runs with <= 1 withdrawn | lines per offline stage (default console) | live stages confirmed | "
                "named offline: confirmed live under that name (live names it has not) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def stage_summary(label: str, results: list[dict]) -> str:
    """One row of `STAGE_HEADER` over the replays of several runs."""
    rows = [r for result in results for r in stage_scores(result)]
    n = len(rows)
    said = [r["said/mid"] for r in rows if r["said/mid"] is not None]
    anyhow = sum(r["said, any"] is not None and r["said, any"] < r["midpoint"] for r in rows)
    conf = [r["confirmed/end"] for r in rows if r["confirmed/end"] is not None]
    withdrawn = [sum(what == "withdrawn" for _, what, _ in result["news"]) for result in results]
    lines = sum(len(result["lines"]) for result in results)
    live = sum(what == "confirmed" for result in results for _, what, _ in result["news"])
    named, kept, other = np.sum([offline_names(result) for result in results], axis=0)
    looks = np.median([result["looks"] for result in results])
    med = lambda x: f"{np.median(x):.2f}" if x else "-"  # noqa: E731
    return (f"| {label} | {looks:.0f} | {n} | {sum(x < 1 for x in said)}/{n} ({anyhow}) | {med(said)} | "
            f"{sum(x <= 1.2 for x in conf)}/{n} | {med(conf)} | {np.mean(withdrawn):.1f} ({max(withdrawn)}) | "
            f"{sum(w <= 1 for w in withdrawn)}/{len(results)} | {lines / max(n, 1):.1f} | {live} | {kept}/{named} ({other}) |")


def offline_names(result: dict) -> tuple[int, int, int]:
    """The offline stages with a name; of them, those a live stage about them (`_match`) was
    confirmed under; and the live stages confirmed with a name that no offline stage they are about
    has (the offline answer names them otherwise, or not at all)."""
    confirmed = {stage.id: stage for _, what, stage in result["news"] if what == "confirmed"}
    named = [t for t in result["offline"] if t.name]
    kept = sum(any(s.name == t.name and _match(s, t) for s in confirmed.values()) for t in named)
    other = sum(not any(t.name == s.name and _match(s, t) for t in result["offline"])
                for s in confirmed.values() if s.name)
    return len(named), kept, other


def name_checks(result: dict) -> dict:
    """What a replay's stage lines claimed, against what was confirmed: the stages named at
    "begins" ("so far"), of them those confirmed under another name, the confirmed stages whose
    lead changed from the one "begins" said, and the names confirmed for more than one stage."""
    begun, confirmed = {}, {}
    for _, what, stage in result["news"]:
        if what == "begins":
            begun.setdefault(stage.id, stage)
        elif what == "confirmed":
            confirmed[stage.id] = stage
    named = [k for k, s in begun.items() if s.name]
    names = [s.name for s in confirmed.values() if s.name]
    return {"named at begins": len(named),
            "renamed when confirmed": sum(k in confirmed and confirmed[k].name != begun[k].name for k in named),
            "lead changed": sum(confirmed[k].lead != s.lead for k, s in begun.items() if k in confirmed),
            "names confirmed twice": len(names) - len(set(names))}


def members(run: Path) -> list[Path]:
    """A run folder, or a population's member folders (those with metrics)."""
    if (run / "metrics.jsonl").exists():
        return [run]
    return sorted(p for p in run.iterdir() if (p / "metrics.jsonl").exists())


def stages_table(runs: list[Path], looks: list[str], show: bool = False, lines: bool = False,
                 settles: list[float] | None = None) -> None:
    """`--stages`: a row per run (population), look schedule and `settles` factor (the watcher's
    `settle`: a change confirmed once the run is at that multiple of its end; None: its default)
    (`stage_summary`); `show`: each offline stage's scores and each run's `name_checks`; `lines`:
    each run's stage lines."""
    print("## Stages, live against offline\n")
    print(STAGE_HEADER)
    for run in runs:
        for schedule, settle in ((s, f) for s in looks for f in settles or [None]):
            results = [stage_replay(m, schedule, **({} if settle is None else {"settle": settle})) for m in members(run)]
            label = f"{run.name} ({len(results)}), {schedule}" + ("" if settle is None else f", settle {settle:g}")
            print(stage_summary(label, results), flush=True)
            for m, result in zip(members(run), results):
                if show:
                    for r in stage_scores(result):
                        print(f"    {m.name} {r}")
                    print(f"    {m.name} {name_checks(result)}")
                if lines:
                    print("\n".join(f"    {m.name} {line}" for line in result["lines"]))


def early_fit(config: str, k: int, run: Path, flags: list[str], calls: bool = False) -> dict:
    """One `phasewatch fit` of `config` logging densely early with `transitions.logs_per_doubling
    k` (0: every `log_every_n_steps` only), in a process of its own: its CPU time (user + system),
    wall time, what it logged and ran (training-loss rows and probe runs, a population's first
    member's; checkpoints, all members'), its console stage lines, and with `calls` its Python
    function calls (cProfile, the whole process)."""
    import resource

    prof = run.with_suffix(".prof")
    cmd = [sys.executable, *(["-m", "cProfile", "-o", str(prof)] if calls else []), "-m", "phasewatch", "fit",
           "--config", f"configs/{config}.yaml", "--no_wandb", "--run_dir", str(run),
           "--trainer.enable_progress_bar", "false", "--transitions.logs_per_doubling", str(k), *flags]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    (run / "console.txt").write_text(out)
    rows = [json.loads(line) for line in (members(run)[0] / "metrics.jsonl").read_text().splitlines() if line.strip()]
    probed = {r["step"] for r in rows if any(not key.startswith(("train/", "val/", "lr", "step", "epoch", "time"))
                                            for key in r)}
    result = {"config": config, "k": k, "flags": flags, "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
              "wall": wall, "train rows": sum("train/loss" in r for r in rows), "probe steps": len(probed),
              "checkpoints": len(list(run.rglob("*.ckpt"))),
              "stage lines": sum(": stage " in line or ": confirmed " in line for line in out.splitlines())}
    if calls:
        import pstats

        result["calls"] = pstats.Stats(str(prof)).total_calls
    return result


def early_cost(configs: list[str], ks: list[int], repeats: int, out: Path, calls: bool, flags: list[str]) -> None:
    """`--early`: fits of each config at each `ks` (`early_fit`), the ks alternated (their order
    rotated each repeat), then with `calls` one profiled fit each; per config, each k's median
    CPU time and calls against the first k's, measured in this one process."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for repeat in range(repeats):
        order = ks[repeat % len(ks):] + ks[:repeat % len(ks)]
        for config in configs:
            for k in order:
                run = out / f"{config}-k{k}-r{repeat}"
                results.append(early_fit(config, k, run, flags))
                print(json.dumps(results[-1]), flush=True)
    if calls:
        for config in configs:
            for k in ks:
                results.append(early_fit(config, k, out / f"{config}-k{k}-calls", flags, calls=True))
                print(json.dumps(results[-1]), flush=True)
    print("\n| config | logs_per_doubling | training-loss rows | probe steps | checkpoints | stage lines "
          "| CPU s (median) | CPU ratio | Python calls | calls ratio |\n|---|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        mine = [r for r in results if r["config"] == config]
        cpu = {k: float(np.median([r["cpu"] for r in mine if r["k"] == k and "calls" not in r])) for k in ks}
        n = {k: next((r["calls"] for r in mine if r["k"] == k and "calls" in r), None) for k in ks}
        for k in ks:
            first = next(r for r in mine if r["k"] == k)
            ratio = f"{n[k] / n[ks[0]]:.3f}" if n[k] and n[ks[0]] else "-"
            print(f"| {config} | {k} | {first['train rows']} | {first['probe steps']} | {first['checkpoints']} | "
                  f"{first['stage lines']} | {cpu[k]:.1f} | {cpu[k] / cpu[ks[0]]:.2f} | {n[k] or '-'} | {ratio} |")
    with open(out / "early.json", "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--real", nargs="*", default=["quickstart", "induction_2l", "digit_addition"])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("/tmp/live_latency"))
    parser.add_argument("--no-synthetic", action="store_true")
    parser.add_argument("--frontier", action="store_true",
                        help="also replay the real runs with other departure bars (onsets against false starts)")
    parser.add_argument("--stages", nargs="+", type=Path, default=None,
                        help="replay these finished runs (or populations) through the watcher's stage news")
    parser.add_argument("--looks", nargs="+", default=["validations", "watcher"],
                        choices=["validations", "watcher", "logged"], help="the look schedules --stages replays")
    parser.add_argument("--show", action="store_true",
                        help="with --stages: every offline stage's row, and what each run's lines claimed")
    parser.add_argument("--lines", action="store_true", help="with --stages: every run's stage lines")
    parser.add_argument("--settle", nargs="+", type=float, default=None,
                        help="with --stages: replay with each of these confirmation waits (x a change's end)")
    parser.add_argument("--early", nargs="+", type=int, default=None,
                        help="fits of --configs at these transitions.logs_per_doubling, alternated: what logging densely early costs")
    parser.add_argument("--configs", nargs="+", default=["quickstart_tiny", "induction_tiny"], help="with --early")
    parser.add_argument("--repeats", type=int, default=2, help="with --early: fits per config and K")
    parser.add_argument("--calls", action="store_true", help="with --early: also one profiled fit each (Python calls)")
    parser.add_argument("--fit-flags", default="", help='with --early: more flags for every fit, one string (--fit-flags="--trainer.max_steps 300")')
    args = parser.parse_args()
    if args.early:
        early_cost(args.configs, args.early, args.repeats, args.out, args.calls, args.fit_flags.split())
        return
    if args.stages:
        stages_table(args.stages, args.looks, args.show, args.lines, args.settle)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_synthetic:
        synthetic(args.seeds)
    if args.real:
        real(args.real, args.steps, args.out)
        if args.frontier:
            frontier(args.real, args.out)


if __name__ == "__main__":
    main()

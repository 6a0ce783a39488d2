"""The restricted loss's lead over the test loss on grokking runs, read from their run folders.

For each run folder (a population's folder stands for its members), as the report measures it
(report/html.py `build_report`): the run's confirmed transitions (the live watcher's, from
events.jsonl; the offline detector's on the watcher's scales when there are none), `lead_lag`
against the test loss's principal transition (phases/detector.py `principal`: its largest change
on its own scale, in decades for a loss): the restricted loss's row, and the same with its rises
left out (the lead of its fall). Printed per run: the test loss's confirmed falls (bold: the one
that takes it below 1, its grokking drop), the two rows, the restricted loss's falls after
memorisation (train accuracy first >= 0.99) with the step the watcher confirmed each
(`detected_at`; "end": only at the last look), and the first steps with restricted < 0.1 and
test < 1; then each lead's distribution over runs and how often the principal transition is the
grokking drop. Reads only.

    python bench/grokking_lead.py RUN_DIR...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from phasewatch.phases.detector import detect_all, lead_lag, principal
from phasewatch.probes.keys import declared_scale, is_detail
from phasewatch.report.population import is_population
from phasewatch.rundir import RunFolder, flatten_config, load_series, run_folders

REFERENCE, RESTRICTED, TRAIN_ACC = "val/loss", "grok/restricted_loss", "train/acc"
MEMORISED = 0.99  # train accuracy from which the run has memorised its training set
THRESHOLDS = {RESTRICTED: 0.1, REFERENCE: 1.0}  # the levels docs/grokking.md reads off


def members(paths: list[str]) -> list[RunFolder]:
    """The run folders named, a population's folder replaced by its members."""
    return [m for p in paths for m in (run_folders(p) if is_population(p) else [RunFolder(p)])]


def report_events(folder: RunFolder, series: dict) -> list[dict]:
    """The transitions the report bands and measures lead/lag on (as `build_report` takes them)."""
    watched = {k: v for k, v in series.items() if not is_detail(k)}
    return folder.transitions() or detect_all(watched, declared=declared_scale)


def first_step(series: dict, key: str, test) -> int | None:
    steps, values = series.get(key, ((), ()))
    return next((int(s) for s, v in zip(steps, values) if test(v)), None)


def measure(folder: RunFolder) -> dict:
    """One run's row (see the module docstring)."""
    series = load_series(folder.root)
    events = report_events(folder, series)
    config = flatten_config(folder.read_config(), fold_init_args=True)
    last = int(max(series[REFERENCE][0]))
    rises = [e for e in events if e["metric"] == RESTRICTED and e["direction"] == "up"]
    memorised = first_step(series, TRAIN_ACC, lambda v: v >= MEMORISED)
    falls = [e for e in events if e["metric"] == RESTRICTED and e["direction"] == "down"]
    test_falls = [e for e in events if e["metric"] == REFERENCE and e["direction"] == "down"]
    below = {k: first_step(series, k, lambda v, bar=bar: v < bar) for k, bar in THRESHOLDS.items()}
    return {
        "run": str(folder.root), "seed": config.get("seed_everything"), "data_seed": config.get("data.task.seed"),
        "last": last, "memorised": memorised, "test_falls": test_falls, "below": below,
        # the test loss's fall that takes it below 1 (its grokking drop), if one does
        "grokking": next((e for e in test_falls if below[REFERENCE] is not None
                          and e["onset"] <= below[REFERENCE] <= e["end"]), None),
        "principal": principal(events, REFERENCE, *series[REFERENCE]),
        "row": _row(events, series),
        # the same measure with the restricted loss's rises left out: the lead of its fall
        "fall_row": _row([e for e in events if not any(e is r for r in rises)], series),
        "circuit_falls": [e for e in falls if memorised is not None and e["midpoint"] > memorised],
    }


def _row(events: list[dict], series: dict) -> dict | None:
    """The report's lead/lag row of the restricted loss (None when it has none), with its transition."""
    row = next((r for r in lead_lag(events, REFERENCE, series[REFERENCE]) if r["metric"] == RESTRICTED), None)
    if row is None:
        return None
    return {**row, "event": next(e for e in events if e["metric"] == RESTRICTED and e["midpoint"] == row["midpoint"]
                                 and e["direction"] == row["direction"])}


def span(e: dict, last: int | None = None) -> str:
    text = f"{e['onset']}-{e['midpoint']}-{e['end']}"
    if last is not None and "detected_at" in e:
        text += f" @{'end' if e['detected_at'] >= last else e['detected_at']}"
    return text


def quartiles(values: list[float]) -> str:
    if not values:
        return "none"
    q = np.percentile(values, [0, 25, 50, 75, 100])
    return " / ".join(f"{x:.0f}" for x in q)


def _against(row: dict | None) -> str:
    if row is None:
        return "none"
    return f"{row['direction']} {span(row['event'])} vs {row['reference_direction']} mid {row['reference_midpoint']}"


def _leads(row: dict | None) -> str:
    return f"{row['lead']} / {row['onset_lead']}" if row else ""


def tables(runs: list[dict]) -> str:
    """The per-run table and the distribution, as markdown."""
    out = ["| seed (data) | test loss falls | report's row: restricted loss vs test loss | lead mid / onset "
           "| the same, its falls only | lead mid / onset | restricted falls after memorisation (step), "
           "@confirmed | restricted < 0.1 / test < 1 |", "| --- " * 8 + "|"]
    for r in runs:
        out.append(" | ".join([
            f"| {r['seed']} ({r['data_seed']})",
            ", ".join(("**" + span(e) + "**") if e is r["grokking"] else span(e) for e in r["test_falls"]) or "none",
            _against(r["row"]), _leads(r["row"]), _against(r["fall_row"]), _leads(r["fall_row"]),
            f"({r['memorised']}) " + (", ".join(span(e, r["last"]) for e in r["circuit_falls"]) or "none"),
            f"{r['below'][RESTRICTED]} / {r['below'][REFERENCE]}"]) + " |")
    live = [r for r in runs if any(e.get("detected_at", r["last"]) < r["last"] for e in r["circuit_falls"])]
    grokked = [r for r in runs if r["grokking"]]
    ahead = [r for r in grokked if r["circuit_falls"]
             and min(e["onset"] for e in r["circuit_falls"]) < r["grokking"]["onset"]]
    out += ["", "| over runs | n | min / q1 / median / q3 / max | > 0 |", "| --- | --- | --- | --- |"]
    for name, values in (
            ("report's row: lead, midpoints", [r["row"]["lead"] for r in runs if r["row"]]),
            ("report's row: lead, onsets", [r["row"]["onset_lead"] for r in runs if r["row"]]),
            ("falls only: lead, midpoints", [r["fall_row"]["lead"] for r in runs if r["fall_row"]]),
            ("falls only: lead, onsets", [r["fall_row"]["onset_lead"] for r in runs if r["fall_row"]]),
            ("grokking drop's onset minus the first fall's after memorisation",
             [r["grokking"]["onset"] - min(e["onset"] for e in r["circuit_falls"]) for r in grokked if r["circuit_falls"]]),
            ("test < 1 minus restricted < 0.1 (steps)",
             [r["below"][REFERENCE] - r["below"][RESTRICTED] for r in runs if None not in r["below"].values()])):
        out.append(f"| {name} | {len(values)} of {len(runs)} | {quartiles(values)} | {sum(v > 0 for v in values)} |")
    principal_drop = [r for r in grokked if r["principal"] is r["grokking"]]
    out += ["", f"runs with a restricted-loss fall after memorisation confirmed live (before the last step): "
            f"{len(live)} of {len(runs)}; with a grokking drop (bold: the test loss's fall that takes it below 1): "
            f"{len(grokked)}, in {len(ahead)} of which a restricted-loss fall after memorisation began before it; "
            f"in {len(principal_drop)} of which that drop is the test loss's principal transition "
            "(the one the report's rows are against)"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    args = parser.parse_args(argv)
    folders = members(args.run_dirs)
    if not folders:
        print("no run folders in " + ", ".join(args.run_dirs), file=sys.stderr)
        return 1
    print(tables([measure(f) for f in folders]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The live watcher's stage news on finished runs, replayed look by look.

    python bench/stages_live.py RUN_DIR [RUN_DIR ...] [--lines]

Each run folder's watched series (every series but detail keys) are replayed through
`TransitionWatcher` at every validation step (the steps of `val/loss`, the last look final),
calling `update` and `stage_news` as a fit does. Per stage said: when it was first said to
begin and under which name, when it was confirmed and under which name, whether the
confirmed stage has the lead and the name the "begins" line said (a name said "so far"), and, against the finished
run's stages (`run_stages`, the offline answer; matched by most shared series), whether it
began before that stage's midpoint and was confirmed by 1.2 x its end. Per run: stages said,
withdrawn, the console lines by default (the stage lines: per-series lines only with
`--transitions.verbose`) per confirmed stage, stages named at "begins" and how many of them were confirmed under another
name, leads that changed, and names confirmed for two stages. Prints markdown; `--lines` also prints the lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import phasewatch.probes  # noqa: E402,F401  (the probes' declarations)
from phasewatch.callbacks.transitions import TransitionWatcher, _stage_line  # noqa: E402
from phasewatch.phases.stages import run_stages  # noqa: E402
from phasewatch.probes.keys import is_detail, stage_rules  # noqa: E402
from phasewatch.rundir import RunFolder  # noqa: E402


class _Quiet:
    member = None


def replay(run: Path) -> dict:
    """One run's stage news, look by look: {"news": [(step, what, stage)], "lines": [...],
    "stages": the watcher's last stages, "offline": run_stages}."""
    folder = RunFolder(run)
    series = {k: (np.asarray(s), np.asarray(v)) for k, (s, v) in folder.series().items() if not is_detail(k)}
    looks = series["val/loss"][0]
    watcher = TransitionWatcher()
    watcher.plan(int(looks[-1]))
    news, lines = [], []
    for look in looks:
        final = look == looks[-1]
        cut = {k: (s[s <= look], v[s <= look]) for k, (s, v) in series.items() if (s <= look).any()}
        watcher.update(cut, int(look), final=final)
        for what, stage in watcher.stage_news(cut, int(look), final):
            news.append((int(look), what, stage))
            lines.append((int(look), "stage", _stage_line(_Quiet(), int(look), what, stage, cut)))
    return {"news": news, "lines": lines, "stages": watcher.stages, "offline": run_stages(folder, stage_rules())}


def _series(stage) -> set:
    return {m["series"] for m in stage.members}


def judge(result: dict) -> list[dict]:
    """Per stage said: the rows of the table (module docstring)."""
    rows = {}
    for step, what, stage in result["news"]:
        row = rows.setdefault(stage.id, {"id": stage.id})
        if what == "begins" and "begins" not in row:
            row.update(begins=step, begins_name=stage.name, begins_lead=stage.lead)
        elif what == "confirmed":
            row.update(confirmed=step, name=stage.name, series=_series(stage), lead=stage.lead)
        elif what == "withdrawn":
            row["withdrawn"] = step
    for row in rows.values():
        if "series" not in row:
            continue
        match = max(result["offline"], key=lambda s: len(_series(s) & row["series"]), default=None)
        if match is not None and _series(match) & row["series"]:
            first = row.get("begins", row["confirmed"])
            row.update(offline=match.name, early=first < match.midpoint, on_time=row["confirmed"] <= 1.2 * match.end)
    return sorted(rows.values(), key=lambda r: r["id"])


def table(runs: list[Path], show_lines: bool) -> str:
    out = ["| run | stage | begins (name) | confirmed (name) | offline name | begun before midpoint | "
           "confirmed by 1.2 x end | lead kept |", "|---|---|---|---|---|---|---|---|"]
    totals = []
    for run in runs:
        result = replay(run)
        rows = judge(result)
        for r in rows:
            out.append(f"| {run.name} | {r['id']} | {r.get('begins', '-')} ({r.get('begins_name')}) | "
                       f"{r.get('confirmed', 'withdrawn')} ({r.get('name')}) | {r.get('offline', '-')} | "
                       f"{r.get('early', '-')} | {r.get('on_time', '-')} | "
                       f"{r['begins_lead'] == r['lead'] if 'begins' in r and 'series' in r else '-'} |")
        confirmed = [r for r in rows if "series" in r]
        named = [r for r in confirmed if r.get("begins_name")]
        names = [r["name"] for r in confirmed if r["name"]]
        totals.append((run.name, len(rows), sum("withdrawn" in r for r in rows), len(confirmed), len(result["lines"]),
                       len(named), sum(r["begins_name"] != r["name"] for r in named),
                       sum(r["begins_lead"] != r["lead"] for r in confirmed if "begins" in r), len(names) - len(set(names))))
        if show_lines:
            out += [f"    {step} {kind}: {text}" for step, kind, text in result["lines"]]
    out += ["", "| run | stages said | withdrawn | confirmed | console lines (default) | lines per confirmed stage | "
            "named at begins | of them renamed when confirmed | lead changed | names confirmed twice |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {n} | {said} | {w} | {c} | {lines} | {lines / max(c, 1):.1f} | {nb} | {rn} | {lc} | {dup} |"
            for n, said, w, c, lines, nb, rn, lc, dup in totals]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--lines", action="store_true", help="print the console lines too")
    args = parser.parse_args()
    print(table(args.runs, args.lines))


if __name__ == "__main__":
    main()

"""Cross-run table (`phasewatch compare`): each run's hyperparameters, the midpoint steps of
its headline transitions (detected offline, phases/detector.py) and its stages
(phases/stages.py), for a sweep folder, a population or runs given one by one; runs that
differ only in seeds are grouped into distributions (median, quartiles, extremes) and how
many share a stage sequence. Writes `<out>.csv` and `<out>.png`. Details: docs/report.md
("Comparing runs"), docs/stages.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from phasewatch.probes.keys import headline_keys
from phasewatch.rundir import RunFolder, Series, SweepFolder, csv_cell as _cell, flatten_config, run_folders, write_csv

IGNORED_CONFIG = ("run_dir", "checkpoints.dirpath", "ckpt_path")
#: the rows compare adds per group of runs that differ only in seeds (a population, or a sweep's seeds)
STATISTICS = ("n", "median", "q25", "q75", "min", "max")
#: each named stage's columns: `stage <name> <boundary>`
BOUNDARIES = ("onset", "midpoint", "end")


def is_seed(key: str) -> bool:
    """Whether a config key only seeds randomness (initialisation, data): runs that differ in
    nothing else are samples of one distribution."""
    return key == "seed_everything" or key.endswith(".seed")


def find_runs(paths: list[str | os.PathLike]) -> list[tuple[Path, dict[str, Any]]]:
    """(run folder, sweep record or {}) for each run folder given or inside a sweep folder."""
    runs: list[tuple[Path, dict[str, Any]]] = []
    for path in map(Path, paths):
        sweep = SweepFolder(path)
        if sweep.is_sweep():
            for record in sweep.read_state()["runs"]:
                if sweep.run(record).metrics.exists():
                    runs.append((sweep.run(record).root, record))
        elif RunFolder(path).metrics.exists():
            runs.append((path, {}))
        elif run_folders(path):
            runs += [(folder.root, {}) for folder in run_folders(path)]
        else:
            raise FileNotFoundError(f"{path} holds no run (no {RunFolder(path).metrics.name}) "
                                    f"and no sweep (no {sweep.state.name})")
    if not runs:
        raise FileNotFoundError(f"no finished or started runs in {', '.join(map(str, paths))}")
    return runs


def hyperparameters(runs: list[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per run: its sweep parameters, or the config values that differ between the runs."""
    if all(record for _, record in runs):
        return [dict(record["params"]) for _, record in runs]
    configs = [flatten_config(RunFolder(run_dir).read_config(), fold_init_args=True)
               if RunFolder(run_dir).config.exists() else {} for run_dir, _ in runs]
    keys = sorted({k for c in configs for k in c})
    varying = [k for k in keys if k not in IGNORED_CONFIG
               and len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]
    return [{k: c.get(k) for k in varying} for c in configs]


def compare(paths: list[str | os.PathLike], keys: list[str] | None = None,
            stages: bool = True) -> tuple[list[str], list[dict[str, Any]]]:
    """The table as (columns, rows): run, state, hyperparameters, final values of the
    keys, `<key> <up|down>` transition midpoints and, with `stages`, each run's stages
    (`stage_cells`)."""
    runs = find_runs(paths)
    return compare_runs(runs, [RunFolder(run_dir).series() for run_dir, _ in runs], keys, stages)


def stage_cells(stages: list) -> dict[str, Any]:
    """A run's stages (phases/stages.py) as cells: `stages`, the sequence of its named stages
    ("a > b"), `unnamed stages`, how many are unnamed, and each named stage's steps
    (`stage <name> <onset|midpoint|end>`)."""
    cells: dict[str, Any] = {"stages": " > ".join(s.name for s in stages if s.name),
                             "unnamed stages": sum(s.name is None for s in stages)}
    for stage in stages:
        if stage.name:
            cells.update({f"stage {stage.name} {b}": getattr(stage, b) for b in BOUNDARIES})
    return cells


def compare_runs(runs: list[tuple[Path, dict[str, Any]]], series: list[Series],
                 keys: list[str] | None = None, stages: bool = False) -> tuple[list[str], list[dict[str, Any]]]:
    """`compare`'s table for `runs` (as `find_runs` gives them) whose series the caller has
    already read (`series[i]`: `RunFolder(runs[i][0]).series()`), so that they are read once
    (the population report also plots them); with `stages`, each run's stages found in its
    series (`stage_cells`, as `phasewatch phases` finds them: a stages file written by older
    code is not trusted) and, per group of seeds, their boundaries' distributions and how many
    share a sequence (`distributions`)."""
    from phasewatch.phases.detector import detect_all
    from phasewatch.phases.stages import series_stages
    from phasewatch.probes.keys import stage_rules

    params, rules = hyperparameters(runs), stage_rules()
    present = {k for s in series for k in s}
    if keys:
        missing = [k for k in keys if k not in present]
        if missing:
            raise KeyError(f"no series {missing} in these runs; they have: {', '.join(sorted(present))}")
        chosen = list(keys)
    else:
        chosen = [k for k in headline_keys() if k in present]
    rows, transition_columns = [], []
    for (run_dir, record), p, s in zip(runs, params, series):
        row: dict[str, Any] = {"run": record.get("name") or run_dir.name, "state": record.get("state", "")}
        row.update(p)
        for key in chosen:
            if key in s:
                row[f"final {key}"] = s[key][1][-1]
        largest: dict[str, float] = {}  # column -> magnitude of the transition kept in it
        for event in detect_all({k: s[k] for k in chosen if k in s}):
            column = f"{event['metric']} {event['direction']}"
            if abs(event["magnitude"]) > largest.get(column, -1.0):
                largest[column] = abs(event["magnitude"])
                row[column] = event["midpoint"]
                if column not in transition_columns:
                    transition_columns.append(column)
        if stages:
            row.update(stage_cells(series_stages(s, rules)))
        rows.append(row)
    param_columns = list(dict.fromkeys(k for p in params for k in p))
    order = {k: i for i, k in enumerate(chosen)}
    transition_columns.sort(key=lambda c: (order[c.rsplit(" ", 1)[0]], c))
    stage_columns = [f"stage {sig.name} {b}" for sig in rules.signatures for b in BOUNDARIES
                     if any(f"stage {sig.name} {b}" in r for r in rows)] if stages else []
    columns = ["run", "state", *param_columns, *[f"final {k}" for k in chosen], *transition_columns,
               *(["stages", "unnamed stages"] if stages else []), *stage_columns]
    summary = distributions(rows, param_columns, transition_columns + stage_columns, "stages" if stages else None)
    return columns, rows + summary


def _seed_groups(rows: list[dict[str, Any]], params: list[str]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(the other parameters' values, the runs) per group of at least 2 runs that differ only
    in seeds (`is_seed`); none when no seed varies."""
    fixed = [p for p in params if not is_seed(p)]
    if len(fixed) == len(params):
        return []  # no seed varies
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(json.dumps([row.get(p) for p in fixed], default=str), []).append(row)
    return [({p: members[0].get(p) for p in fixed}, members) for members in groups.values() if len(members) >= 2]


def distributions(rows: list[dict[str, Any]], params: list[str], transitions: list[str],
                  sequence: str | None = None) -> list[dict[str, Any]]:
    """Per group of runs that differ only in seeds (`is_seed`), with at least 2 runs: one row
    per statistic of STATISTICS (run = its name, state = "<runs> seeds") holding, per transition
    column, that statistic of the midpoint steps over the runs that have the transition (`n`:
    how many have it; quartiles by linear interpolation, numpy's default). The `n` row's cell
    of the `sequence` column (the runs' stage sequences) says how many runs share the most
    common one, and which ("14 of 16: a > b"; of equally common ones, the first met)."""
    import numpy as np

    out = []
    for fixed, members in _seed_groups(rows, params):
        values = {c: np.array([r[c] for r in members if r.get(c) is not None], dtype=float) for c in transitions}
        for stat in STATISTICS:
            row = {"run": stat, "state": f"{len(members)} seeds", **fixed}
            if stat == "n" and sequence is not None:
                found = [r.get(sequence) or "(none named)" for r in members]
                common = max(dict.fromkeys(found), key=found.count)
                row[sequence] = f"{found.count(common)} of {len(members)}: {common}"
            for column, v in values.items():
                if stat == "n":  # how many of the seeds have the transition: the others are left out
                    row[column] = len(v)
                elif len(v):
                    q = {"median": 50, "q25": 25, "q75": 75, "min": 0, "max": 100}[stat]
                    row[column] = float(np.percentile(v, q))
            out.append(row)
    return out


def plot_compare(columns: list[str], rows: list[dict[str, Any]], path: str | os.PathLike, max_panels: int = 6,
                 x: str | None = None, hue: str | None = None) -> Path:
    """One panel per transition column: its step against parameter `x` (default: the
    first varying one), one colour (and a line through the means) per value of `hue`
    (default: the next varying one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from phasewatch.report.curves import plain, save_figure

    rows = [r for r in rows if r.get("run") not in STATISTICS]  # the runs themselves, not the summary rows
    transitions = [c for c in columns if c.endswith((" up", " down"))][:max_panels]
    params = [c for c in columns[2:] if not c.startswith(("final ", "stage")) and c != "unnamed stages"
              and c not in transitions
              and not c.endswith((" up", " down")) and len({_cell(r.get(c)) for r in rows}) > 1]
    if x is None and params and all(is_seed(p) for p in params):
        return plot_distributions(transitions, rows, path)
    params = [p for p in params if not is_seed(p)] or params  # seeds spread the points, they are not an axis
    x_key = x or (params[0] if params else "run")
    rest = [p for p in params if p != x_key]
    colour_key = hue or (rest[0] if rest else None)
    x_values = _ordered({r.get(x_key) for r in rows})
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x_values)
    n = max(1, len(transitions))
    cols = min(3, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.6 * cols, 3.6 * ((n + cols - 1) // cols)),
                             squeeze=False, sharex=True)
    groups = _ordered({r.get(colour_key) for r in rows}) if colour_key else [None]
    for ax, column in zip(axes.flat, transitions):
        for g, group in enumerate(groups):
            members = [r for r in rows if colour_key is None or r.get(colour_key) == group]
            xs = [_position(r.get(x_key), x_values, numeric) for r in members if r.get(column) is not None]
            ys = [r[column] for r in members if r.get(column) is not None]
            label = plain(f"{colour_key}={group}") if colour_key else None
            ax.scatter(xs, ys, s=22, color=f"C{g}", alpha=0.75, label=label)
            means = [(x, sum(y for xx, y in zip(xs, ys) if xx == x) / xs.count(x)) for x in sorted(set(xs))]
            if len(means) > 1:
                ax.plot(*zip(*means), color=f"C{g}", lw=1.2)
        missing = sum(r.get(column) is None for r in rows)
        ax.set_title(plain(column) + (f"  ({missing} runs without)" if missing else ""), fontsize=9)
        ax.set_xlabel(plain(x_key))
        ax.set_ylabel("transition midpoint (step)")
        if numeric and len(x_values) > 1 and min(x_values) > 0 and max(x_values) / min(x_values) >= 10:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(x_values)), [plain(v) for v in x_values], rotation=30, fontsize=7)
        ax.grid(alpha=0.3)
        if colour_key and ax is axes.flat[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(transitions):]:
        ax.set_visible(False)
    if not transitions:
        axes.flat[0].set_visible(True)
        axes.flat[0].text(0.5, 0.5, "no transitions detected", ha="center", va="center")
    fig.suptitle(f"phase transitions across {len(rows)} runs", fontsize=10)
    return save_figure(fig, path, dpi=120)


def plot_distributions(transitions: list[str], rows: list[dict[str, Any]], path: str | os.PathLike,
                       empty: str = "no transitions detected") -> Path:
    """Runs that differ only in seeds: per transition, a box (quartiles, whiskers to the
    extremes) with every run's midpoint as a point beside it, and the median and
    interquartile range in the title; `empty`: what the plot says when there is no transition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from phasewatch.report.curves import plain, save_figure

    n = max(1, len(transitions))
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n + 0.6, 3.8), squeeze=False)
    jitter = np.random.default_rng(0)
    for ax, column in zip(axes.flat, transitions):
        steps = np.array([r[column] for r in rows if r.get(column) is not None], dtype=float)
        if len(steps):
            ax.boxplot([steps], positions=[0], widths=0.5, whis=(0, 100), showfliers=False)
            ax.scatter(0.45 + jitter.uniform(-0.08, 0.08, len(steps)), steps, s=16, alpha=0.7, color="C0")
            q25, median, q75 = np.percentile(steps, [25, 50, 75])
            ax.set_title(f"{plain(column)}\nmedian {median:.0f}, IQR {q25:.0f}-{q75:.0f}", fontsize=8)
        else:
            ax.set_title(f"{plain(column)}\nnot detected", fontsize=8)
        missing = len(rows) - len(steps)
        ax.set_xticks([0.2], [f"{len(steps)} runs" + (f" ({missing} without)" if missing else "")], fontsize=7)
        ax.set_xlim(-0.5, 0.8)
        ax.grid(alpha=0.3, axis="y")
    axes.flat[0].set_ylabel("transition midpoint (step)")
    if not transitions:
        axes.flat[0].text(0.5, 0.5, plain(empty), ha="center", va="center", wrap=True, fontsize=8)
    fig.suptitle(f"phase transitions over {len(rows)} seeds", fontsize=10)
    return save_figure(fig, path, dpi=120)


def compare_command(argv: list[str]) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="phasewatch compare",
        description="One table of runs' hyperparameters and detected transition steps, as CSV and as a plot.")
    parser.add_argument("paths", nargs="+", help="run folders and/or sweep folders")
    parser.add_argument("--keys", nargs="*", help=f"series to compare (default: those of {', '.join(headline_keys())})")
    parser.add_argument("--x", default=None, help="parameter on the plot's x axis (default: the first that varies)")
    parser.add_argument("--hue", default=None, help="parameter that colours the points (default: the next one)")
    parser.add_argument("--no-stages", action="store_true",
                        help="leave out each run's stages (found in its series, as `phasewatch phases`; the slow part)")
    parser.add_argument("--out", default=None,
                        help="output path without suffix (default: <sweep or population folder>/compare, or ./compare)")
    args = parser.parse_args(argv)
    try:
        columns, rows = compare(args.paths, args.keys, stages=not args.no_stages)
    except (FileNotFoundError, KeyError) as err:
        print(f"phasewatch: error: {err.args[0]}", file=sys.stderr)
        return 2
    folder = Path(args.paths[0])  # one sweep's or population's folder: its compare.* go there
    single = len(args.paths) == 1 and (SweepFolder(folder).is_sweep()
                                       or (not RunFolder(folder).metrics.exists() and bool(run_folders(folder))))
    out = Path(args.out) if args.out else (SweepFolder(args.paths[0]).comparison if single else Path("compare"))
    widths = {c: max(len(c), *(len(_cell(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_cell(row.get(c)).ljust(widths[c]) for c in columns))
    print(write_csv(columns, rows, out.with_suffix(".csv")))
    for name in (args.x, args.hue):
        if name is not None and name not in columns:
            print(f"phasewatch: error: no column {name!r}; the table has: {', '.join(columns)}", file=sys.stderr)
            return 2
    print(plot_compare(columns, rows, out.with_suffix(".png"), x=args.x, hue=args.hue))
    return 0


def _ordered(values: set) -> list:
    try:
        return sorted(values)
    except TypeError:
        return sorted(values, key=str)


def _position(value: Any, values: list, numeric: bool) -> float:
    return float(value) if numeric else float(values.index(value))

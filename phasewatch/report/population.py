"""The report of a population (`phasewatch fit --population.seeds`, training/population.py):
the members' curves overlaid, each transition's step as a distribution over the seeds, and
a link to every member's own report.

    phasewatch report runs/<population>      # runs/<population>/report.html

`fit` writes it when a population ends. The page is self-contained (figures embedded as
PNG) and has no script: its Content-Security-Policy runs none (report/page.py), and every
string from the members' folders (names, config values) is escaped text; a member's link is
a relative path, whatever the member is called. It reads the members' run folders only
(rundir/), like every report.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any
from urllib.parse import quote

from phasewatch.probes.keys import headline_keys
from phasewatch.report.cross_run import STATISTICS, compare_runs, plot_distributions
from phasewatch.report.curves import plain, save_figure
from phasewatch.report.page import policy
from phasewatch.rundir import RunFolder, Series, SweepFolder, run_folders, write_atomic, write_csv


def is_population(path: str | Path) -> bool:
    """Whether `path` holds a population: no metrics of its own, member run folders inside."""
    return not RunFolder(path).metrics.exists() and not SweepFolder(path).is_sweep() and bool(run_folders(path))


def plot_members(root: str | Path, members: list[RunFolder], series: list[Series], out: str | Path,
                 max_panels: int = 6) -> Path:
    """One panel per headline series the members logged: every member's curve (log-step
    axis), with its confirmed transitions' midpoints as dots. `members`: the population's
    run folders (`run_folders(root)`); `series[i]`: `members[i].series()`, read by the caller."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [m.transitions() for m in members]
    keys = [k for k in headline_keys() if any(k in s for s in series)][:max_panels]
    n = max(1, len(keys))
    cols = min(2, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, (member, s, evs) in enumerate(zip(members, series, events)):
            if key not in s:
                continue
            steps, values = s[key]
            ax.plot([max(x, 1) for x in steps], values, lw=1.0, alpha=1.0 if len(members) <= 10 else 0.5,
                    color=f"C{i % 10}",
                    label=plain(member.root.name) if len(members) <= 10 else None)
            for e in evs:
                if e["metric"] == key and e["midpoint"] in steps:
                    ax.plot(max(e["midpoint"], 1), values[steps.index(e["midpoint"])], "o", ms=3.5,
                            color=f"C{i % 10}")
        ax.set_xscale("log")
        values = [v for s in series if key in s for v in s[key][1] if v is not None and v > 0]
        if key.endswith("/loss") and values and max(values) > 10 * min(values):  # losses that fall by decades
            ax.set_yscale("log")
        ax.set_title(plain(key), loc="left", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if len(members) <= 10 and keys:
        axes.flat[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{plain(Path(root).name)}: {len(members)} members (dots: confirmed transitions' midpoints)",
                 fontsize=10)
    return save_figure(fig, out)


def why_empty(members: list[RunFolder], series: list[Series]) -> str:
    """Why a population has no transition to show, as far as its folders tell: where its runs
    ended, and that a later change needs longer runs."""
    ends = sorted({int(max(max(steps) for steps, _ in s.values() if len(steps))) for s in series if s})
    config = members[0].read_config() if members and members[0].config.exists() else {}
    planned = (config.get("trainer") or {}).get("max_steps")
    ended = (f"the runs ended at step {ends[0]}" if len(ends) == 1 else
             f"the runs ended between steps {ends[0]} and {ends[-1]}") if ends else "the runs logged no steps"
    of = f" (trainer.max_steps {planned})" if isinstance(planned, int) and ends and planned > ends[-1] + 1 else ""
    return f"{ended}{of}; a change that comes later in training needs longer runs (--trainer.max_steps)"


def _image(path: Path) -> str:
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'


def _link(path: Path) -> str:
    """A relative link to `path`, whatever its folders are called: every character but letters,
    digits, `_.-~` and the slashes is percent-encoded, so no `:` can make it a scheme
    (`javascript:...`) and no `?` or `#` can end its path."""
    return quote(path.as_posix())


def _seed(member: RunFolder) -> Any:
    return (member.read_config() if member.config.exists() else {}).get("seed_everything", "?")


def write_population_report(root: str | Path, out: str | Path | None = None) -> Path:
    """Write the population's report (and its figures and compare.csv); its path.
    FileNotFoundError when `root` holds no member runs."""
    root = Path(root)
    members = run_folders(root)
    if not members:
        raise FileNotFoundError(f"{root} holds no member runs (run folders m00, m01, ... with metrics)")
    figures = RunFolder(root).figures
    series = [m.series() for m in members]  # read once: plotted, then compared
    curves = plot_members(root, members, series, figures / "members.png")
    columns, rows = compare_runs([(m.root, {}) for m in members], series)  # compare([root]) of a population
    write_csv(columns, rows, figures / "compare.csv")
    transitions = [c for c in columns if c.endswith((" up", " down"))]
    ended = why_empty(members, series) if not transitions else ""
    spread = plot_distributions(transitions[:8], [r for r in rows if r["run"] not in STATISTICS],
                                figures / "distributions.png", empty=f"no transitions detected:\n{ended}")
    stats = {r["run"]: r for r in rows if r["run"] in STATISTICS}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["transition", *STATISTICS])
    body = "".join(
        "<tr><td>" + html.escape(c) + "</td>" + "".join(
            f"<td>{stats[s][c]:.0f}</td>" if stats.get(s, {}).get(c) is not None else "<td></td>" for s in STATISTICS)
        + "</tr>" for c in transitions)
    # each member's seed as the table read it from its config (it differs between members), else read here
    # (compare_runs gives the runs' rows first, in order; a member without a config has None there)
    seeds = [r.get("seed_everything") for r in rows[:len(members)]]
    links = "".join(
        f'<li><a href="{html.escape(_link(m.report.relative_to(root)))}">{html.escape(m.root.name)}</a>'
        f" (seed {html.escape(str(_seed(m) if seed is None else seed))})</li>"
        for m, seed in zip(members, seeds))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8">{policy()}<title>{html.escape(root.name)}: population of {len(members)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1300px}} img{{max-width:100%}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
td:first-child{{text-align:left}}</style></head>
<body><h1>{html.escape(root.name)}: population of {len(members)}</h1>
<h2>Curves</h2>{_image(curves)}
<h2>Transition steps over the seeds</h2>
<p>Midpoint step of each series' largest transition per direction (offline detector, as
<code>phasewatch compare</code>), over the members that have it.</p>
<table id="distribution"><tr>{head}</tr>{body}</table>
{f'<p id="empty">No member had a transition: {html.escape(ended)}.</p>' if ended else ""}{_image(spread)}
<h2>Members</h2><ul id="members">{links}</ul>
</body></html>
"""
    path = Path(out) if out is not None else RunFolder(root).report
    write_atomic(path, page)
    return path

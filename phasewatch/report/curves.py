"""Training curves of a run folder as a PNG, on a log-step axis.

`phasewatch plot RUN_DIR` writes the run folder's `curves` figure: losses (log scale) in one
panel, accuracies in another, the panels the probes declare, and one panel per further
metric family found in the run's metrics (e.g. `grok/...`). Use it to look at a run, or for the README.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from phasewatch.probes.keys import Panel, hidden, panels
from phasewatch.rundir import RunFolder, load_series


def panel_layout(data: dict) -> list[tuple[str, list[str], str]]:
    """Which keys go in which panel: the panels the training loop and the probes declare
    (probes/keys.py; losses and accuracies first), then one panel per remaining key family."""
    out, used = [], set()
    for panel in panels():
        chosen = [k for k in _ordered(panel, data) if panel.matches(k)]
        out.append((panel.title, chosen, "log" if panel.log_y else "linear"))
        used |= set(chosen)
    rest: dict[str, list[str]] = defaultdict(list)
    for key in sorted(data):
        if key not in used and not hidden(key):
            rest[key.split("/")[0]].append(key)
    return out + [(fam, keys, "linear") for fam, keys in rest.items()]


def _ordered(panel: Panel, data: dict) -> list[str]:
    """A panel's keys: exact keys in their declared order, the others in natural order."""
    if isinstance(panel.keys, tuple):
        return [k for k in panel.keys if k in data]
    return sorted(data, key=_natural)


def _natural(key: str):
    tail = key.rsplit("/", 1)[-1]
    return (key.rsplit("/", 1)[0], int(tail) if tail.isdigit() else 0, key)


def plain(text: object) -> str:
    """`text` (a metric key, a folder's name, a config value: strings from a run folder) as a
    figure shows it: literally, its dollar signs never read as mathtext (`$\\foo$` would be
    typeset, or end the drawing with a parse error)."""
    return str(text).replace("$", r"\$")


def save_figure(fig, out: str | Path, dpi: int = 110) -> Path:
    """Lay out, write (making the folder) and close a matplotlib figure; its path."""
    import matplotlib.pyplot as plt

    out = Path(out)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves; returns the PNG's path. Raises FileNotFoundError when the
    folder has no metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = RunFolder(run_dir)
    folder.require_metrics()
    data = load_series(folder.root)
    # a panel needs data, and more than the composition baseline alone (1-layer models)
    panels = [p for p in panel_layout(data) if p[1] and p[1] != ["comp/baseline"]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys, yscale) in zip(axes[:, 0], panels):
        for key in keys:
            steps, values = data[key]
            pairs = [(max(s, 1), v) for s, v in zip(steps, values) if yscale != "log" or v > 0]
            if pairs:
                ax.plot(*zip(*pairs), label=plain(key), lw=1.4)
        ax.set_xscale("log")
        ax.set_yscale(yscale)
        ax.set_title(plain(title), loc="left", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if keys:
            ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step (log scale)")
    fig.suptitle(plain(folder.root.name), fontsize=11)
    return save_figure(fig, out or folder.figure("curves"))

"""Training curves of a run folder as a PNG, on a log-step axis.

`phasewatch plot RUN_DIR` writes `RUN_DIR/figures/curves.png`: losses (log scale) in one
panel, accuracies in another, and one panel per further metric family found in
metrics.jsonl (e.g. `grok/...`). Use it to look at a run, or for the README.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from phasewatch.trainers.run_store import RunStore, read_jsonl

LOSS_KEYS = ("train/loss", "val/loss")
ACC_KEYS = ("train/acc", "val/acc")


def series(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every numeric key of metrics.jsonl as (steps, values), in step order."""
    out: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for record in read_jsonl(RunStore(run_dir).metrics):
        step = record.get("step")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                out[key][0].append(step)
                out[key][1].append(float(value))
    return dict(out)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves; returns the PNG's path. Raises FileNotFoundError when the
    folder has no metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not RunStore(run_dir).metrics.exists():
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} not found: is {run_dir} a phasewatch run folder?")
    data = series(run_dir)
    families: dict[str, list[str]] = defaultdict(list)
    for key in sorted(data):
        if key in LOSS_KEYS or key in ACC_KEYS or key == "lr" or key == "val/seq_acc":
            continue
        families[key.split("/")[0]].append(key)
    panels = [("loss", [k for k in LOSS_KEYS if k in data], "log"), ("accuracy", [k for k in ACC_KEYS if k in data], "linear")]
    panels += [(fam, keys, "linear") for fam, keys in families.items()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys, yscale) in zip(axes[:, 0], panels):
        for key in keys:
            steps, values = data[key]
            pairs = [(max(s, 1), v) for s, v in zip(steps, values) if yscale != "log" or v > 0]
            if pairs:
                ax.plot(*zip(*pairs), label=key, lw=1.4)
        ax.set_xscale("log")
        ax.set_yscale(yscale)
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if keys:
            ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step (log scale)")
    fig.suptitle(run_dir.name, fontsize=11)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "figures" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""The learned-vs-compiled figure of a RASP run: the run folder's `tracr` figure.

Six panels over training (log-step axis): behavioural agreement with the compiled model
per input length; attention match of each compiled head (best single learned head,
solid; best two-head path, dashed); each RASP variable's best linear-probe accuracy over
the learned residual sites, with the baseline on the step-0 weights dotted; accuracy with
each component ablated; and the CKA matrix (learned x compiled residual sites) at the
first and the last checkpoint. `phasewatch plot RUN_DIR` draws it when the run has
`tracr/` values (the `tracr` probe, default for RASP tasks).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from phasewatch.report.curves import plain, save_figure
from phasewatch.report.page import load_array
from phasewatch.rundir import RunFolder, load_series


def _by(pattern: str, data: dict) -> dict[str, tuple]:
    out = {}
    for key, series in data.items():
        match = re.fullmatch(pattern, key)
        if match:
            out[match.group(1)] = series
    return out


def _cka(folder: RunFolder, which: int) -> tuple[int, np.ndarray, list[str], list[str]] | None:
    files = folder.array_files("tracr", "cka")
    if not files:
        return None
    step, f = files[which]
    matrix = load_array(f)
    labels = dict(folder.array_files("tracr", "cka_labels"))
    names = [str(x) for x in load_array(labels[step]).tolist()] if step in labels else []
    rows, cols = (names[:matrix.shape[0]], names[matrix.shape[0]:]) if len(names) == sum(matrix.shape) else ([], [])
    return step, matrix, [plain(r) for r in rows], [plain(c.removeprefix("compiled ")) for c in cols]


def plot_comparison(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Draw the figure; None when the run has no `tracr/` values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = RunFolder(run_dir)
    data = load_series(folder.root)
    if "tracr/agreement" not in data:
        return None
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.4))
    _agreement(axes[0, 0], data)
    _attention_match(axes[0, 1], data)
    _variable_probes(axes[0, 2], data)
    _ablations(axes[1, 0], data)
    for ax in (axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0]):
        _over_training(ax)
    for ax, which, title in ((axes[1, 1], 0, "first"), (axes[1, 2], -1, "last")):
        _cka_panel(fig, ax, folder, which, title)
    fig.suptitle(f"{plain(folder.root.name)}: learned vs compiled", fontsize=11)
    return save_figure(fig, out or folder.figure("tracr"))


def _curve(ax, series: tuple, **kw) -> None:
    steps, values = series
    ax.plot([max(s, 1) for s in steps], values, **kw)


def _agreement(ax, data: dict) -> None:
    """Agreement with the compiled model per input length, and their mean."""
    for length, series in sorted(_by(r"tracr/agreement/len(\d+)", data).items(), key=lambda kv: int(kv[0])):
        _curve(ax, series, label=f"length {length}", lw=1.2)
    _curve(ax, data["tracr/agreement"], label="mean over lengths", color="k", lw=2)
    ax.set_title("agreement with the compiled model", loc="left", fontsize=10)


def _attention_match(ax, data: dict) -> None:
    """Each compiled head's best learned head (solid) and best two-head path (dashed)."""
    for i, (ref, series) in enumerate(sorted(_by(r"tracr/attn_match/(L\d+H\d+)", data).items())):
        _curve(ax, series, label=f"compiled {ref}: best learned head", color=f"C{i}", lw=1.6)
        if f"tracr/attn_match/{ref}/path" in data:
            _curve(ax, data[f"tracr/attn_match/{ref}/path"], label=f"compiled {ref}: best learned path",
                   color=f"C{i}", ls="--")
    ax.set_title("attention match with each compiled head", loc="left", fontsize=10)


def _variable_probes(ax, data: dict) -> None:
    """Each RASP variable's best probe accuracy over the learned sites; dotted: on the step-0 weights."""
    probes, baselines = defaultdict(list), defaultdict(list)
    for key, series in data.items():
        match = re.fullmatch(r"tracr/(probe|probe_baseline)/(.+)/(resid_\w+)", key)
        if match:
            (probes if match.group(1) == "probe" else baselines)[match.group(2)].append(series)
    for i, (name, group) in enumerate(sorted(probes.items())):
        steps = group[0][0]
        best = np.max([v for _, v in group], axis=0)
        ax.plot([max(s, 1) for s in steps], best, color=f"C{i}", label=plain(name), lw=1.6)
        if baselines.get(name):
            ax.axhline(np.max([v[-1] for _, v in baselines[name]]), color=f"C{i}", ls=":", lw=1.2)
    ax.set_title("variable probes: best site (dotted: on the step-0 weights)", loc="left", fontsize=10)


def _ablations(ax, data: dict) -> None:
    """Accuracy with each component mean-ablated (heads and MLPs solid, whole layers dashed)."""
    for component, series in sorted(_by(r"ablation/([^/]+)/acc", data).items()):
        _curve(ax, series, label=plain(component), lw=1.8 if "." in component else 1.0,
               ls="-" if "." in component else "--")
    ax.set_title("accuracy with one component mean-ablated", loc="left", fontsize=10)


def _over_training(ax) -> None:
    """The shared look of the four panels over training: log-step axis, values in [0, 1]."""
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.set_xlabel("step")
    handles = ax.get_legend_handles_labels()[0]
    if handles:
        ax.legend(fontsize=7, loc="best", ncol=2 if len(handles) > 6 else 1)


def _cka_panel(fig, ax, folder: RunFolder, which: int, title: str) -> None:
    """The CKA matrix (learned x compiled residual sites) at the first or last checkpoint, with
    its colour bar; hidden when the run saved none."""
    found = _cka(folder, which)
    if found is None:
        ax.set_visible(False)
        return
    step, matrix, rows, cols = found
    image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=60, ha="right")
    ax.set_ylabel("learned site")
    ax.set_xlabel("compiled site")
    ax.set_title(f"linear CKA at the {title} checkpoint (step {step})", loc="left", fontsize=10)
    for (r, c), v in np.ndenumerate(matrix):
        ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
    fig.colorbar(image, ax=ax, fraction=0.04, label="linear CKA")

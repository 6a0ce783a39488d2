"""Checkpoint trajectories: where a run's model goes, drawn in two dimensions.

    phasewatch trajectory RUN_DIR [--kind logits|weights|both]

Each saved step checkpoint becomes one vector: (a) its log-probabilities at every answer
position of a fixed held-out set (at most `max_rows` sequences; log-softmax removes the logits'
free shift) or (b) all its weights flattened. PCA across checkpoints (centred) gives a 2-D path
coloured by step, with the midpoints of the transitions detected offline in the run's headline
series marked (PCA paths over checkpoints as in Nanda et al. 2023 and Olsson et al. 2022).

Public: `checkpoint_vectors`, `pca_2d`, `plot_trajectory` (writes the run folder's `trajectory`
figure and, per kind, its coordinates: step, PC1, PC2), `current_trajectory` (the figure, drawn
again when missing or out of date; the report uses it) and `trajectory_command` (the CLI).
Fails with a clear error when the run has fewer than three checkpoints. docs/interventions.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from phasewatch.probes.keys import headline_keys
from phasewatch.rundir import TRAJECTORY_CHECKPOINTS, RunFolder
from phasewatch.errors import ConfigError

KINDS = ("logits", "weights")


def checkpoint_vectors(run_dir: str | os.PathLike, kinds: tuple[str, ...] = KINDS, max_rows: int = 512,
                       allow: tuple[str, ...] = ()) -> tuple[list[int], dict[str, np.ndarray]]:
    """(steps, {kind: one row per checkpoint}) for the kinds "logits" and/or "weights": the
    run's model is built once and each checkpoint read once, whatever the kinds."""
    if not kinds or any(k not in KINDS for k in kinds):
        raise ConfigError("kind", f"trajectory kinds {list(kinds)!r} are not some of {list(KINDS)}",
                          f"Use one or more of {', '.join(KINDS)}.")
    steps = RunFolder(run_dir).checkpoint_steps()
    if len(steps) < TRAJECTORY_CHECKPOINTS:
        raise ConfigError("run_dir", f"{run_dir} has {len(steps)} saved checkpoints; a trajectory needs at least "
                          f"{TRAJECTORY_CHECKPOINTS}",
                          "Train with a checkpoint schedule (the default keeps 30 log-spaced ones).")
    from phasewatch.cli.analyze import load_run_module, load_weights  # lightning: only when drawing

    module = load_run_module(run_dir, allow)
    batches = module.task.val_batches() if "logits" in kinds else []
    rows: dict[str, list[np.ndarray]] = {kind: [] for kind in kinds}
    for path in steps.values():
        load_weights(module, path)
        if "weights" in kinds:
            rows["weights"].append(torch.cat([p.detach().flatten().double() for p in module.parameters()]).numpy())
        if "logits" in kinds:
            rows["logits"].append(_log_probabilities(module, batches, max_rows))
    return list(steps), {kind: np.stack(r) for kind, r in rows.items()}


def _log_probabilities(module, batches, max_rows: int) -> np.ndarray:
    """The model's log-probabilities at every answer position of the first `max_rows` held-out
    sequences, flattened."""
    left, parts = max_rows, []
    with torch.no_grad():
        for batch in batches:
            if left <= 0:
                break
            tokens, mask = batch.tokens[:left], batch.loss_mask[:left]
            logits = module.model(tokens)[mask].double()
            parts.append(torch.log_softmax(logits, -1).flatten())
            left -= len(tokens)
    return torch.cat(parts).numpy()


def pca_2d(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coordinates [n, 2], explained variance ratio of the two components) of n rows.

    The coordinates are the centred rows' first two left singular vectors times their singular
    values, found as the top eigenvectors of the n x n Gram matrix of the centred rows: a
    trajectory has a few hundred checkpoints at most and vectors of up to millions of entries,
    and the Gram matrix costs one matrix product where an SVD of the rows costs several times
    that. The Gram matrix holds squared singular values, so a component with less than 1e-10 of
    the first one's variance is below its rounding and comes out as 0 (a straight path has no
    second component). Each component's sign, arbitrary in PCA, is set so that the path ends
    further along it than it starts; where the two are equal up to rounding (PC2 of an arc), so
    that the coordinate of largest magnitude is positive."""
    centred = np.asarray(rows, dtype=np.float64)
    centred = centred - centred.mean(0, keepdims=True)
    gram = centred @ centred.T
    values, vectors = np.linalg.eigh(gram)  # ascending
    top = np.clip(values[::-1][:2], 0, None)  # squared singular values
    top[top < 1e-10 * top[0]] = 0.0
    coords = vectors[:, ::-1][:, :2] * np.sqrt(top)
    for j in range(coords.shape[1]):
        column = coords[:, j]
        gain = column[-1] - column[0]
        if abs(gain) <= 1e-8 * np.abs(column).max():  # no direction of travel to go by
            gain = column[np.argmax(np.abs(column))]
        if gain < 0:
            column *= -1
    total = float(np.trace(gram))
    return coords, top / total if total > 0 else np.zeros_like(top)


def plot_trajectory(run_dir: str | os.PathLike, kinds: tuple[str, ...] = KINDS, out: str | os.PathLike | None = None,
                    allow: tuple[str, ...] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from phasewatch.phases.detector import detect_all
    from phasewatch.report.curves import save_figure

    folder = RunFolder(run_dir)
    series = folder.series()
    events = detect_all({k: series[k] for k in headline_keys() if k in series})
    steps, vectors = checkpoint_vectors(folder.root, kinds, allow=allow)
    finite = np.all([np.isfinite(vectors[kind]).all(1) for kind in kinds], 0)
    if not finite.all():  # a run that skipped non-finite steps can still save non-finite weights
        print(f"phasewatch: the trajectory leaves out the checkpoints with non-finite values: steps "
              f"{[s for s, ok in zip(steps, finite) if not ok]}", file=sys.stderr)
        if finite.sum() < TRAJECTORY_CHECKPOINTS:
            raise ConfigError("checkpoints", f"only {int(finite.sum())} checkpoints hold finite values",
                              f"A trajectory needs {TRAJECTORY_CHECKPOINTS}; lower the learning rate if the weights "
                              "overflow.")
        steps, vectors = [s for s, ok in zip(steps, finite) if ok], {k: v[finite] for k, v in vectors.items()}
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.2 * len(kinds), 5.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        coords, ratio = pca_2d(vectors[kind])
        pca = folder.trajectory_pca(kind)
        pca.parent.mkdir(parents=True, exist_ok=True)
        np.save(pca, np.column_stack([steps, coords]))
        ax.plot(coords[:, 0], coords[:, 1], color="#bbb", lw=1, zorder=1)
        points = ax.scatter(coords[:, 0], coords[:, 1], c=[max(s, 1) for s in steps], cmap="viridis",
                            norm=LogNorm(), s=28, zorder=2)
        for i in (0, len(steps) // 2, len(steps) - 1):
            ax.annotate(f"step {steps[i]}", coords[i], fontsize=7, xytext=(4, 4), textcoords="offset points")
        for j, event in enumerate(events):
            i = int(np.argmin([abs(s - event["midpoint"]) for s in steps]))
            ax.scatter(*coords[i], marker="*", s=180, color=f"C{j % 10}", edgecolor="k", zorder=3,
                       label=f"{event['metric']} {event['direction']} (mid {event['midpoint']})")
        ax.set_xlabel(f"PC1 ({ratio[0]:.0%} of variance)")
        ax.set_ylabel(f"PC2 ({ratio[1]:.0%})")
        ax.set_title(f"{'log-probabilities on held-out data' if kind == 'logits' else 'weights'}, "
                     f"{len(steps)} checkpoints", loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        fig.colorbar(points, ax=ax, label="step")
        if events:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{folder.root.name}: checkpoint trajectory (PCA)", fontsize=11)
    return save_figure(fig, out or folder.figure("trajectory"))


def current_trajectory(run_dir: str | os.PathLike, allow: tuple[str, ...] = ()) -> Path | None:
    """The run folder's trajectory figure, drawn first (both kinds) when it is missing or its
    coordinates are not of the run's checkpoints now (a resumed run has more): what `phasewatch
    report` shows. None when the run has fewer than TRAJECTORY_CHECKPOINTS (3) checkpoints. Raises
    ConfigError when the run's config cannot be rebuilt (e.g. it names untrusted classes: `allow`)."""
    folder = RunFolder(run_dir)
    steps = list(folder.checkpoint_steps())
    if len(steps) < TRAJECTORY_CHECKPOINTS:
        return None
    figure = folder.figure("trajectory")
    if figure.exists() and all(_pca_steps(folder.trajectory_pca(kind)) == steps for kind in KINDS):
        return figure
    return plot_trajectory(folder.root, KINDS, allow=allow)


def _pca_steps(path: Path) -> list[int] | None:
    """The steps (first column) of saved trajectory coordinates; None when unreadable."""
    try:
        return [int(s) for s in np.load(path, allow_pickle=False)[:, 0]]
    except (OSError, ValueError, IndexError):
        return None


def trajectory_command(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="phasewatch trajectory",
                                     description="PCA paths of a run's checkpoints (logits and weights), with its "
                                                 "detected transitions marked (the run folder's trajectory figure).")
    parser.add_argument("run_dir")
    parser.add_argument("--kind", choices=[*KINDS, "both"], default="both")
    parser.add_argument("--out", default=None, help="PNG path (default: the figure in the run folder)")
    parser.add_argument("--allow", nargs="+", metavar="MODULE", default=(),
                        help="modules whose classes the run's config may name besides phasewatch's and installed "
                             "plug-ins'")
    args = parser.parse_args(argv)
    kinds = KINDS if args.kind == "both" else (args.kind,)
    print(plot_trajectory(args.run_dir, kinds, args.out, tuple(args.allow)))
    return 0

"""Training curves of a run folder as a PNG, on a log-step axis.

`phasewatch plot RUN_DIR` writes `RUN_DIR/figures/curves.png`: losses (log scale) in one
panel, accuracies in another, and one panel per further metric family found in
metrics.jsonl (e.g. `grok/...`). Use it to look at a run, or for the README.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from phasewatch.report.series import load_series
from phasewatch.callbacks.runfiles import METRICS

LOSS_KEYS = ("train/loss", "val/loss", "grok/restricted_loss", "grok/excluded_loss")
ACC_KEYS = ("train/acc", "val/acc")
KNOWN_PANELS = [  # (title, key prefix or exact keys, y scale)
    ("Gini coefficient of Fourier norms", ("grok/gini_embed", "grok/gini_neuron_logit"), "linear"),
    ("sum of squared weights", ("grok/weight_norm",), "linear"),
    ("share of W_L in each key frequency", "grok/key_freq/", "linear"),
    ("loss per answer token", "digits/loss/", "log"),
    ("accuracy per answer token", "digits/acc/", "linear"),
    ("loss on repeated random tokens", ("icl/first_copy_loss", "icl/second_copy_loss"), "linear"),
    ("induction score per head", "heads/induction/L", "linear"),
    ("previous-token score per head", "heads/prev_token/L", "linear"),
    ("composition: maximum per kind and random baseline", ("comp/k/max", "comp/q/max", "comp/v/max", "comp/baseline"), "linear"),
    ("agreement with the compiled model", ("tracr/agreement",), "linear"),
    ("attention match with the compiled heads (head; path)", "tracr/attn_match/", "linear"),
    ("CKA with the compiled residual stream (best compiled site)", "tracr/cka/", "linear"),
    ("local learning coefficient (SGLD estimate)", ("llc/estimate",), "linear"),
    ("accuracy with one layer mean-ablated", re.compile(r"ablation/L\d+\.(attn|mlp)/acc"), "linear"),
]
SKIP = ("lr", "val/seq_acc", "tracr/", "ablation/", "grok/n_key_freqs", "grok/key_logit_fraction", "grok/excluded_loss/", "comp/", "llc/",
        "heads/", "icl/loss_gap")


def panel_layout(data: dict) -> list[tuple[str, list[str], str]]:
    """Which keys go in which panel: losses, accuracies, the known families, then one
    panel per remaining key family."""
    panels = [("loss", [k for k in LOSS_KEYS if k in data], "log"),
              ("accuracy", [k for k in ACC_KEYS if k in data], "linear")]
    used = set(LOSS_KEYS) | set(ACC_KEYS)
    for title, keys, yscale in KNOWN_PANELS:
        chosen = [k for k in sorted(data, key=_natural) if _matches(k, keys)]
        panels.append((title, chosen, yscale))
        used |= set(chosen)
    rest: dict[str, list[str]] = defaultdict(list)
    for key in sorted(data):
        if key not in used and not key.startswith(SKIP) and key not in SKIP:
            rest[key.split("/")[0]].append(key)
    return panels + [(fam, keys, "linear") for fam, keys in rest.items()]


def _matches(key: str, keys) -> bool:
    """A panel's keys: a prefix, a regular expression or a tuple of exact keys."""
    if isinstance(keys, str):
        return key.startswith(keys)
    if isinstance(keys, re.Pattern):
        return bool(keys.fullmatch(key))
    return key in keys


def _natural(key: str):
    tail = key.rsplit("/", 1)[-1]
    return (key.rsplit("/", 1)[0], int(tail) if tail.isdigit() else 0, key)


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

    run_dir = Path(run_dir)
    if not (run_dir / METRICS).exists():
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} not found: is {run_dir} a phasewatch run folder?")
    data = load_series(run_dir)
    # a panel needs data, and more than the composition baseline alone (1-layer models)
    panels = [p for p in panel_layout(data) if p[1] and p[1] != ["comp/baseline"]]
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
    return save_figure(fig, out or run_dir / "figures" / "curves.png")

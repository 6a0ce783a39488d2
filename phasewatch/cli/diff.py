"""`phasewatch diff`: the diff of two models of the same structure (diff/model_diff.py).

    phasewatch diff runs/x@1200 runs/x@last          # one run, two steps
    phasewatch diff runs/seed0 runs/seed1            # two runs (their last checkpoints)
    phasewatch diff runs/x --across val/loss         # before and after the largest transition of a series
    phasewatch diff A.pth B.pth                      # checkpoints of the grokking paper's code

A model is named by a run folder (its `last.ckpt`, or its newest step checkpoint), a run
folder and a step (`@1200`: the step checkpoint of that step; `@last`), or a .pth file of the
progress-measures paper. The held-out data is A's task's. Prints the losses, the components
that differ most in weights, activations, direct logit attribution and patching, and the
inputs whose loss changed most; writes `diff/<name>.csv` (one row per component) and
`diff/<name>_inputs.csv` in A's run folder (for .pth files: under --out), and, when A is a
run trained with W&B, the same as W&B Tables of a new run beside it (`<run>-diff-<name>`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from phasewatch.rundir import RunFolder, write_csv
from phasewatch.errors import ConfigError

COLUMNS = ["component", "kind", "weight_abs", "weight_rel", "qk_abs", "qk_rel", "ov_abs", "ov_rel", "act_rms",
           "act_rel", "dla_a", "dla_b", "dla_diff", "patched_loss_a", "patch_b_into_a", "patched_loss_b", "patch_a_into_b"]
INPUT_COLUMNS = ["tokens", "loss_a", "loss_b", "change"]


def parse_model_spec(spec: str) -> tuple[Path, str | None]:
    """`runs/x@1200` -> (runs/x, "1200"); `runs/x@last` -> (runs/x, "last"); a folder or a
    file alone -> (it, None)."""
    path, at, step = spec.rpartition("@")
    if at and path and "/" not in step:
        return Path(path), step
    return Path(spec), None


def checkpoint_of(run_dir: Path, step: str | None, field: str = "A") -> tuple[Path, str]:
    """(checkpoint file, label) of a run folder at `step` (None: its last checkpoint);
    ConfigError naming the steps it has when there is no such checkpoint."""
    folder = RunFolder(run_dir)
    steps = folder.checkpoint_steps()
    if step in (None, "last"):
        if folder.last_checkpoint.exists():
            return folder.last_checkpoint, "last"
        if steps:
            newest = max(steps)
            return steps[newest], f"step{newest}"
        raise ConfigError(field, f"{run_dir} has no checkpoints", "Give a run folder of phasewatch fit that saved some.")
    try:
        wanted = int(step)
    except ValueError:
        raise ConfigError(field, f"@{step} is not a step", "Write RUN@<step> (e.g. runs/x@1200) or RUN@last.") from None
    if wanted not in steps:
        have = ", ".join(str(s) for s in steps) or "none"
        raise ConfigError(field, f"{run_dir} has no checkpoint at step {wanted}", f"Pick one of its steps: {have}.")
    return steps[wanted], f"step{wanted}"


def across_transition(run_dir: Path, series: str) -> tuple[str, str, dict[str, Any]]:
    """The steps of the run's checkpoints that bracket the largest transition detected in
    `series` (the newest at or before its onset, the oldest at or after its end), and the
    transition."""
    from phasewatch.phases.detector import detect_all

    folder = RunFolder(run_dir)
    folder.require_metrics()
    data = folder.series()
    if series not in data:
        raise ConfigError("across", f"{run_dir} has no series {series!r}",
                          f"Pick one of: {', '.join(sorted(data))[:400]}.")
    found = [e for e in detect_all({series: data[series]}) if e["kind"] == "transition"]
    if not found:
        raise ConfigError("across", f"no transition detected in {series} of {run_dir}",
                          "Pick a series with one (phasewatch phases RUN lists them), or name two checkpoints.")
    event = max(found, key=lambda e: abs(e["magnitude"]))
    steps = sorted(folder.checkpoint_steps())
    before = [s for s in steps if s <= event["onset"]]
    after = [s for s in steps if s >= event["end"]]
    if not before or not after:
        raise ConfigError("across", f"no checkpoints on both sides of {series}'s transition "
                                    f"({event['onset']}-{event['end']}); the run has {steps}",
                          "Train with the default checkpoint schedule, or name two checkpoints.")
    return str(before[-1]), str(after[0]), event


def load_model(spec: str, allow: tuple[str, ...] = (), field: str = "A"):
    """(bridge, task, run folder or None, label) for a model spec (parse_model_spec)."""
    path, step = parse_model_spec(spec)
    if path.is_dir():
        from phasewatch.cli.analyze import load_run_module, load_weights

        ckpt, label = checkpoint_of(path, step, field)
        module = load_run_module(path, allow)
        load_weights(module, ckpt)
        module.model.eval()
        return module.model, module.task, path, f"{path.name}@{label.removeprefix('step')}"
    if path.is_file() and step is None:
        from phasewatch.models import load_progress_measures_checkpoint

        try:
            model, task = load_progress_measures_checkpoint(str(path))
        except ValueError as err:
            raise ConfigError(field, f"{path}: {err}", "Give a run folder or a .pth file of the paper's code.") from None
        return model, task, None, path.stem
    raise ConfigError(field, f"{spec} is neither a run folder nor a file",
                      "Give RUN, RUN@<step>, RUN@last or a .pth file.")


def diff_command(argv: list[str]) -> int:
    args = _parse_arguments(argv)
    spec_a, spec_b = _model_specs(args)
    from phasewatch.diff.model_diff import model_diff

    a, task, run_dir_a, label_a = load_model(spec_a, tuple(args.allow))
    b, _, _, label_b = load_model(spec_b, tuple(args.allow), "B")
    result = model_diff(a, b, task, per_length=args.per_length)
    name = args.name or f"{label_a}_vs_{label_b}".replace("/", "_")
    summarise(result, label_a, label_b, args.top)
    folder = RunFolder(run_dir_a) if run_dir_a is not None else RunFolder(Path(args.out or "."))
    examples = write_tables(folder, name, result)
    if run_dir_a is not None and not args.no_wandb:
        log_to_wandb(folder, name, spec_a, spec_b, result.rows, examples)
    return 0


def _parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="phasewatch diff",
        description="Diff two models of the same structure: weights, activations, direct logit attribution, "
                    "per-input loss and activation patching, per component.")
    parser.add_argument("a", metavar="A", help="RUN, RUN@<step>, RUN@last or a .pth file")
    parser.add_argument("b", metavar="B", nargs="?", help="the same (not with --across)")
    parser.add_argument("--across", metavar="SERIES",
                        help="with one run A: its checkpoints before and after the largest transition of SERIES "
                             "(e.g. val/loss, heads/induction/max)")
    parser.add_argument("--per-length", type=int, default=256,
                        help="held-out sequences of each held-out batch (one length each for RASP tasks; default 256)")
    parser.add_argument("--top", type=int, default=5, help="rows printed per measure (default 5)")
    parser.add_argument("--name", help="the tables' name (default: A_vs_B)")
    parser.add_argument("--out", help="folder for the tables when A is not a run folder (default: .)")
    parser.add_argument("--no_wandb", action="store_true",
                        help="no W&B run for this diff (none either when A's run was trained with --no_wandb)")
    parser.add_argument("--allow", nargs="+", metavar="MODULE", default=[],
                        help="modules whose classes the runs' configs may name besides phasewatch's and plug-ins'")
    args = parser.parse_args(argv)
    if (args.b is None) == (args.across is None):
        raise ConfigError("B", "give either two models or one run and --across SERIES",
                          "e.g. phasewatch diff runs/x@300 runs/x@3000, or phasewatch diff runs/x --across val/loss")
    return args


def _model_specs(args: argparse.Namespace) -> tuple[str, str]:
    """The two models' specs: as given, or with `--across` A's checkpoints on either side of
    the transition (said in one line)."""
    if not args.across:
        return args.a, args.b
    run_dir, step = parse_model_spec(args.a)
    if step is not None or not run_dir.is_dir():
        raise ConfigError("across", f"{args.a} is not a run folder", "--across takes a run folder alone.")
    before, after, event = across_transition(run_dir, args.across)
    print(f"{args.across}: transition {event['direction']} {event['onset']}-{event['midpoint']}-{event['end']} "
          f"(magnitude {event['magnitude']:.3g}); diffing the checkpoints of steps {before} and {after}")
    return f"{args.a}@{before}", f"{args.a}@{after}"


def write_tables(folder: RunFolder, name: str, result) -> list[dict]:
    """The diff's per-component and per-input tables into `folder` (their paths printed); the
    per-input rows as written."""
    table, inputs = folder.diff_tables(name)
    examples = [{**e, "tokens": " ".join(map(str, e["tokens"])), "change": e["loss_b"] - e["loss_a"]}
                for e in result.examples]
    write_csv(COLUMNS, result.rows, table)
    write_csv(INPUT_COLUMNS, examples, inputs)
    print(f"\n{table}\n{inputs}")
    return examples


def log_to_wandb(folder: RunFolder, name: str, spec_a: str, spec_b: str, rows: list[dict], examples: list[dict]) -> None:
    """The diff's two tables as W&B Tables (`diff/components`, `diff/inputs`) in a new W&B
    run beside A's training run (`<run>-diff-<name>`, job type `diff`); nothing when W&B is
    disabled or the run was trained without it."""
    from phasewatch.loggers.wandb_logger import make_side_logger

    logger = make_side_logger(folder, folder.read_config(), "diff", f"diff-{name}", {"a": spec_a, "b": spec_b})
    if logger is None:
        return
    logger.log_tables({"diff/components": (COLUMNS, [[r.get(c) for c in COLUMNS] for r in rows]),
                       "diff/inputs": (INPUT_COLUMNS, [[e[c] for c in INPUT_COLUMNS] for e in examples])})
    logger.finalize("success")


def summarise(result, label_a: str, label_b: str, top: int) -> None:
    """The console summary: losses, then the components that differ most by each measure."""
    print(f"A = {label_a}, B = {label_b}: held-out loss {result.loss_a:.4g} -> {result.loss_b:.4g}")
    comps = [r for r in result.rows if r["kind"] not in ("resid", "bias")]

    def ranked(title: str, key: str, rows, fmt, absolute: bool = True) -> None:
        have = [r for r in rows if r.get(key) is not None]
        if not have:
            return
        have.sort(key=lambda r: abs(r[key]) if absolute else r[key], reverse=True)
        print(f"\n{title}:")
        for r in have[:top]:
            print(f"  {r['component']:14s} {fmt(r)}")

    ranked("weights (relative Frobenius norm of B - A)", "weight_rel", comps,
           lambda r: f"{r['weight_rel']:.3g}" + (f"   QK {r['qk_rel']:.3g}  OV {r['ov_rel']:.3g}" if "qk_rel" in r
                                                 and r["qk_rel"] is not None else ""))
    ranked("activations (relative difference of outputs)", "act_rel", comps + [r for r in result.rows
                                                                                 if r["kind"] == "resid"],
           lambda r: f"{r['act_rel']:.3g}")
    ranked("direct logit attribution to the correct token (A -> B)", "dla_diff", comps,
           lambda r: f"{r['dla_a']:+.3g} -> {r['dla_b']:+.3g}")
    if any(r.get("patch_b_into_a") is not None for r in comps):
        ranked("patching B's output into A: share of the loss gap recovered", "patch_b_into_a", comps,
               lambda r: f"{r['patch_b_into_a']:8.3g}  (loss {r['patched_loss_a']:.3g}; A into B: share "
                         f"{r['patch_a_into_b']:.3g}, loss {r['patched_loss_b']:.3g})", absolute=False)
    else:
        print("\npatching: the two losses are equal; nothing to recover")
    if result.examples:
        print("\ninputs whose loss changed most:")
        for e in result.examples[:top]:
            tokens = " ".join(map(str, e["tokens"]))
            print(f"  {tokens[:60]:60s} {e['loss_a']:.3g} -> {e['loss_b']:.3g}")


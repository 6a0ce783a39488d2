"""Steps per second of `phasewatch fit` against a hand-written PyTorch loop.

Both train the same TransformerBridge on the same data with the same optimizer and
validate at the same interval; `phasewatch fit` additionally logs to the run folder,
keeps checkpoints on its schedule and draws its progress bar (W&B off). Start-up
(imports, task and model construction) and the first WARMUP steps are excluded: both
are timed from step WARMUP to the end of training. Reported as a ratio measured in the
same process, the median of several alternating repeats (target: >= 0.9).

    python bench/fit_speed.py [--steps 400] [--config quickstart|induction|reverse|digits|grokking] [--proxy] [--parts]
        [--rows ROW ...] [--calls] [--threads N] [--baseline_tree DIR]

`--proxy`: the model shrunk until its arithmetic costs almost nothing (baseline_setup.PROXY_*),
on one thread, so that what is compared is the host's work per step (the CPU proxy of a GPU);
then the process's CPU time is reported too (robust on a machine that others share).
`--parts`: `fit` three ways (`parts`): as it always runs, without probes, and the step itself
(no probes, no watcher, no live report). `--calls`: Python function calls per step (cProfile,
step WARMUP to the end), a measure of host work that another process's load cannot change.
`--baseline_tree DIR`: the same measures on DIR's phasewatch (a `git archive` copy of an older
commit) and on this tree's, one process each, alternated (before/after in one command).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

import torch

os.environ.setdefault("WANDB_MODE", "disabled")

CONFIGS = {"quickstart": "configs/quickstart.yaml", "induction": "configs/induction_2l.yaml",
           "reverse": "configs/reverse.yaml", "digits": "configs/digit_addition.yaml",
           "grokking": "configs/grokking_nanda2023.yaml"}
VAL_EVERY = 25
WARMUP = 50
#: what `fit` runs in each row of --parts (`parts`): everything (the default probes on their
#: schedule, the live watcher, the live report, checkpoints, logging, the progress bar); the same
#: without probes; the step itself (no probes, no watcher, no live report: logging, validation,
#: checkpoints and the progress bar as always)
WITHOUT_PROBES = ["--probes.names", "[]"]
WITHOUT_WATCHER = ["--transitions.every_n_validations", "1000000000", "--report.every_n_validations", "0"]


def parts() -> dict[str, list[str]]:
    """The rows of --parts and their flags (a watcher that also looks on a grid of steps of its
    own, `looks`, is given none)."""
    import inspect

    from phasewatch.callbacks.transitions import TransitionWatcher

    grid = ["--transitions.looks", "0"] if "looks" in inspect.signature(TransitionWatcher).parameters else []
    return {"as always": [], "without probes": WITHOUT_PROBES,
            "the step itself": [*WITHOUT_PROBES, *WITHOUT_WATCHER, *grid]}


class StepTimer:
    """A Lightning callback (built lazily so importing this file stays light) that
    records the time from the start of step WARMUP to the end of training."""

    started: float | None = None
    elapsed: float | None = None
    cpu: float | None = None

    profile = None  # a cProfile.Profile enabled over the same steps (--calls)

    @classmethod
    def callback(cls):
        import lightning.pytorch as pl

        class _Timer(pl.Callback):
            def on_train_batch_start(self, trainer, *args):
                if trainer.global_step == WARMUP:
                    cls.started, cls.cpu = time.perf_counter(), time.process_time()
                    if cls.profile is not None:
                        cls.profile.enable()

            def due_at(self, step: int, dense: bool = False) -> bool:  # it acts at step WARMUP only
                return step == WARMUP

            def on_train_end(self, trainer, *args):
                if cls.profile is not None:
                    cls.profile.disable()
                cls.elapsed, cls.cpu = time.perf_counter() - cls.started, time.process_time() - cls.cpu

        return _Timer()


def calls_per_step(run, steps: int) -> float:
    """Python function calls (cProfile's count, built-in functions included) per step from step
    WARMUP to the end, of `run(profile)`, which enables `profile` over those steps."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    run(profile)
    return pstats.Stats(profile).total_calls / (steps - WARMUP)


def fit_seconds(config: str, steps: int, flags: list[str] = ()) -> tuple[float, float]:
    """Seconds `phasewatch fit` spends on steps WARMUP..steps (W&B off): wall and CPU time."""
    from baseline_setup import fit_with_callback

    with tempfile.TemporaryDirectory() as tmp:
        rc = fit_with_callback(["--config", config, "--trainer.enable_progress_bar", "true", "--run_dir", f"{tmp}/run",
                                "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(VAL_EVERY),
                                "--no_wandb", *flags], StepTimer.callback())
    assert rc == 0
    return StepTimer.elapsed, StepTimer.cpu


def loop_seconds(config: str, steps: int, flags: list[str] = (), profile=None) -> tuple[float, float]:
    """The same model, data, optimizer and validation, in a plain PyTorch loop: wall and CPU time
    (`profile`: a cProfile.Profile enabled over the timed steps)."""
    import torch.nn.functional as F

    from baseline_setup import build_from_config

    t0, cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(0)
    cfg, module = build_from_config(config, flags)
    task = module.task
    batch_size = cfg["data"].get("batch_size")
    model = module.model.original_model
    hp = module.hparams
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=hp.lr,
                            weight_decay=hp.weight_decay, betas=tuple(hp.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / hp.warmup_steps) if hp.warmup_steps else 1.0)
    val = task.val_batches()
    for step in range(steps):
        if step == WARMUP:
            t0, cpu = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
        batch = task.train_batch(step, batch_size)
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[batch.loss_mask].to(module.loss_dtype), batch.targets[batch.loss_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % VAL_EVERY == 0:
            with torch.no_grad():
                for vb in val:
                    vl = model(vb.tokens)
                    F.cross_entropy(vl[vb.loss_mask].to(module.loss_dtype), vb.targets[vb.loss_mask]).item()
    if profile is not None:
        profile.disable()
    return time.perf_counter() - t0, time.process_time() - cpu


def fit_calls(config: str, steps: int, flags: list[str]) -> float:
    """`calls_per_step` of `phasewatch fit`."""
    def run(profile):
        StepTimer.profile = profile
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                fit_seconds(config, steps, flags)
        finally:
            StepTimer.profile = None

    return calls_per_step(run, steps)


def measure(a: argparse.Namespace) -> dict:
    """The loop's and each row's (wall, CPU) seconds, alternated over `a.repeats`, and with
    `a.calls` the calls per step: {"loop": [...], "fit": {row: [...]}, "calls": {...}}."""
    from baseline_setup import proxy_flags

    args = CONFIGS[a.config]
    flags = proxy_flags(args) if a.proxy else []
    rows = {name: extra for name, extra in parts().items() if name in a.rows} if a.parts else {"as always": []}
    out: dict = {"loop": [], "fit": {name: [] for name in rows}, "calls": {}}
    for _ in range(a.repeats):  # alternate, so drift in machine load hits every row alike
        for name, extra in rows.items():
            out["loop"].append(loop_seconds(args, a.steps, flags))
            out["fit"][name].append(fit_seconds(args, a.steps, [*flags, *extra]))
    if a.calls:
        out["calls"]["loop"] = calls_per_step(lambda profile: loop_seconds(args, a.steps, flags, profile), a.steps)
        for name, extra in rows.items():
            out["calls"][name] = fit_calls(args, a.steps, [*flags, *extra])
    return out


def show(a: argparse.Namespace, got: dict, tree: str = "") -> None:
    """Print `measure`'s steps per second, ratios and calls (to stderr)."""
    n = a.steps - WARMUP
    where = f"{tree}config {a.config}{' (proxy)' if a.proxy else ''}, {a.steps} steps, {torch.get_num_threads()} threads"
    for i, what in enumerate(("wall", "CPU")):
        loop_rate = statistics.median(n / f[i] for f in got["loop"])
        print(f"\n{where}, {what} time: hand-written loop {loop_rate:.1f} steps/s ({1e3 / loop_rate:.2f} ms a step)",
              file=sys.stderr)
        for name, runs in got["fit"].items():
            fit_rate = statistics.median(n / f[i] for f in runs)
            print(f"  phasewatch fit, {name}: {fit_rate:.1f} steps/s ({1e3 / fit_rate:.2f} ms), ratio "
                  f"{fit_rate / loop_rate:.2f} (target >= 0.9)", file=sys.stderr)
    if got["calls"]:
        loop_calls = got["calls"]["loop"]
        print(f"\n{where}, Python calls per step: hand-written loop {loop_calls:.0f}", file=sys.stderr)
        for name in got["fit"]:
            calls = got["calls"][name]
            print(f"  phasewatch fit, {name}: {calls:.0f} ({calls / loop_calls:.2f}x the loop's)", file=sys.stderr)


def against_tree(a: argparse.Namespace, argv: list[str]) -> None:
    """`--baseline_tree`: this file run on the baseline tree's phasewatch and on this one's, one
    process each, alternated `a.repeats` times (calls counted in the first of each)."""
    import json
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [x for i, x in enumerate(argv) if x != "--baseline_tree" and (i == 0 or argv[i - 1] != "--baseline_tree")]
    trees = {"before": os.path.abspath(a.baseline_tree), "after": here}
    got: dict[str, dict] = {}
    for r in range(a.repeats):
        for name, tree in trees.items():
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--repeats", "1", "--emit_json"]
            if r and "--calls" in cmd:
                cmd.remove("--calls")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
            one = json.loads(done.stdout.strip().splitlines()[-1])
            mine = got.setdefault(name, {"loop": [], "fit": {k: [] for k in one["fit"]}, "calls": {}})
            mine["loop"] += one["loop"]
            for k, runs in one["fit"].items():
                mine["fit"][k] += runs
            mine["calls"] |= one["calls"]
    for name, tree in trees.items():
        show(a, got[name], f"{name} ({tree}): ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="quickstart")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--proxy", action="store_true", help="the model shrunk, on one thread: host work per step")
    ap.add_argument("--parts", action="store_true", help="fit three ways: as always, without probes, the step itself")
    ap.add_argument("--rows", nargs="+", default=["as always", "without probes", "the step itself"],
                    help="with --parts, only these rows")
    ap.add_argument("--calls", action="store_true", help="also Python function calls per step (load-independent)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 with --proxy, else torch's)")
    ap.add_argument("--baseline_tree", default=None,
                    help="also time another source tree (a `git archive` copy), one process per tree, alternated")
    ap.add_argument("--emit_json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.baseline_tree:
        against_tree(a, sys.argv[1:])
        return 0
    threads = a.threads or (1 if a.proxy else None)
    if threads:
        torch.set_num_threads(threads)
    got = measure(a)
    if a.emit_json:
        import json

        print(json.dumps(got))
    else:
        show(a, got)
    return 0

if __name__ == "__main__":
    sys.exit(main())

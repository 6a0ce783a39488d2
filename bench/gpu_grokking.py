"""The paper's grokking run on a GPU: `phasewatch fit` against a hand-written PyTorch loop.

    python bench/gpu_grokking.py [--config configs/grokking_nanda2023.yaml] [--steps N]
                                 [--device cuda] [--out bench/RESULTS.md]
                                 [--parts loop,fit,bare,plain] [--state bench/gpu_grokking_state.json]

In one process, one after the other on the same device: (1) a hand-written loop (the
config's model as a plain module, its full training batch resident on the device,
AdamW with the same warm-up, the test accuracy read every `val_check_interval` steps);
(2) `phasewatch fit` with the default probes; (3) `phasewatch fit` with no probes (for
the probes' overhead); optionally (4, `plain`) `phasewatch fit` with the default probes
and one optimisation step per Lightning step (`TrainModule.chunks` off: the run before
several steps ran to a Lightning step on a GPU). For each: wall time of the training loop
(start-up excluded), steps per second, the first validation with test accuracy > 99% and
the wall time to it; for the phasewatch run also the detected transitions of the paper's
measures (its events.jsonl). Appends a dated section to `--out` (bench/RESULTS.md). Target: phasewatch
with the default probes at >= 0.9x the hand-written loop's steps per second.

Where one command may run only so long (the device tool: 10 minutes), run the parts in
separate commands on the same machine, e.g. `--parts loop,bare` then `--parts fit`: each
part's result is kept in `--state` (ignored by git) under the config, steps and device,
and the report is written once all three are there. `--profile FILE`: each `phasewatch fit` part
under cProfile, its 40 costliest functions (cumulative time) written to FILE with the part's
name added (FILE_bare.txt, ...: where a step's host time goes on the device).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
GROKKED = 0.99
PHASE_KEYS = ("train/loss", "grok/restricted_loss", "grok/excluded_loss", "grok/gini_neuron_logit",
              "grok/weight_norm", "val/loss", "val/acc")


def loop_run(config: str, steps: int, device: str) -> dict:
    """The hand-written loop; returns its timings."""
    import torch.nn.functional as F
    from baseline_setup import build_from_config

    cfg, module = build_from_config(config)
    torch.manual_seed(cfg.get("seed_everything", 0))
    task, hp = module.task, module.hparams
    model = module.model.original_model.to(device)
    train = task.train_batch(0, cfg["data"].get("batch_size")).to(device)
    (test,) = [b.to(device) for b in task.val_batches()]
    every = cfg["trainer"].get("val_check_interval", 100)
    # fused on a GPU, as phasewatch does: the baseline gets the same one-kernel optimizer step
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=hp.lr,
                            weight_decay=hp.weight_decay, betas=tuple(hp.betas),
                            fused=True if device.startswith("cuda") else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / hp.warmup_steps) if hp.warmup_steps else 1.0)
    grok_step = grok_seconds = None
    _sync(device)
    start = time.perf_counter()
    for step in range(steps):
        logits = model(train.tokens)
        loss = F.cross_entropy(logits[train.loss_mask].to(module.loss_dtype), train.targets[train.loss_mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % every == 0 and grok_step is None:
            with torch.no_grad():
                out = model(test.tokens)[test.loss_mask]
                acc = float((out.argmax(-1) == test.targets[test.loss_mask]).float().mean())
            if acc > GROKKED:
                grok_step, grok_seconds = step + 1, time.perf_counter() - start
    _sync(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps_per_s": steps / seconds, "grok_step": grok_step, "grok_seconds": grok_seconds}


def fit_run(config: str, steps: int, device: str, probes: bool, chunks: bool = True, profile: str | None = None) -> dict:
    """`phasewatch fit` on the device; returns its timings and detected transitions."""
    import lightning.pytorch as pl
    from baseline_setup import fit_with_callback

    from phasewatch.rundir import RunFolder
    from phasewatch.training.module import TrainModule

    clock: dict = {}

    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()

    class Clock(pl.Callback):
        def on_train_start(self, trainer, *args):
            _sync(device)
            clock["start"] = time.perf_counter()
            if profiler is not None:
                profiler.enable()

        def on_validation_end(self, trainer, *args):
            acc = trainer.callback_metrics.get("val/acc")
            if "grok" not in clock and acc is not None and float(acc) > GROKKED:
                clock["grok"] = (trainer.global_step, time.perf_counter() - clock["start"])

        def on_train_end(self, trainer, *args):
            _sync(device)
            clock["seconds"] = time.perf_counter() - clock["start"]
            if profiler is not None:
                import io
                import pstats

                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
                Path(profile).write_text(text.getvalue())

    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    extra = [] if probes else ["--probes.names", "[]"]
    TrainModule.chunks = chunks
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            rc = fit_with_callback(["--config", config, "--run_dir", str(run), "--trainer.max_steps", str(steps),
                                    "--trainer.accelerator", accelerator, "--trainer.enable_progress_bar", "false",
                                    "--no_wandb", *extra], Clock())
            events = RunFolder(run).transitions()  # confirmed ones: onsets and withdrawals have no midpoint
    finally:
        TrainModule.chunks = True
    if rc != 0:
        raise SystemExit(f"phasewatch fit exited with {rc}")
    grok_step, grok_seconds = clock.get("grok", (None, None))
    return {"seconds": clock["seconds"], "steps_per_s": steps / clock["seconds"], "grok_step": grok_step,
            "grok_seconds": grok_seconds, "events": [e for e in events if e["metric"] in PHASE_KEYS]}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def report(config: str, steps: int, device: str, loop: dict, fit: dict, bare: dict, plain: dict | None) -> str:
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"

    def cell(x, fmt):
        return "-" if x is None else format(x, fmt)

    rows = [("hand-written loop", loop), ("phasewatch fit, default probes", fit), ("phasewatch fit, no probes", bare)]
    if plain is not None:
        rows.append(("phasewatch fit, default probes, one step per Lightning step", plain))
    lines = [f"## {config}, {steps:,} steps on {name}, {datetime.date.today()} (torch {torch.__version__})", "",
             "| run | wall time (s) | steps/s | ratio to loop | test acc > 99% at step | wall time to it (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, r in rows:
        lines.append(f"| {label} | {r['seconds']:.1f} | {r['steps_per_s']:.1f} | "
                     f"{r['steps_per_s'] / loop['steps_per_s']:.2f} | {cell(r['grok_step'], ',')} | "
                     f"{cell(r['grok_seconds'], '.1f')} |")
    overhead = fit["seconds"] / bare["seconds"] - 1
    lines += ["", f"Probe overhead (default probes against none): {100 * overhead:.1f}% of training time.", "",
              "Detected transitions (phasewatch fit, default probes):", "",
              "| metric | direction | onset | midpoint | end |", "| --- | --- | --- | --- | --- |"]
    confirmed = [e for e in fit["events"] if e.get("stage", "confirmed") == "confirmed"]  # also in an older state file
    for e in sorted(confirmed, key=lambda e: e["midpoint"]):
        lines.append(f"| {e['metric']} | {e['direction']} | {e['onset']:,} | {e['midpoint']:,} | {e['end']:,} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/grokking_nanda2023.yaml")
    ap.add_argument("--steps", type=int, default=None, help="default: the config's trainer.max_steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench/RESULTS.md")
    ap.add_argument("--parts", default="loop,fit,bare",
                    help="which runs now (loop, fit, bare, plain), comma-separated; the others come from --state")
    ap.add_argument("--state", default="bench/gpu_grokking_state.json", help="results of earlier parts")
    ap.add_argument("--profile", default=None, help="each fit part's cProfile (40 costliest functions), FILE_<part>.txt")
    a = ap.parse_args()
    import yaml

    steps = a.steps or yaml.safe_load(open(a.config))["trainer"]["max_steps"]
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - {"loop", "fit", "bare", "plain"}:
        ap.error(f"--parts takes loop, fit, bare and plain, not {a.parts!r}")
    state_file = Path(a.state)
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    key = f"{a.config} {steps} {a.device}"
    done = state.setdefault(key, {})
    for part in parts:
        if part == "loop":
            done[part] = loop_run(a.config, steps, a.device)
        else:
            done[part] = fit_run(a.config, steps, a.device, probes=part != "bare", chunks=part != "plain",
                                 profile=a.profile and str(Path(a.profile).with_name(f"{Path(a.profile).stem}_{part}.txt")))
        print(f"{part}: {({k: v for k, v in done[part].items() if k != 'events'})}", file=sys.stderr)
        state_file.write_text(json.dumps(state, indent=1))
    missing = [p for p in ("loop", "fit", "bare") if p not in done]
    if missing:
        print(f"kept in {state_file}; still to run for the report: --parts {','.join(missing)}", file=sys.stderr)
        return 0
    text = report(a.config, steps, a.device, done["loop"], done["fit"], done["bare"], done.get("plain"))
    del state[key]  # reported: a later sitting measures again
    state_file.write_text(json.dumps(state, indent=1))
    out = Path(a.out)
    out.write_text((out.read_text() + "\n" if out.exists() else "# Benchmark results\n\n") + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

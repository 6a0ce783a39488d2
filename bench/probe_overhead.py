"""Probe overhead: the time of one probe run as a ratio to one training step, and the
training-time overhead of the default probe schedule (target: under 10%).

Both in this process on the same model, interleaved (four training steps, then each probe once,
`--repeats` times; medians of CPU time): a training step (forward, backward, AdamW) of the task's
natural batch, and each default probe as the callback runs it (`measure`, then `record_results`
writing its arrays); overhead = probe runs x probe time / (max_steps x step time). Two counts of
runs: the schedule's (cheap probes at every validation), and the most that adaptive resolution
can add (every step of the watcher's dense grid, as if an onset were pending all run), with the
bound a budget (`--probes.budget 0.1`) sets on it: at most the larger of the schedule's share
and the budget (plus one run). `--calls`: Python function calls per probe run (cProfile).

    python bench/probe_overhead.py [--config configs/quickstart.yaml ...] [--markdown] [--calls]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time

import torch
from baseline_setup import build_from_config

from phasewatch.callbacks.probes import ProbeRunner, measure as measure_probes, record_results
from phasewatch.callbacks.transitions import TransitionWatcher
from phasewatch.probes import default_probes, get_probe
from phasewatch.callbacks.schedule import Schedule
from phasewatch.rundir import RunFolder
from phasewatch.training.module import masked_loss


def measure(config: str, repeats: int, calls: bool = False) -> list[dict]:
    """One row per default probe of the config: its time, in training steps, runs and overhead
    (and `calls`: Python calls per run)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(config, repeats, calls, RunFolder(tmp))


def _measure(config: str, repeats: int, calls: bool, folder: RunFolder) -> list[dict]:
    cfg, module = build_from_config(config)
    task = module.task
    native = module.model.original_model
    opt = torch.optim.AdamW(native.parameters(), lr=1e-3)
    batch = task.train_batch(0, cfg["data"].get("batch_size"))

    def step():
        loss = masked_loss(native(batch.tokens), batch, module.loss_dtype)
        opt.zero_grad()
        loss.backward()
        opt.step()

    max_steps = cfg["trainer"]["max_steps"]
    val_every = cfg["trainer"].get("val_check_interval", 25)
    probes_cfg = cfg.get("probes") or {}
    schedule = Schedule(**probes_cfg["schedule"]) if probes_cfg.get("schedule") else ProbeRunner().schedule
    scheduled = set(schedule.resolve(max_steps))
    options = probes_cfg.get("options") or {}
    validations = set(range(val_every, max_steps + 1, val_every))
    dense = set(Schedule(kind="log", count=TransitionWatcher().dense_count).resolve(max_steps))
    probes = {name: get_probe(name, task) for name in probes_cfg.get("names") or default_probes(task)}

    written = [0]  # the step each run's arrays are written at (a new file each run, as in a run)

    def probe_run(name):
        written[0] += 1
        record_results(measure_probes(module.model, task, [probes[name]], options), folder, written[0])

    # interleaved (4 steps, then each probe once, `repeats` times; medians): this machine's
    # speed drifts, and the ratio of probe to step time is what the table reports
    times: dict[str, list[float]] = {"step": [], **{name: [] for name in probes}}
    jobs = [("step", step)] * 4 + [(name, lambda name=name: probe_run(name)) for name in probes]
    for _, job in jobs:
        job()  # a first run: compiles and caches
    for _ in range(repeats):
        for name, job in jobs:
            started = time.process_time()
            job()
            times[name].append(time.process_time() - started)
    counted = {}
    for name, job in jobs[4:] if calls else []:
        profile = cProfile.Profile()
        profile.runcall(job)
        counted[name] = pstats.Stats(profile).total_calls
    step_s = statistics.median(times["step"])
    print(f"{config}: one training step {step_s * 1e3:.1f} ms; {max_steps} steps", file=sys.stderr)
    rows = []
    for name, probe in probes.items():
        probe_s = statistics.median(times[name])
        steps = validations if probe.cheap else scheduled
        rows.append(dict(config=config, probe=name, ms=probe_s * 1e3, in_steps=probe_s / step_s, calls=counted.get(name),
                         runs=len(steps), runs_dense=len(steps | dense), cheap=probe.cheap,
                         overhead=len(steps) * probe_s / (max_steps * step_s),
                         overhead_dense=len(steps | dense) * probe_s / (max_steps * step_s)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", default=["configs/quickstart.yaml"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--markdown", action="store_true", help="one table for all configs, with totals")
    ap.add_argument("--budget", type=float, default=0.1, help="a probe budget (--probes.budget)")
    ap.add_argument("--calls", action="store_true", help="also Python function calls per probe run")
    a = ap.parse_args()
    extra = " | calls a run" if a.calls else ""
    if a.markdown:
        print("| config | probe | one run | in training steps | runs (schedule) | overhead | runs, adaptive at most "
              f"| overhead | adaptive, within the budget{extra} |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | ---" + " | ---" * a.calls + " |")
    for config in a.config:
        rows = measure(config, a.repeats, a.calls)
        for r in rows:
            when = "every validation" if r["cheap"] else "log-spaced"
            calls = f" | {r['calls']:,}" if a.calls else ""
            if a.markdown:
                print(f"| {config} | {r['probe']} | {r['ms']:.1f} ms | {r['in_steps']:.1f} | {r['runs']} ({when}) "
                      f"| {100 * r['overhead']:.1f}% | {r['runs_dense']} | {100 * r['overhead_dense']:.1f}% | {calls} |")
            else:
                print(f"  probe {r['probe']}: {r['ms']:.1f} ms = {r['in_steps']:.1f} training steps; {r['runs']} runs "
                      f"({when}), at most {r['runs_dense']} with adaptive resolution"
                      + (f"; {r['calls']:,} Python calls a run" if a.calls else ""))
        total = sum(r["overhead"] for r in rows)
        total_dense = sum(r["overhead_dense"] for r in rows)
        bounded = min(total_dense, max(total, a.budget))
        if a.markdown:
            print(f"| {config} | **all** | | | | **{100 * total:.1f}%** | | **{100 * total_dense:.1f}%** "
                  f"| **{100 * bounded:.1f}%**{' |' * a.calls} |")
        else:
            print(f"  default schedule overhead: {100 * total:.1f}% of training time, at most {100 * total_dense:.1f}% "
                  f"with adaptive resolution, {100 * bounded:.1f}% within the budget (target < 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

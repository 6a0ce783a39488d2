"""Probe overhead: the time of one probe run as a ratio to one training step, and the
training-time overhead of the default probe schedule (target: under 10%).

Both measured in this process on the same model: a training step (forward, backward,
AdamW) of the task's natural batch, and each default probe of the task; then the
overhead of the default schedule = probe runs x probe time / (max_steps x step time).

    python bench/probe_overhead.py [--config configs/quickstart.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from baseline_setup import build_from_config

from phasewatch.callbacks.probes import ProbeRunner
from phasewatch.probes import default_probes, get_probe
from phasewatch.trainers.module import masked_loss


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg, module = build_from_config(a.config)
    task = module.task
    native = module.model.original_model
    opt = torch.optim.AdamW(native.parameters(), lr=1e-3)
    batch = task.train_batch(0, cfg["data"].get("batch_size"))

    def step():
        loss = masked_loss(native(batch.tokens), batch, module.loss_dtype)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step_s = timed(step, a.repeats * 4)
    max_steps = cfg["trainer"]["max_steps"]
    val_every = cfg["trainer"].get("val_check_interval", 25)
    runner = ProbeRunner()
    scheduled = len(runner.schedule.resolve(max_steps))
    print(f"{a.config}: one training step {step_s * 1e3:.1f} ms; {max_steps} steps")
    total = 0.0
    for name in default_probes(task):
        probe = get_probe(name, task)
        module.model.eval()
        with torch.no_grad():
            probe_s = timed(lambda: probe(module.model, task), a.repeats)
        module.model.train()
        runs = max_steps // val_every if probe.cheap else scheduled
        total += runs * probe_s
        print(f"  probe {name}: {probe_s * 1e3:.1f} ms = {probe_s / step_s:.1f} training steps; "
              f"{runs} runs ({'every validation' if probe.cheap else 'log-spaced schedule'})")
    print(f"  default schedule overhead: {100 * total / (max_steps * step_s):.1f}% of training time (target < 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The live watcher's looks in a population (issue 45): how many, how many made whole, their CPU.

A proxy population (baseline_setup.proxy_flags: the model shrunk, one thread) of `--config`
with the config's default probes; counts the members' `TransitionWatcher.look` calls, those
made whole (`stage_news` called; the others were cut short: nothing new to see), the detector's
fits in them (`detect_transitions` on a series of 8 points or more; fewer give nothing), of
those made afresh (not an earlier call's answer for the same points: session 18), the CPU time
in them and, with `--profile`, Python calls a member-step under cProfile. `--tree DIR`
times the phasewatch package in DIR (e.g. `git archive <commit> phasewatch bench | tar -x -C
DIR`), so that two trees compare in the same conditions, one process each.

    python bench/watcher_looks.py --members 16 --steps 200 [--profile] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--config", default="configs/induction_2l.yaml")
ap.add_argument("--members", type=int, default=16)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--profile", action="store_true")
ap.add_argument("--tree", default=None, help="the directory holding the phasewatch package to time (default: this one)")
a = ap.parse_args()
tree = os.path.abspath(a.tree or os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [tree, os.path.join(tree, "bench")]
os.environ.setdefault("WANDB_MODE", "disabled")

import cProfile  # noqa: E402
import pstats  # noqa: E402

import torch  # noqa: E402
from baseline_setup import fit_with_callback, proxy_flags  # noqa: E402
import lightning.pytorch as pl  # noqa: E402

import phasewatch  # noqa: E402
import phasewatch.callbacks.transitions as watching  # noqa: E402
import phasewatch.phases.detector as detector  # noqa: E402
from phasewatch.callbacks.transitions import TransitionWatcher  # noqa: E402

assert phasewatch.__file__.startswith(tree), f"phasewatch from {phasewatch.__file__}, not {tree}"
torch.set_num_threads(1)
count = {"looks": 0, "whole": 0, "cpu": 0.0, "fits": 0, "afresh": 0}
LOOK, STAGE_NEWS, DETECT = TransitionWatcher.look, TransitionWatcher.stage_news, watching.detect_transitions


def look(self, *args, **kwargs):
    count["looks"] += 1
    t = time.process_time()
    try:
        return LOOK(self, *args, **kwargs)
    finally:
        count["cpu"] += time.process_time() - t


def stage_news(self, *args, **kwargs):
    count["whole"] += 1
    return STAGE_NEWS(self, *args, **kwargs)


def detect_transitions(steps, *args, **kwargs):
    count["fits"] += len(steps) >= 8
    return DETECT(steps, *args, **kwargs)


TransitionWatcher.look, TransitionWatcher.stage_news = look, stage_news
AFRESH = getattr(detector, "_detect", None)  # a tree from before session 18 makes every fit afresh


def afresh(*args, **kwargs):
    count["afresh"] += 1
    return AFRESH(*args, **kwargs)


if AFRESH is not None:
    detector._detect = afresh
watching.detect_transitions = detect_transitions


def args(folder: str, seeds: str) -> list[str]:
    return ["--config", a.config, "--run_dir", f"{folder}/run", "--trainer.max_steps", str(a.steps),
            "--trainer.accelerator", "cpu", "--no_wandb", "--report.every_n_validations", "0",
            "--trainer.enable_progress_bar", "false", *proxy_flags(a.config), "--population.seeds", seeds]


with tempfile.TemporaryDirectory() as tmp:
    fit_with_callback(args(tmp, "0-1"), pl.Callback())  # imports and first calls
count.update(looks=0, whole=0, cpu=0.0, fits=0, afresh=0)
profile = cProfile.Profile()
with tempfile.TemporaryDirectory() as tmp:
    t0 = time.process_time()
    if a.profile:
        profile.enable()
    fit_with_callback(args(tmp, f"0-{a.members - 1}"), pl.Callback())
    if a.profile:
        profile.disable()
    cpu = time.process_time() - t0
print(f"{tree}: {a.members} members x {a.steps} steps: looks {count['looks']}, made whole {count['whole']}, "
      f"detector fits {count['fits']} ({count['afresh'] if AFRESH else count['fits']} afresh), "
      f"CPU in looks {count['cpu']:.2f} s of {cpu:.2f} s")
if a.profile:
    calls = pstats.Stats(profile).total_calls
    print(f"Python calls under cProfile: {calls} ({calls / (a.members * a.steps):.0f} a member-step)")

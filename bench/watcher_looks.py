"""The live watcher's looks in a population (issue 45): how many, how many made whole, their CPU.

A proxy population (baseline_setup.proxy_flags: the model shrunk, one thread) of `--config`
with the config's default probes; counts the members' `TransitionWatcher.look` calls, those
made whole (`stage_news` called; the others were cut short: nothing new to see), the detector's
fits in them (`detect_transitions` on a series of 8 points or more; fewer give nothing), of
those made afresh (not an earlier call's answer for the same points: session 18), the CPU time
in them and, with `--profile`, Python calls a member-step under cProfile. `--tree DIR`
times the phasewatch package in DIR (e.g. `git archive <commit> phasewatch bench | tar -x -C
DIR`), so that two trees compare in the same conditions, one process each.

`--record FILE` keeps the inputs of every fit made afresh and of every departure test (a pickle);
`--replay FILE` makes them again, without training, on this tree (or `--tree`'s) and prints
the CPU time they take; with `--answers OUT` it writes their answers, so that two trees'
answers compare event for event (`--compare A B`: the events' steps, kinds and fields equal,
floats bit for bit, or to `--tolerance` relative).

    python bench/watcher_looks.py --members 16 --steps 200 [--profile] [--tree DIR] [--record FILE] [--flags '...']
    python bench/watcher_looks.py --replay FILE [--tree DIR] [--answers OUT]
    python bench/watcher_looks.py --compare A B
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
ap.add_argument("--record", default=None, help="keep the inputs of the fits made afresh and of the departure tests here")
ap.add_argument("--replay", default=None, help="make the fits and departure tests of a --record file again, no training")
ap.add_argument("--answers", default=None, help="with --replay: write the answers here")
ap.add_argument("--compare", nargs=2, default=None, help="two --answers files: the same events?")
ap.add_argument("--tolerance", type=float, default=0.0,
                help="with --compare: floats may differ by this much, relative (default 0: bit for bit)")
ap.add_argument("--repeats", type=int, default=1, help="with --replay: make them this many times (CPU of each)")
ap.add_argument("--flags", default="", help="more `phasewatch fit` flags, e.g. '--transitions.logs_per_doubling 16'")
a = ap.parse_args()
#: floats in two trees' answers agree to this relative difference (0: exactly)
TOLERANCE = a.tolerance


def same(x, y) -> bool:
    """Two answers (events, lists, dicts, numbers) equal, floats to `TOLERANCE` relative."""
    if isinstance(x, float) and isinstance(y, float):
        return x == y or abs(x - y) <= TOLERANCE * max(abs(x), abs(y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


if a.compare:
    import pickle

    answers = [pickle.load(open(f, "rb")) for f in a.compare]
    assert len(answers[0]) == len(answers[1]), "not the same record"
    differ = [i for i, (x, y) in enumerate(zip(*answers)) if not same(x, y)]
    events = sum(len(x) if isinstance(x, list) else x is not None for x in answers[0])
    how = f"floats to {TOLERANCE:g} relative" if TOLERANCE else "bit for bit"
    print(f"{len(answers[0])} calls ({events} events), compared {how}: {len(differ)} differ"
          + (f", the first {differ[:10]}" if differ else ""))
    sys.exit(1 if differ else 0)
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
if a.replay:
    import pickle

    calls = pickle.load(open(a.replay, "rb"))
    run = {"fit": detector._detect, "departure": detector._departure}
    for repeat in range(a.repeats):
        t = time.process_time()
        out = [run[what](*inputs) for what, inputs in calls]
        fits = sum(what == "fit" for what, _ in calls)
        print(f"{tree}: replayed {fits} fits and {len(calls) - fits} departure tests: "
              f"CPU {time.process_time() - t:.2f} s")
    if a.answers:
        pickle.dump(out, open(a.answers, "wb"))
    sys.exit(0)
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


recorded: list[tuple[str, tuple]] = []
DEPART = detector._departure


def afresh(*args, **kwargs):
    count["afresh"] += 1
    if a.record:
        recorded.append(("fit", args))
    return AFRESH(*args, **kwargs)


def departed(*args):
    if a.record:
        recorded.append(("departure", args))
    return DEPART(*args)


if AFRESH is not None:
    detector._detect = afresh
detector._departure = departed
watching.detect_transitions = detect_transitions


def args(folder: str, seeds: str) -> list[str]:
    return ["--config", a.config, "--run_dir", f"{folder}/run", "--trainer.max_steps", str(a.steps),
            "--trainer.accelerator", "cpu", "--no_wandb", "--report.every_n_validations", "0",
            "--trainer.enable_progress_bar", "false", *proxy_flags(a.config), "--population.seeds", seeds, *a.flags.split()]


with tempfile.TemporaryDirectory() as tmp:
    fit_with_callback(args(tmp, "0-1"), pl.Callback())  # imports and first calls
count.update(looks=0, whole=0, cpu=0.0, fits=0, afresh=0)
recorded.clear()
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
if a.record:
    import pickle

    pickle.dump(recorded, open(a.record, "wb"))
    print(f"recorded {len(recorded)} calls in {a.record}")
if a.profile:
    calls = pstats.Stats(profile).total_calls
    print(f"Python calls under cProfile: {calls} ({calls / (a.members * a.steps):.0f} a member-step)")

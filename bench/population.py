"""Populations: many copies of a model in one vectorised pass (issue 21).

Two measurements, each against its baseline in the same run:

- `--part train`: population training. `phasewatch fit --population.seeds 0-<N-1>` (one
  process, one vectorised step for all members) against N runs of `phasewatch fit` one
  after the other, in this process (so neither pays Python's start-up; sequential
  processes would each pay it too). Every run trains `--steps` steps of the config with
  its validation schedule, no probes (with `--probes default` too: the task's default probes
  on their default schedule), no W&B, checkpoints at step 0 and the end. The
  sequential time is N x the median of `--solo` runs alone, of seeds 0, 1, ... as members
  0, 1, ... are (`seed_everything` k, and the data seed k where the members' data varies):
  seeds differ in cost, since a run with a transition under way gets adaptive resolution's
  extra checkpoints. Reported: member-steps per second each way and their ratio (of the
  whole command, and of the training loop alone), the training loop's milliseconds per
  member-step, and on CUDA the peak memory per member. `--proxy` shrinks the model until its
  arithmetic costs almost nothing (baseline_setup.PROXY_*) and runs on one thread, so that the
  host's work is what is timed; it then reports the process's CPU time, which others' load on a
  shared machine disturbs less than the wall clock, and the population's CPU seconds before the
  training loop (parse, build), in it and after it (stages, figures, reports). `--baseline_tree DIR` times the code in
  DIR (the phasewatch package before a change) too, in a child process, config by config.
- `--part llc`: the LLC probe's SGLD chains side by side (`torch.func.vmap`, the default
  with 4+ chains) against one after the other, at the same number of chains and draws, on
  each config's model and training data. Both follow the same paths
  (tests/unit/test_llc.py); the table gives the time of one estimate each way, their ratio,
  and the two estimates.

    python bench/population.py --part train [--config ...] [--members 1 4 16] [--steps 100] [--markdown]
    python bench/population.py --part train --proxy --baseline_tree ../base --probes none default ...  # host work
    python bench/population.py --part llc [--config ...] [--chains 2 4 8] [--draws 100] [--markdown]
    python bench/population.py --device cuda --members 1 16 64 ...   # the GPU variant
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from baseline_setup import build_from_config  # noqa: E402

from phasewatch.probes.llc import DEFAULTS, training_loss_llc  # noqa: E402


def time_llc(model, task, side_by_side: bool, repeats: int, **settings) -> tuple[float, dict]:
    """(median seconds of one estimate, its output)."""
    times, out = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = training_loss_llc(model, task, side_by_side=side_by_side, **settings)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def time_fit(config: str, steps: int, device: str, seeds: str | None, seed: int | None = None,
             data_seed: bool = False, flags: list[str] = (), probes: bool = False) -> dict:
    """One `phasewatch fit` of `config` (with `flags`; with `probes` the config's probes, the
    task's default ones on their default schedule, else none): a population when `seeds` is given, else
    the run alone of member `seed` (its `seed_everything`, and with `data_seed` its data seed
    too: training/population.py's `member_config`); the config's own seeds when `seed` is None.
    Its seconds: `wall` (the whole command: set-up, training, the reports after it) and `loop`
    (the training loop, from on_train_start to on_train_end: the host's work per step on the
    proxy), and the process's CPU time of each (`cpu`, `loop_cpu`: on one thread, the host's
    work whatever else the machine runs) and of what comes before the loop (`before_cpu`: the
    parse, the members' build) and after it (`after_cpu`: the stages, figures and reports)."""
    import tempfile

    import lightning.pytorch as pl
    from baseline_setup import fit_with_callback

    clock: dict = {}

    class Clock(pl.Callback):
        def on_train_start(self, trainer, *args):
            _sync(device)
            clock["start"], clock["cpu"] = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer, *args):
            _sync(device)
            clock["loop"], clock["loop_cpu"] = time.perf_counter() - clock["start"], time.process_time() - clock["cpu"]

    with tempfile.TemporaryDirectory() as tmp:
        args = ["--config", config, "--run_dir", f"{tmp}/run", "--trainer.max_steps", str(steps),
                "--trainer.accelerator", device, "--no_wandb", *([] if probes else ["--probes.names", "[]"]),
                "--report.every_n_validations", "0", "--trainer.enable_progress_bar", "false",
                "--checkpoints.schedule", '{"kind": "list", "steps": [0]}', "--checkpoints.last_every", str(steps),
                *flags]
        if seeds is not None:
            args += ["--population.seeds", seeds]
        if seed is not None:
            args += ["--seed_everything", str(seed)] + (["--data.task.init_args.seed", str(seed)] if data_seed else [])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0, cpu = time.perf_counter(), time.process_time()
        if fit_with_callback(args, Clock()) != 0:
            raise SystemExit(f"phasewatch fit failed: {' '.join(args)}")
        total = time.process_time() - cpu
        return {"wall": time.perf_counter() - t0, "cpu": total, "loop": clock["loop"], "loop_cpu": clock["loop_cpu"],
                "before_cpu": clock["cpu"] - cpu, "after_cpu": total - (clock["cpu"] - cpu) - clock["loop_cpu"]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def bench_training(a, configs: list[str], warm: bool) -> list[dict]:
    """Rows of `--part train` for this process's phasewatch (`warm`: a warm-up fit first)."""
    from baseline_setup import proxy_flags

    rows = []
    flags0 = proxy_flags(configs[0]) if a.proxy else []
    if warm:  # the first fit in a process imports and compiles
        time_fit(configs[0], 2, a.device, None, flags=flags0)
        time_fit(configs[0], 2, a.device, "0-1", flags=flags0)
    for config, probes in ((c, p) for c in configs for p in a.probes):
        flags, probed = (proxy_flags(config) if a.proxy else []), probes == "default"
        varies = not build_from_config(config, flags)[1].task.full_batch  # as --population.vary_data's default
        solo = _median([time_fit(config, a.steps, a.device, None, seed=k, data_seed=varies, flags=flags,
                                 probes=probed) for k in range(a.solo)])
        for n in a.members:
            together = time_fit(config, a.steps, a.device, f"0-{n - 1}", flags=flags, probes=probed)
            memory = torch.cuda.max_memory_allocated() / n / 2**20 if a.device == "cuda" else None
            row = dict(config=config, members=n, path=a.label, probes=probes, solo=solo["wall"], together=together["wall"],
                       ratio=n * solo["wall"] / together["wall"], loop_ratio=n * solo["loop"] / together["loop"],
                       cpu_ratio=n * solo["cpu"] / together["cpu"],
                       loop_cpu_ratio=n * solo["loop_cpu"] / together["loop_cpu"],
                       ms_alone=1e3 * solo["loop"] / a.steps, ms_together=1e3 * together["loop"] / (n * a.steps),
                       cpu_ms_alone=1e3 * solo["loop_cpu"] / a.steps,
                       cpu_ms_together=1e3 * together["loop_cpu"] / (n * a.steps),
                       rate_apart=a.steps / solo["wall"], rate_together=n * a.steps / together["wall"], memory=memory,
                       cpu_together=together["cpu"], cpu_before=together["before_cpu"], cpu_after=together["after_cpu"],
                       cpu_loop=together["loop_cpu"])
            rows.append(row)
            print(f"[{a.label}] {config} ({probes} probes): {n} members x {a.steps} steps: one after the other {n * solo['wall']:.1f} s "
                  f"({row['rate_apart']:.1f} member-steps/s), together {together['wall']:.1f} s "
                  f"({row['rate_together']:.1f} member-steps/s): {row['ratio']:.2f}x; training loop "
                  f"{row['loop_ratio']:.2f}x, {row['ms_together']:.2f} ms a member-step together, "
                  f"{row['ms_alone']:.2f} alone; CPU time {row['cpu_ratio']:.2f}x, in the loop "
                  f"{row['loop_cpu_ratio']:.2f}x, {row['cpu_ms_together']:.2f} ms a member-step together, "
                  f"{row['cpu_ms_alone']:.2f} alone", file=sys.stderr)
    return rows


def baseline_rows(a, configs: list[str]) -> list[dict]:
    """The same measurement of `configs` with the phasewatch package of `--baseline_tree` (the
    code before a change, e.g. `git worktree add ../base <commit>`), in a child process."""
    import json
    import os
    import subprocess

    argv = [sys.executable, __file__, "--json", "--label", "before", "--steps", str(a.steps), "--solo", str(a.solo),
            "--device", a.device, "--config", *configs, "--members", *map(str, a.members), "--probes", *a.probes,
            *(["--proxy"] if a.proxy else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(a.baseline_tree).resolve()),
                                                       os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, check=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def print_training(rows: list[dict], cpu: bool) -> None:
    """The table; with `cpu`, of the process's CPU time (the proxy on a shared machine)."""
    what = "CPU time" if cpu else "wall time"
    split = " | together, CPU s: all = before the loop + loop + after" if cpu else ""
    print(f"| config | probes | members | code | one after the other | together | speed-up ({what}) | speed-up, "
          f"training loop | ms per member-step together (alone), training loop | memory per member{split} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if cpu else ""))
    for r in rows:
        memory = f"{r['memory']:.0f} MiB" if r["memory"] is not None else "-"
        ratio, loop = (r["cpu_ratio"], r["loop_cpu_ratio"]) if cpu else (r["ratio"], r["loop_ratio"])
        ms = (r["cpu_ms_together"], r["cpu_ms_alone"]) if cpu else (r["ms_together"], r["ms_alone"])
        parts = (f" {r['cpu_together']:.1f} = {r['cpu_before']:.1f} + {r['cpu_loop']:.1f} + {r['cpu_after']:.1f} |"
                 if cpu and "cpu_before" in r else " - |" if cpu else "")
        print(f"| {r['config']} | {r.get('probes', 'none')} | {r['members']} | {r['path']} | {r['members'] * r['solo']:.1f} s "
              f"({r['rate_apart']:.1f}/s) | {r['together']:.1f} s ({r['rate_together']:.1f}/s) | "
              f"{ratio:.2f}x | {loop:.2f}x | {ms[0]:.2f} ({ms[1]:.2f}) | {memory} |{parts}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["train", "llc"], default="train")
    ap.add_argument("--config", nargs="+", default=["configs/quickstart.yaml", "configs/induction_2l.yaml",
                                                     "configs/reverse.yaml"])
    ap.add_argument("--members", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--probes", nargs="+", choices=["none", "default"], default=["none"],
                    help="without probes, and/or with the config's default probes on their default schedule")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--solo", type=int, default=2, help="runs alone timed, of seeds 0.. (the median is used)")
    ap.add_argument("--chains", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--burn_in", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--proxy", action="store_true",
                    help="the CPU proxy: the model shrunk (baseline_setup.PROXY_*) on one thread, so host work is timed")
    ap.add_argument("--baseline_tree", default=None,
                    help="a folder holding the phasewatch package before a change: measured too, in a child process")
    ap.add_argument("--label", default="after", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.proxy:
        torch.set_num_threads(1)
    if a.part == "train":
        rows = []
        for i, config in enumerate(a.config):  # before and after, config by config
            if a.baseline_tree:
                rows += baseline_rows(a, [config])
            rows += bench_training(a, [config], warm=i == 0)
        if a.json:
            import json

            print(json.dumps(rows))
        if a.markdown:
            print_training(sorted(rows, key=lambda r: (r["config"], r.get("probes", "none"), r["members"],
                                                       r["path"] != "before")), a.proxy)
        return 0
    rows = []
    for config in a.config:
        _, module = build_from_config(config)
        model, task = module.model.to(a.device), module.task
        model.eval()
        for chains in a.chains:
            settings = {**{k: v for k, v in DEFAULTS.items() if k != "side_by_side"},  # each timed both ways
                        "chains": chains, "draws": a.draws, "burn_in": a.burn_in}
            apart_s, apart = time_llc(model, task, False, a.repeats, **settings)
            together_s, together = time_llc(model, task, True, a.repeats, **settings)
            row = dict(config=config, chains=chains, apart=apart_s, together=together_s, ratio=apart_s / together_s,
                       llc_apart=apart["llc"], llc_together=together["llc"])
            rows.append(row)
            print(f"{config}: {chains} chains x {a.burn_in + a.draws} steps: one after the other {apart_s:.2f} s, "
                  f"side by side {together_s:.2f} s ({row['ratio']:.2f}x); LLC {apart['llc']} / {together['llc']}",
                  file=sys.stderr)
    if a.markdown:
        print("| config | chains | one after the other | side by side | speed-up | LLC (apart / together) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            llc = (f"{r['llc_apart']:.4g} / {r['llc_together']:.4g}" if r["llc_apart"] is not None
                   and r["llc_together"] is not None else "did not converge")
            print(f"| {r['config']} | {r['chains']} | {r['apart']:.2f} s | {r['together']:.2f} s | "
                  f"{r['ratio']:.2f}x | {llc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibrate the LLC probe's SGLD step size on a run's own checkpoints.

    python bench/llc_calibration.py runs/<name> [--steps 0 500 3000] [--step-sizes 3e-5 1e-4 3e-4]
        [--gamma 300] [--chains 2] [--draws 200] [--burn-in 200] [--batch-size 256]

For each chosen checkpoint (default: the first, a middle and the last saved one) and
each step size: the estimate, its spread across chains, and the drift of the chains'
mean loss between the two halves of the draws (probes/llc.py: calibrate_llc), then the
step size `recommend_step_size` picks at every checkpoint. Use the smallest of the
recommendations for the whole run (`phasewatch analyze RUN --probes llc --options
'{"llc": {"step_size": ...}}'`), so that one setting is valid at every checkpoint; where
no step size passes at some checkpoint, it says so, names smaller ones to try and exits
with status 1 (no whole-run setting).
"""

from __future__ import annotations

import argparse

from phasewatch.probes.llc import DEFAULTS, calibrate_llc, recommend_step_size
from phasewatch.rundir import RunFolder
from phasewatch.cli.analyze import load_run_module, load_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, nargs="*", help="checkpoint steps (default: first, middle, last)")
    parser.add_argument("--step-sizes", type=float, nargs="*", default=[3e-5, 1e-4, 3e-4])
    parser.add_argument("--chains", type=int, default=DEFAULTS["chains"])
    parser.add_argument("--draws", type=int, default=DEFAULTS["draws"])
    parser.add_argument("--burn-in", type=int, default=DEFAULTS["burn_in"])
    parser.add_argument("--gamma", type=float, default=DEFAULTS["gamma"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    args = parser.parse_args()
    available = RunFolder(args.run_dir).checkpoint_steps()
    steps = args.steps or sorted({list(available)[0], list(available)[len(available) // 2], list(available)[-1]})
    missing = [s for s in steps if s not in available]
    if missing:
        raise SystemExit(f"no checkpoint at steps {missing}; the run has: {', '.join(map(str, available))}")
    module = load_run_module(args.run_dir)
    picks = []
    print(f"{'checkpoint':>10s} {'step size':>10s} {'LLC':>10s} {'std':>8s} {'drift':>7s}")
    for step in steps:
        load_weights(module, available[step])
        rows = calibrate_llc(module.model, module.task, args.step_sizes, chains=args.chains, draws=args.draws,
                             burn_in=args.burn_in, gamma=args.gamma, batch_size=args.batch_size)
        for r in rows:
            if r["converged"]:
                print(f"{step:10d} {r['step_size']:10.0e} {r['llc']:10.2f} {r['std']:8.2f} {r['drift']:7.3f}")
            else:
                print(f"{step:10d} {r['step_size']:10.0e}   did not converge")
        pick = recommend_step_size(rows)
        picks.append(pick)
        print(f"{step:10d} recommended step size: {pick}")
    failed = [step for step, pick in zip(steps, picks) if pick is None]
    if failed:
        # one setting must hold at every checkpoint: none of these step sizes does
        smallest = min(args.step_sizes)
        print(f"for the whole run: none of these step sizes passed at checkpoint(s) "
              f"{', '.join(map(str, failed))}. Try smaller ones (e.g. --step-sizes {smallest / 10:.0e} "
              f"{smallest / 3:.0e} {smallest:.0e}) with more steps (--burn-in 500 --draws 500).")
        raise SystemExit(1)
    print(f"for the whole run: step_size {min(picks)}, gamma {args.gamma}, "
          f"chains {args.chains}, draws {args.draws}, burn_in {args.burn_in}, batch_size {args.batch_size}")


if __name__ == "__main__":
    main()

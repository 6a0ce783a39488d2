"""Populations: many copies of a model in one vectorised pass (issue 21).

Measured so far: the LLC probe's SGLD chains run side by side (`torch.func.vmap`, the
default) against one after the other, at the same number of chains and draws, on each
config's model and training data, in the same process. Both follow the same paths
(tests/unit/test_llc.py); the table gives the time of one LLC estimate each way, their
ratio, and the two estimates.

    python bench/population.py [--config configs/quickstart.yaml ...] [--chains 2 4 8]
                               [--draws 100] [--device cpu|cuda] [--markdown]

Population training (many seeds in one process) is not built yet; its rows will join
this script.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=["configs/quickstart.yaml", "configs/induction_2l.yaml",
                                                     "configs/reverse.yaml"])
    ap.add_argument("--chains", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--burn_in", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    rows = []
    for config in a.config:
        _, module = build_from_config(config)
        model, task = module.model.to(a.device), module.task
        model.eval()
        for chains in a.chains:
            settings = {**DEFAULTS, "chains": chains, "draws": a.draws, "burn_in": a.burn_in}
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

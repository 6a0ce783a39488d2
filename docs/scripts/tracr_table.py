"""The numbers of docs/tracr.md's tables, read from finished run folders.

    python docs/scripts/tracr_table.py runs/reverse_2l runs/reverse_1l ...

Per run: the first probed step where `tracr/agreement` reaches 0.99; at the last probed
step, the held-out accuracy (`val/acc`, and `val_longer/acc` for a length-generalisation
run), the attention match of each compiled head with its best learned head and best
two-head path, the accuracy with each layer's attention and MLP mean-ablated, and, for
the program's output variable, the probe accuracy at every residual site beside its
step-0 baseline.
"""

from __future__ import annotations

import sys

import numpy as np

from phasewatch.rundir import RunFolder


def summarise(run: str) -> list[str]:
    folder = RunFolder(run)
    records = folder.read_metrics()
    probed = [r for r in records if "tracr/agreement" in r]
    validated = [r for r in records if "val/acc" in r]
    last, last_val = probed[-1], validated[-1]
    reached = next((r["step"] for r in probed if r["tracr/agreement"] >= 0.99), None)
    lines = [f"## {run}", f"agreement reaches 0.99: step {reached}; final agreement {last['tracr/agreement']:.3f}",
             f"val/acc {last_val['val/acc']:.3f}" + (f", val_longer/acc {last_val['val_longer/acc']:.3f}"
                                                   if "val_longer/acc" in last_val else "")]
    lengths = sorted(int(k.removeprefix("tracr/agreement/len")) for k in last if k.startswith("tracr/agreement/len"))
    lines.append("agreement per length: " + ", ".join(f"{n}: {last[f'tracr/agreement/len{n}']:.2f}" for n in lengths))
    steps = folder.array_files("tracr", "match_heads")
    heads = [str(h) for h in np.load(steps[-1][1], allow_pickle=False)] if steps else []
    matches = {k.removeprefix("tracr/attn_match/"): v for k, v in last.items() if k.startswith("tracr/attn_match/")}
    def best(ref: str) -> str:  # the learned head (or path) that matches compiled head `ref` best
        head, path = ref.split("/")[0], ref.endswith("/path")
        return next((h.split("=")[1] for h in heads if h.startswith(head + "=") and (">" in h) == path), "?")

    lines.append("attention match: " + "; ".join(f"{ref} {value:.2f} ({best(ref)})"
                                                 for ref, value in sorted(matches.items())))
    ablated = {k.split("/")[1]: v for k, v in last.items() if k.startswith("ablation/") and k.endswith("/acc")
               and "." in k.split("/")[1]}
    lines.append("ablated (acc): " + ", ".join(f"{c} {v:.2f}" for c, v in sorted(ablated.items())))
    output = folder.read_config().get("data", {}).get("task", {}).get("init_args", {}).get("program", "reverse")
    sites = [k.split("/")[-1] for k in last if k.startswith(f"tracr/probe/{output}/")]
    lines.append(f"{output} decodable (probe / baseline): " + ", ".join(
        f"{s} {last[f'tracr/probe/{output}/{s}']:.2f}/{last.get(f'tracr/probe_baseline/{output}/{s}', float('nan')):.2f}"
        for s in sites))
    return lines


if __name__ == "__main__":
    for run in sys.argv[1:]:
        print("\n".join(summarise(run)), end="\n\n")

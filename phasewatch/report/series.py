"""Read logged series from a run folder, a metrics.jsonl file, or a CSV file.

`load_series(path)` returns {key: (steps, values)}: from metrics.jsonl every numeric key
(a half-written last line is skipped); from a CSV every numeric column, with the steps
taken from a column named `step` when there is one and 1, 2, 3, ... otherwise (as in the
progress-measures paper's per-token loss file).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from phasewatch.callbacks.runfiles import read_series

Series = dict[str, tuple[list[float], list[float]]]


def load_series(path: str | Path) -> Series:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: give a run folder, a metrics.jsonl or a CSV file")
    return _from_csv(path) if path.suffix == ".csv" else read_series(path)


def _from_csv(path: Path) -> Series:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return {}
    header, body = rows[0], rows[1:]
    step_col = header.index("step") if "step" in header else None
    out: Series = {}
    for c, name in enumerate(header):
        if c == step_col:
            continue
        steps, values = [], []
        for r, row in enumerate(body):
            try:
                value = float(row[c])
                step = float(row[step_col]) if step_col is not None else r + 1
            except (ValueError, IndexError):
                continue
            if math.isfinite(value):
                steps.append(step)
                values.append(value)
        if values:
            out[name] = (steps, values)
    return out

"""Logged series: {key: (steps, values)} from a run folder's metrics, a metrics file, or a CSV.

`read_series(path)` reads a metrics JSON-lines file: every numeric key, in file order (a
half-written last line is skipped). `read_csv_series(path)` reads a CSV file: every numeric column, with the steps taken from a column named `step`
when there is one and 1, 2, 3, ... otherwise (as in the progress-measures paper's
per-token loss file).
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from phasewatch.rundir.jsonl import read_jsonl

Series = dict[str, tuple[list[float], list[float]]]


def is_number(value: object) -> bool:
    """A logged number (bools are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def series_from_records(records, into: Series | None = None) -> Series:
    """Add every numeric key of metric records `{"step": ..., key: value}` to `into`."""
    out: Series = {} if into is None else into
    for record in records:
        step = record.get("step")
        if step is None:
            continue
        for key, value in record.items():
            if key != "step" and is_number(value):
                steps, values = out.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    return out


def read_series(path: str | os.PathLike) -> Series:
    """Every numeric key of a metrics JSON-lines file as (steps, values), in file order."""
    return series_from_records(read_jsonl(path))


def read_csv_series(path: Path) -> Series:
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

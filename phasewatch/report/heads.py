"""The per-head catalogue: at every step where a probe scored heads, a row for each head with
every score that classifies it, read from the run folder's metrics and arrays whatever probes
ran. `write_head_catalogue` writes it to the run folder; the report draws it as a heads x
scores heatmap with a slider over steps (`catalogue_array`). How keys become columns:
docs/diff.md ("How probe keys become the catalogue's columns")."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from phasewatch.models import head_label
from phasewatch.report.page import load_array
from phasewatch.rundir import RunFolder, is_number, write_csv

HEAD = re.compile(r"L(\d+)H(\d+)")
PAIR = re.compile(r"L(\d+)H(\d+)-L(\d+)H(\d+)")
COMPILED_HEADS = "tracr/attn_match/"  # keys named by the compiled model's heads, not the learned ones


def _head_order(label: str) -> tuple[int, int]:
    layer, head = HEAD.fullmatch(label).groups()
    return int(layer), int(head)


def head_scores(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """head -> {column: score} from one metrics record (see the module docstring)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if not is_number(value) or key.startswith(COMPILED_HEADS):
            continue
        parts = key.split("/")
        heads = [i for i, p in enumerate(parts) if HEAD.fullmatch(p)]
        pairs = [i for i, p in enumerate(parts) if PAIR.fullmatch(p)]
        if len(heads) == 1 and not pairs:
            i = heads[0]
            out.setdefault(parts[i], {})["/".join(parts[:i] + parts[i + 1:])] = float(value)
        elif len(pairs) == 1 and not heads:
            i = pairs[0]
            writer, reader = parts[i].split("-")
            for head, side in ((writer, "out"), (reader, "in")):
                column = "/".join(parts[:i] + [side] + parts[i + 1:])
                scores = out.setdefault(head, {})
                scores[column] = max(scores.get(column, -np.inf), float(value))
    return out


def head_catalogue(folder: RunFolder) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) of the run's catalogue: one row per head per step that scored heads,
    in step then layer/head order."""
    by_step: dict[int, dict[str, dict[str, float]]] = {}
    for record in folder.read_metrics():
        if "step" not in record:
            continue
        scores = head_scores(record)
        for head, values in scores.items():
            by_step.setdefault(int(record["step"]), {}).setdefault(head, {}).update(values)
    for step, path in folder.array_files("tracr", "attn_match"):
        match = load_array(path)
        if match.ndim != 3 or not match.size:
            continue
        best = np.nanmax(np.where(np.isfinite(match), match, -np.inf), axis=0)
        for layer in range(best.shape[0]):
            for head in range(best.shape[1]):
                if np.isfinite(best[layer, head]):
                    by_step.setdefault(step, {}).setdefault(head_label(layer, head), {})["tracr/attn_match"] = \
                        float(best[layer, head])
    columns = sorted({c for heads in by_step.values() for scores in heads.values() for c in scores})
    rows = [{"step": step, "head": head, **by_step[step][head]}
            for step in sorted(by_step) for head in sorted(by_step[step], key=_head_order)]
    return ["step", "head", *columns], rows


def write_head_catalogue(folder: RunFolder, catalogue: tuple[list[str], list[dict[str, Any]]] | None = None
                         ) -> tuple[list[str], list[dict[str, Any]]] | None:
    """Write the run's `heads.csv` (None, and nothing written, when no probe scored heads);
    `catalogue`: `head_catalogue(folder)` when already read."""
    columns, rows = catalogue or head_catalogue(folder)
    if not rows:
        return None
    write_csv(columns, rows, folder.head_catalogue)
    return columns, rows


def catalogue_array(columns: list[str], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The catalogue for the report's heatmaps: one heads x scores matrix per step (a score
    not computed at a step is empty; raw values shown on pointing), shaded by each column's
    range over all steps so that scores of different scales can be read side by side."""
    scores = columns[2:]
    heads = sorted({r["head"] for r in rows}, key=_head_order)
    steps = sorted({r["step"] for r in rows})
    if not scores or not heads:
        return None
    cube = np.full((len(steps), len(heads), len(scores)), np.nan)
    index = {s: i for i, s in enumerate(steps)}
    for r in rows:
        for j, c in enumerate(scores):
            if r.get(c) is not None:
                cube[index[r["step"]], heads.index(r["head"]), j] = r[c]
    with np.errstate(invalid="ignore"):
        lo, hi = np.nanmin(cube, axis=(0, 1)), np.nanmax(cube, axis=(0, 1))
    shade = (cube - lo) / np.where(hi > lo, hi - lo, 1)

    def cells(a: np.ndarray) -> list:
        out = np.round(np.where(np.isfinite(a), a, 0.0), 5).astype(object)
        out[~np.isfinite(a)] = None
        return out.tolist()

    return {"steps": steps, "data": [cells(m) for m in cube],
            "shade": [cells(m) for m in shade], "rows": heads, "cols": scores, "row_title": "head",
            "col_title": "score"}

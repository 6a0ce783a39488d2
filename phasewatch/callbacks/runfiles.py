"""Names and readers of the run folder's append-only files (DESIGN.md "Run folder"),
shared by the callbacks that read them back and by the run store that writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
INTERVENTIONS = "interventions.jsonl"


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines file; a half-written last line (a crash) is skipped."""
    path = Path(path)
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_series(path: str | os.PathLike) -> dict[str, tuple[list[float], list[float]]]:
    """Every numeric key of a metrics.jsonl as (steps, values), in file order."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for record in read_jsonl(path):
        step = record.get("step")
        if step is None:
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = out.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    return out


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (the owner of a run or sweep folder's lock)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""The run folder (DESIGN.md "Run folder"): the source of truth for reports and resumes.

```
runs/<name>/
  config.yaml        fully resolved configuration (re-runnable)
  metrics.jsonl      {"step": int, "<key>": number, ...} per line, flushed as logged
  events.jsonl       phase-transition events
  checkpoints/       step=<N>.ckpt on the schedule, plus last.ckpt
  arrays/            array-valued measurements, keyed by step
  wandb/             the W&B run files
```
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only


class RunStore:
    """Paths and appenders of one run folder."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    config = property(lambda self: self.root / "config.yaml")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    events = property(lambda self: self.root / "events.jsonl")
    checkpoints = property(lambda self: self.root / "checkpoints")
    arrays = property(lambda self: self.root / "arrays")
    last_checkpoint = property(lambda self: self.root / "checkpoints" / "last.ckpt")

    def create(self) -> None:
        for d in (self.root, self.checkpoints, self.arrays):
            d.mkdir(parents=True, exist_ok=True)

    def has_run(self) -> bool:
        """Whether something already lives here (a config or metrics of an earlier run)."""
        return self.config.exists() or self.metrics.exists()

    def append_jsonl(self, path: Path, record: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))

    def truncate_metrics(self, first_step_to_drop: int) -> int:
        """Drop metric lines with step >= first_step_to_drop (what a resumed run will log
        again) and any half-written last line. Atomic; returns the number dropped."""
        if not self.metrics.exists():
            return 0
        lines = self.metrics.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if ln.endswith("\n") and _step_of(ln) is not None and _step_of(ln) < first_step_to_drop]
        tmp = self.metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.metrics)
        return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


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


class RunFolderLogger(Logger):
    """A Lightning logger that appends every logged scalar to the run folder's
    metrics.jsonl, one line per logging call, flushed at once. Non-finite values are
    written as null (JSON has no NaN)."""

    def __init__(self, store: RunStore, name: str):
        super().__init__()
        self.store, self._name = store, name

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return ""

    @property
    def log_dir(self) -> str:
        return str(self.store.root)

    @property
    def root_dir(self) -> str:
        return str(self.store.root)

    @property
    @rank_zero_experiment
    def experiment(self) -> RunStore:
        return self.store

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The CLI writes config.yaml itself; nothing to do."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        record: dict[str, Any] = {"step": int(step) if step is not None else None}
        for key, value in metrics.items():
            if key == "epoch":
                continue
            value = float(value)
            record[key] = value if math.isfinite(value) else None  # JSON has no NaN/inf
        if len(record) > 1:
            self.store.append_jsonl(self.store.metrics, record)

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

import atexit
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from phasewatch.callbacks.runfiles import EVENTS, METRICS, pid_alive, read_jsonl  # noqa: F401  (re-exported)


class RunStore:
    """Paths and appenders of one run folder."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    config = property(lambda self: self.root / "config.yaml")
    metrics = property(lambda self: self.root / METRICS)
    events = property(lambda self: self.root / EVENTS)
    checkpoints = property(lambda self: self.root / "checkpoints")
    arrays = property(lambda self: self.root / "arrays")
    last_checkpoint = property(lambda self: self.root / "checkpoints" / "last.ckpt")

    lock = property(lambda self: self.root / ".lock")

    def create(self, min_free_bytes: int = 64 * 2**20) -> None:
        """Make the folders, or raise ConfigError at once when the place is not writable or
        the disk is (nearly) full: better now than after an hour of training."""
        from phasewatch.tasks.base import ConfigError

        try:
            for d in (self.root, self.checkpoints, self.arrays):
                d.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError("run_dir", f"cannot write to {self.root} ({err.strerror or err})",
                              "Choose a writable --run_dir.") from err
        free = shutil.disk_usage(self.root).free
        if free < min_free_bytes:
            raise ConfigError("run_dir", f"only {free // 2**20} MiB free on the disk of {self.root}",
                              "Free some space or choose a --run_dir on another disk.")

    def acquire_lock(self) -> None:
        """Claim the folder for this process; ConfigError when another live process holds
        it (a lock left by a dead process is taken over). Released at exit."""
        from phasewatch.tasks.base import ConfigError

        if self.lock.exists():
            try:
                pid = int(self.lock.read_text().strip() or 0)
            except (ValueError, OSError):
                pid = 0
            if pid and pid != os.getpid() and pid_alive(pid):
                raise ConfigError("run_dir", f"another phasewatch process (pid {pid}) is writing {self.root}",
                                  "Wait for it to end or stop it, then resume with --ckpt_path last.")
        self.lock.write_text(f"{os.getpid()}\n")
        atexit.register(self.release_lock)

    def release_lock(self) -> None:
        try:
            if self.lock.exists() and self.lock.read_text().strip() == str(os.getpid()):
                self.lock.unlink()
        except OSError:
            pass

    def has_run(self) -> bool:
        """Whether something already lives here (a config or metrics of an earlier run)."""
        return self.config.exists() or self.metrics.exists()

    def append_jsonl(self, path: Path, record: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def rewrite_jsonl(self, path: Path, records: list[dict[str, Any]]) -> None:
        """Replace a JSON-lines file by `records` atomically (a temporary file, then a rename)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, path)

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))

    def snapshot(self) -> dict[str, int]:
        """Sizes of the append-only files now: what a checkpoint records, so that a resume
        can cut away whatever was appended after it (and will be logged again)."""
        return {p.name: p.stat().st_size for p in (self.metrics, self.events) if p.exists()}

    def rollback(self, snapshot: dict[str, int], step: int) -> None:
        """Undo what was appended after a checkpoint at `step` was taken: keep each file's
        first `snapshot` bytes, and of the lines after them only those with a step below
        `step` (the training step that finished just before the checkpoint logs its
        values right after the save). A file absent from the snapshot is emptied."""
        for path in (self.metrics, self.events):
            size = snapshot.get(path.name, 0)
            if not path.exists() or path.stat().st_size <= size:
                continue
            with open(path, "rb") as f:
                head, tail = f.read(size), f.read()
            kept = [ln for ln in tail.decode().splitlines(keepends=True) if _before(ln, step)]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(head + "".join(kept).encode())
            os.replace(tmp, path)


def _before(line: str, step: int) -> bool:
    """A complete JSON line whose "step" is below `step`."""
    if not line.endswith("\n"):
        return False
    try:
        return int(json.loads(line)["step"]) < step
    except (ValueError, KeyError, TypeError):
        return False


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

    def checkpoint_state(self) -> dict[str, int]:
        """Saved inside each checkpoint (see ScheduledCheckpoints)."""
        return self.store.snapshot()

    def restore_checkpoint_state(self, state: dict[str, int], step: int) -> None:
        """On resume from a checkpoint at `step`: drop the lines logged after it that the
        resumed run will log again."""
        self.store.rollback(state, step)

    @rank_zero_only
    def log_event(self, event: dict[str, Any]) -> None:
        """Append a phase-transition event to events.jsonl."""
        self.store.append_jsonl(self.store.events, event)

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

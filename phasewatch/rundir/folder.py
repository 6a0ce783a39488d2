"""The run folder's layout: the one place where its file names are spelled.

```
runs/<name>/
  config.yaml  metrics.jsonl  events.jsonl  stages.jsonl  interventions.jsonl  analyses.jsonl
  checkpoints/step=<N>.ckpt (N zero-padded to 7 digits; weights only by default), last.ckpt
  arrays/<probe>/<key>/step=<N>.npy, arrays/trajectory/<kind>/pca.npy
  figures/<name>.png   report.html   heads.csv   diff/
  wandb/, wandb_id, wandb_group; analyze/wandb/, diff/wandb/ (never the training run's wandb/)
  .lock                the pid of the process writing the folder
```

What each file holds: the README's "The run folder". A sweep folder (`SweepFolder`) holds run
folders, `sweep.json` (the sweep's state) and `logs/<run>.log`.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any, Iterator

from phasewatch.errors import ConfigError, DiskFull, is_disk_full
from phasewatch.rundir.jsonl import append_jsonl, read_jsonl, rewrite_jsonl, write_atomic
from phasewatch.rundir.series import Series, read_csv_series, read_series

#: the default parent of run folders
RUNS = Path("runs")
LAST_CHECKPOINT = "last.ckpt"
TRAJECTORY_CHECKPOINTS = 3  # the fewest checkpoints a trajectory (PCA path over checkpoints) is drawn from
_CHECKPOINT = re.compile(r"step=(\d+)\.ckpt")
_ARRAY = re.compile(r"step=(\d+)\.npy")


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint after `step` optimizer steps."""
    return f"step={step:07d}.ckpt"


def member_name(index: int) -> str:
    """The run folder of a population's member `index` inside the population's folder: m00, m01, ..."""
    return f"m{index:02d}"


def step_checkpoints(directory: str | os.PathLike) -> dict[int, Path]:
    """step -> file of the step checkpoints in `directory`, in step order."""
    found = {}
    for path in Path(directory).glob("step=*.ckpt"):
        match = _CHECKPOINT.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def read_checkpoint(path: str | os.PathLike, field: str = "ckpt_path", resume: bool = False) -> dict[str, Any]:
    """A checkpoint's contents, loaded without running any code: `torch.load(weights_only=True)`
    takes tensors and plain Python data only, which is all a phasewatch checkpoint holds, and
    refuses a pickle that names anything else (a crafted file's `os.system`, say) before
    calling it. ConfigError naming the file, what is wrong and the newest other step
    checkpoint beside it, when the file is missing, truncated, corrupt, holds other objects,
    or is not a Lightning checkpoint; with `resume`, also when it holds the weights only (a
    post-hoc checkpoint: no optimizer state to resume training from)."""
    import pickle

    import torch

    path = Path(path)
    others = [p for p in reversed(step_checkpoints(path.parent).values()) if p != path]
    fix = (f"Use an earlier one, e.g. {others[0]}" if others
           else "No other checkpoint is beside it; train the run again.")
    if not path.is_file():
        raise ConfigError(field, f"{path} does not exist", fix)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise ConfigError(field, f"{path} is truncated or corrupt ({type(err).__name__}: {err})", fix) from err
        named = next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
        raise ConfigError(field, f"{path} holds objects other than tensors and plain data ({named}); phasewatch "
                                 "loads checkpoints without running code, and this file would run some",
                          "Use a checkpoint written by phasewatch; do not load files from an untrusted source") from None
    except Exception as err:  # noqa: BLE001 - any other failure to read it means the same to the user
        raise ConfigError(field, f"{path} is truncated or corrupt ({type(err).__name__}: {err})", fix) from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "global_step" not in ckpt:
        raise ConfigError(field, f"{path} is not a phasewatch checkpoint (no state_dict and global_step)", fix)
    if resume and "optimizer_states" not in ckpt:
        full = [p for p in others if is_resume_point(p)]
        raise ConfigError(field, f"{path} holds the weights only (a checkpoint for post-hoc probes), so training "
                                 "cannot resume from it",
                          f"Resume from {path.parent / LAST_CHECKPOINT} (--ckpt_path last)"
                          + (f" or {full[0]}" if full else "") + "; checkpoints.schedule's steps are resume points.")
    return ckpt


def is_resume_point(path: str | os.PathLike) -> bool:
    """Whether a checkpoint file holds the full training state (optimizer included), read
    without loading its tensors' data: a weights-only one cannot resume training."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mapped, not read
    except Exception:  # noqa: BLE001 - unreadable: not a resume point
        return False
    return isinstance(ckpt, dict) and "optimizer_states" in ckpt


def format_size(n_bytes: int) -> str:
    """A size as people read it: `512 B`, `3.4 MB`, `1.2 GB` (powers of 1000, as `du --si`)."""
    size, unit = float(n_bytes), "B"
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            break
        size /= 1000
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"


def _array_name(step: int) -> str:
    return f"step={step:07d}.npy"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (the owner of a run or sweep folder's lock)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_run_dir(task_name: str) -> Path:
    """runs/<task>-<date>-<time> (with -2, -3, ... when taken), or runs/sweep-<sweep id>/<run id>
    under `wandb agent`."""
    if os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"):
        return RUNS / f"sweep-{os.environ['WANDB_SWEEP_ID']}" / os.environ["WANDB_RUN_ID"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RUNS / f"{task_name}-{stamp}"
    k = 1
    while path.exists():
        k += 1
        path = RUNS / f"{task_name}-{stamp}-{k}"
    return path


def flatten_config(tree: Any, fold_init_args: bool, whole: Collection[str] = (), prefix: str = "") -> dict[str, Any]:
    """A config tree (config.yaml, or a config file a sweep's command names) as {dotted key:
    value}, the keys spelled as `phasewatch fit` flags: `{"model": {"arch": {"seed": 3}}}` gives
    `{"model.arch.seed": 3}`. Dicts are walked (an empty one gives no key); anything else,
    lists included, is one value, and so is the subtree at a key named in `whole`. With
    `fold_init_args`, jsonargparse's `init_args` level is left out of the keys
    (`data.task.init_args.p` is `data.task.p`)."""
    if (prefix and prefix in whole) or not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        child = prefix if fold_init_args and key == "init_args" else f"{prefix}.{key}" if prefix else str(key)
        out |= flatten_config(value, fold_init_args, whole, child)
    return out


class RunFolder:
    """Paths, writers and readers of one run folder."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    config = property(lambda self: self.root / "config.yaml")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    events = property(lambda self: self.root / "events.jsonl")
    stages = property(lambda self: self.root / "stages.jsonl")  # the run's stages (phases/stages.py)
    interventions = property(lambda self: self.root / "interventions.jsonl")
    analyses = property(lambda self: self.root / "analyses.jsonl")
    checkpoints = property(lambda self: self.root / "checkpoints")
    last_checkpoint = property(lambda self: self.root / "checkpoints" / LAST_CHECKPOINT)
    arrays = property(lambda self: self.root / "arrays")
    figures = property(lambda self: self.root / "figures")
    report = property(lambda self: self.root / "report.html")
    diffs = property(lambda self: self.root / "diff")  # `phasewatch diff`'s tables
    head_catalogue = property(lambda self: self.root / "heads.csv")  # one row per head per step (report/heads.py)
    wandb_dir = property(lambda self: self.root / "wandb")

    def side_wandb_dir(self, job_type: str) -> Path:
        """The W&B files of a run made later from this one (`analyze`, `diff`: `job_type`), under
        `<job_type>/wandb/`: apart from the training run's `wandb/`, so that its `latest-run` and
        `offline-run-*` stay the training run's and `wandb sync` of them uploads that run."""
        return self.root / job_type / "wandb"
    lock = property(lambda self: self.root / ".lock")
    _wandb_id = property(lambda self: self.root / "wandb_id")
    _wandb_group = property(lambda self: self.root / "wandb_group")

    # --- the folder ----------------------------------------------------------------

    def has_run(self) -> bool:
        """Whether something already lives here (a config or metrics of an earlier run)."""
        self.check_name()
        return self.config.exists() or self.metrics.exists()

    def check_name(self) -> None:
        """ConfigError when a part of the folder's path is longer than file names may be."""
        longest = max((part for part in self.root.parts), key=len, default="")
        limit = 255
        try:
            limit = os.pathconf(next((p for p in [self.root, *self.root.parents] if p.exists()), Path(".")),
                                "PC_NAME_MAX")
        except (OSError, ValueError):
            pass
        if len(longest) > limit:
            raise ConfigError("run_dir", f"the folder name {longest[:40]}... is {len(longest)} characters long, "
                                         f"more than the {limit} this file system allows",
                              "Choose a shorter --run_dir (or run name).")

    def require_metrics(self) -> None:
        """FileNotFoundError naming the folder when it has no metrics (not a run folder)."""
        if not self.metrics.exists():
            raise FileNotFoundError(f"{self.metrics} not found: is {self.root} a phasewatch run folder?")

    def require_config(self) -> None:
        """ConfigError when the folder has no config (nothing to rebuild the run from)."""
        if not self.config.exists():
            raise ConfigError("run_dir", f"{self.config} does not exist", "Give a run folder written by phasewatch fit.")

    def create(self, min_free_bytes: int = 64 * 2**20) -> None:
        """Make the folders, or raise ConfigError at once when the place is not writable or
        the disk is (nearly) full: better now than after an hour of training."""
        self.check_name()
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

    # --- records -------------------------------------------------------------------

    append = staticmethod(append_jsonl)
    rewrite = staticmethod(rewrite_jsonl)
    write_atomic = staticmethod(write_atomic)

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))

    def read_events(self) -> list[dict[str, Any]]:
        """Every event: the live watcher's onsets, confirmed transitions and withdrawn onsets
        (`stage`), and the transitions of `phasewatch analyze` (no stage)."""
        return list(read_jsonl(self.events))

    def transitions(self) -> list[dict[str, Any]]:
        """The transitions among the events: confirmed ones (an event without a stage is one)."""
        return [e for e in self.read_events() if e.get("stage", "confirmed") == "confirmed"]

    def read_interventions(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.interventions))

    def series(self) -> Series:
        """Every numeric key of the metrics as (steps, values)."""
        return read_series(self.metrics)

    def write_interventions(self, records: list[dict[str, Any]]) -> None:
        rewrite_jsonl(self.interventions, records)

    def add_analysis(self, record: dict[str, Any]) -> None:
        append_jsonl(self.analyses, record)

    def read_config(self) -> dict[str, Any]:
        """config.yaml as a plain dict ({} when empty)."""
        import yaml

        self.require_config()
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: ~10x faster, the same values
        return yaml.load(self.config.read_text(), Loader=loader) or {}

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
            write_atomic(path, head + "".join(kept).encode())

    # --- checkpoints ---------------------------------------------------------------

    def diff_tables(self, name: str) -> tuple[Path, Path]:
        """`phasewatch diff`'s two tables for a diff called `name`: one row per component
        (`diff/<name>.csv`) and the inputs whose loss changed most (`diff/<name>_inputs.csv`)."""
        return self.diffs / f"{name}.csv", self.diffs / f"{name}_inputs.csv"

    def diff_names(self) -> list[str]:
        """The names of the run's diffs (`diff_tables`), oldest first."""
        if not self.diffs.is_dir():
            return []
        tables = [p for p in self.diffs.glob("*.csv") if not p.name.endswith("_inputs.csv")]
        return [p.stem for p in sorted(tables, key=lambda p: p.stat().st_mtime)]

    def size_bytes(self) -> int:
        """The bytes of every file in the folder (checkpoints, arrays, W&B files, ...), for the
        end-of-run summary; 0 when it does not exist. `format_size` writes it for people."""
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root.is_dir() else 0

    def checkpoint_steps(self) -> dict[int, Path]:
        """step -> checkpoint file, for the run's step checkpoints, in step order."""
        return step_checkpoints(self.checkpoints)

    # --- arrays --------------------------------------------------------------------

    def array_folder(self, probe: str, key: str) -> Path:
        return self.arrays / probe / key

    def save_array(self, probe: str, key: str, step: int, array) -> Path:
        """Save a probe's array value at `step` (numpy's .npy: the bytes `np.save` writes,
        through `np.lib.format.write_array` on a file opened here; the folder made only when
        the file cannot be opened without it, not at every save: a probe step writes many)."""
        import numpy as np

        folder = self.array_folder(probe, key)
        path = folder / _array_name(step)
        array = np.asanyarray(array)
        try:
            try:
                f = open(path, "wb")
            except FileNotFoundError:  # the key's first array (or its folder was dropped)
                folder.mkdir(parents=True, exist_ok=True)
                f = open(path, "wb")
            with f:
                np.lib.format.write_array(f, array, allow_pickle=True)
        except OSError as err:
            path.unlink(missing_ok=True)
            if is_disk_full(err):
                raise DiskFull.in_run(self.root, f"{probe}/{key} at step {step}", array.nbytes) from None
            raise
        return path

    def array_files(self, probe: str, key: str) -> list[tuple[int, Path]]:
        """(step, file) of a probe's array key, in step order."""
        found = []
        for path in self.array_folder(probe, key).glob("step=*.npy"):
            match = _ARRAY.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def array_keys(self) -> Iterator[tuple[str, str]]:
        """(probe, key) of every array folder, sorted."""
        if self.arrays.is_dir():
            for folder in sorted(p for p in self.arrays.glob("*/*") if p.is_dir()):
                yield folder.parent.name, folder.name

    def trajectory_pca(self, kind: str) -> Path:
        """The checkpoint trajectory's coordinates of `kind` (rows: step, PC1, PC2)."""
        return self.arrays / "trajectory" / kind / "pca.npy"

    def drop_arrays(self, probe: str, key: str) -> None:
        shutil.rmtree(self.array_folder(probe, key), ignore_errors=True)

    # --- figures and W&B -----------------------------------------------------------

    def figure(self, name: str) -> Path:
        """figures/<name>.png"""
        return self.figures / f"{name}.png"

    def wandb_id(self) -> str | None:
        """The id of the run's W&B run, once it has one."""
        return self._wandb_id.read_text().strip() if self._wandb_id.exists() else None

    def set_wandb_id(self, run_id: str) -> None:
        self._wandb_id.write_text(run_id + "\n")

    def wandb_group(self) -> str | None:
        """The W&B group the run was trained in (e.g. its sweep's), if any."""
        return (self._wandb_group.read_text().strip() or None) if self._wandb_group.exists() else None

    def set_wandb_group(self, group: str) -> None:
        self._wandb_group.write_text(group + "\n")


def _before(line: str, step: int) -> bool:
    """A complete JSON line whose "step" is below `step`."""
    if not line.endswith("\n"):
        return False
    try:
        return int(json.loads(line)["step"]) < step
    except (ValueError, KeyError, TypeError):
        return False


def load_series(path: str | os.PathLike) -> Series:
    """The series of a run folder, a metrics JSON-lines file or a CSV file; FileNotFoundError
    naming what to give when there is nothing to read."""
    path = Path(path)
    if path.is_dir():
        path = RunFolder(path).metrics
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: give a run folder, a metrics file (.jsonl) or a CSV file")
    return read_csv_series(path) if path.suffix == ".csv" else read_series(path)



class SweepFolder:
    """A sweep's folder: its state, the logs of its runs, and their run folders."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    state = property(lambda self: self.root / "sweep.json")
    logs = property(lambda self: self.root / "logs")
    comparison = property(lambda self: self.root / "compare")  # `phasewatch compare`'s table and plot (.csv, .png)

    def log(self, run_name: str) -> Path:
        return self.logs / f"{run_name}.log"

    def run(self, run: str | dict[str, Any]) -> RunFolder:
        """A run's folder, by name or by its record in the state file (a run packed into a
        population lives in the population's member folder, `<pack>/m03`: its `folder`)."""
        if isinstance(run, dict):
            return RunFolder(self.root / (run.get("folder") or run["name"]))
        return RunFolder(self.root / run)

    def is_sweep(self) -> bool:
        return self.state.exists()

    def read_state(self) -> dict[str, Any]:
        return json.loads(self.state.read_text())

    def write_state(self, state: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.state, json.dumps(state, indent=1, default=str) + "\n")


def run_folders(path: str | os.PathLike) -> list[RunFolder]:
    """The run folders directly inside `path` (those with metrics), sorted by name."""
    path = Path(path)
    if not path.is_dir():
        return []
    return [RunFolder(p) for p in sorted(path.iterdir()) if p.is_dir() and RunFolder(p).metrics.exists()]

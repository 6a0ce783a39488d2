"""The one error type of bad input: a field, what is wrong with it, and how to fix it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. Raised before any training starts.

    The message names the field, says what is wrong and how to fix it; the CLI prints it
    as one line and exits with status 2.
    """

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem}. {fix}")


def require(condition: bool, field: str, problem: str, fix: str) -> None:
    """Raise ConfigError(field, problem, fix) unless `condition` holds."""
    if not condition:
        raise ConfigError(field, problem, fix)


def require_int(value: Any, field: str, low: int, fix: str | None = None) -> None:
    """Check that `value` is an int (not a bool) and at least `low`."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    require(ok, field, f"must be an integer >= {low}, got {value!r}", fix or f"Set {field} to an integer >= {low}.")


class DiskFull(ConfigError):
    """The disk filled while phasewatch wrote into `folder`: one line naming the folder, about
    how much more space the write needed, and how to go on. What was written before stays
    readable (every file is appended line by line or written under a temporary name)."""

    def __init__(self, folder: Any, what: str, need_bytes: int | None, fix: str):
        need = f"about {max(need_bytes, 2**20) / 2**20:,.0f} MiB more" if need_bytes else "more space"
        super().__init__("run_dir", f"the disk of {folder} is full: writing {what} needs {need}", fix)

    @classmethod
    def in_run(cls, run_dir: Any, what: str, need_bytes: int | None) -> "DiskFull":
        """During training: the fix is to free space and resume the run from its last checkpoint."""
        return cls(run_dir, what, need_bytes,
                   f"Free some space, then resume: phasewatch fit --run_dir {run_dir} --ckpt_path last")


def is_disk_full(err: BaseException) -> bool:
    import errno

    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)

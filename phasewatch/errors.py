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

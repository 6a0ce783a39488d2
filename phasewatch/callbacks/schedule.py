"""When to checkpoint and when to probe: one schedule object drives both.

Phase transitions in small models happen anywhere from tens to tens of thousands of
steps, so the default is log-spaced (dense early, sparse late). Step 0 (the initial
weights) is always included: probes need a random-initialisation baseline.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from phasewatch.tasks.base import require, require_int
from phasewatch.errors import ConfigError


@dataclasses.dataclass
class Schedule:
    """A set of training steps.

    Attributes:
        kind: "log" (`count` points log-spaced from 1 to max_steps), "linear" (every
            `every` steps) or "list" (exactly `steps`).
        count: number of log-spaced points (kind "log").
        every: spacing in steps (kind "linear").
        steps: explicit steps (kind "list").
    """

    kind: Literal["log", "linear", "list"] = "log"
    count: int = 30
    every: int | None = None
    steps: list[int] | None = None

    def validate(self, field: str = "checkpoints.schedule") -> "Schedule":
        """Raise ConfigError naming the bad field (under `field`, the schedule's own name in
        the config); returns self."""
        require(self.kind in ("log", "linear", "list"), f"{field}.kind", f"unknown kind {self.kind!r}",
                "Use log, linear or list.")
        if self.kind == "log":
            require_int(self.count, f"{field}.count", 1)
        if self.kind == "linear":
            require_int(self.every, f"{field}.every", 1, "Give the spacing in steps, e.g. every: 100.")
        if self.kind == "list":
            require(bool(self.steps), f"{field}.steps", "kind 'list' needs a non-empty list of steps",
                    "Give steps: [0, 100, 1000].")
            for s in self.steps:
                require_int(s, f"{field}.steps", 0)
        return self

    def resolve(self, max_steps: int | None) -> list[int]:
        """The sorted steps in [0, max_steps] (max_steps included for log and linear)."""
        self.validate()
        if self.kind == "list":
            return sorted({s for s in self.steps if max_steps is None or s <= max_steps} | {0})
        if max_steps is None or max_steps < 0:
            raise ConfigError("trainer.max_steps", f"a {self.kind} schedule needs a finite number of steps",
                              "Set trainer.max_steps, or use schedule kind 'list'.")
        if self.kind == "linear":
            return sorted(set(range(0, max_steps + 1, self.every)) | {max_steps})
        points = np.geomspace(1, max(max_steps, 1), self.count)
        return sorted({0, max_steps} | {int(round(x)) for x in points})

"""The probe registry: named measurements, each a pure function (model, task) -> values.

A probe is called as `fn(model, task, **options)` (options from the probe runner's
config, e.g. thresholds) and returns a dict: float values are scalars (logged as metrics under the keys its
docstring lists); anything else (lists, tensors) is an array, saved to the run folder
under `arrays/<probe>/<key>/step=<N>.npy`. Names are unique; `applies_to` says which
tasks a probe can measure; `cheap` probes may run at every validation; a costly probe
may name a `schedule` of its own (e.g. {"kind": "log", "count": 24}), used when the run
does not give it one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from phasewatch.tasks.base import ConfigError, Task


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    fn: Callable[[Any, Task], dict[str, Any]]
    applies_to: Callable[[Task], bool]
    cheap: bool = False
    default: bool | Callable[[Task], bool] = True  # run by default on (these of) the tasks it applies to
    schedule: dict | None = None  # its own default schedule (callbacks.schedule.Schedule fields)

    def __call__(self, model, task: Task, **options: Any) -> dict[str, Any]:
        try:
            return self.fn(model, task, **options)
        except TypeError as err:
            if options and "unexpected keyword" in str(err):
                raise ConfigError("probes.options", f"probe {self.name!r} does not take {sorted(options)}",
                                  f"See the docstring of probe {self.name!r} for its options.") from err
            raise


_PROBES: dict[str, Probe] = {}


def register_probe(name: str, applies_to: Callable[[Task], bool], cheap: bool = False,
                   default: bool | Callable[[Task], bool] = True, schedule: dict | None = None):
    """Function decorator: register `fn(model, task) -> dict` as probe `name`."""

    def decorate(fn):
        if name in _PROBES:
            raise ValueError(f"probe name {name!r} is already registered")
        _PROBES[name] = Probe(name, fn, applies_to, cheap, default, schedule)
        return fn

    return decorate


def probe_names() -> list[str]:
    return sorted(_PROBES)


def get_probe(name: str, task: Task | None = None) -> Probe:
    if name not in _PROBES:
        raise ConfigError("probes.names", f"unknown probe {name!r}", f"Choose from: {', '.join(probe_names())}.")
    probe = _PROBES[name]
    if task is not None and not probe.applies_to(task):
        raise ConfigError("probes.names", f"probe {name!r} does not apply to the task {task.name!r}",
                          "Remove it, or pick a probe for this task (phasewatch tasks lists them).")
    return probe


def check_options(options: dict, field: str, running: list[str] | None = None) -> dict[str, dict]:
    """`options` checked: a mapping from probe names (those in `running` when given) to
    keyword mappings, so that a misspelt name cannot be ignored silently."""
    if not isinstance(options, dict):
        raise ConfigError(field, f"expected a mapping from probe names to options, got {options!r}",
                          'Write e.g. {"llc": {"step_size": 3e-5}}.')
    allowed = probe_names() if running is None else running
    for name, kwargs in options.items():
        if name not in allowed:
            what = "a registered probe" if running is None else "a probe being run"
            raise ConfigError(field, f"options for {name!r}, which is not {what}",
                              f"Key the options by a probe name ({', '.join(allowed)})"
                              f"{'' if running is None else ', or add the probe to --probes'}.")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{field}.{name}", f"expected a mapping of option names to values, got {kwargs!r}",
                              f'Write e.g. {{"{name}": {{"option": value}}}}.')
    return options


def default_probes(task: Task) -> list[str]:
    return [n for n, p in sorted(_PROBES.items())
            if p.applies_to(task) and (p.default(task) if callable(p.default) else p.default)]

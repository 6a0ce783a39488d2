"""The probe registry: named measurements, each a pure function (model, task) -> values.

A probe is called as `fn(model, task, **options)` and returns a dict: float values are scalars
(logged as metrics), anything else (lists, tensors) an array, saved under
`arrays/<probe>/<key>/step=<N>.npy`. `register_probe(name, applies_to, cheap, default, schedule,
initial, final_options, keys)` registers one: `applies_to` says which tasks it can measure;
`default` whether it runs when no probes are named (a bool or a test of the task); `cheap`
probes may run at every validation; `schedule` is its own, used when the run gives it none (e.g.
{"kind": "log", "count": 24}); an `initial` probe also receives the run's step-0 weights as the
keyword `initial`; `final_options(model, task, options)` completes a finished run's options from
its last checkpoint (`analyze`); `keys` declares what its metric keys mean (probes/keys.py).
A `held_out` probe may receive its model's logits on the task's held-out batches, computed
already, as the keyword `held_out_logits`. `get_probe`, `probe_names`, `default_probes` and
`check_options` read the registry. Probes of
other packages plug in by entry point (group `phasewatch.probes`) or dotted name (plugins.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from phasewatch.plugins import import_module, load_entry_points
from phasewatch.probes.keys import KeyFamilies, declare_keys
from phasewatch.tasks.base import Task
from phasewatch.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    fn: Callable[[Any, Task], dict[str, Any]]
    applies_to: Callable[[Task], bool]
    cheap: bool = False
    default: bool | Callable[[Task], bool] = True  # run by default on (these of) the tasks it applies to
    schedule: dict | None = None  # its own default schedule (callbacks.schedule.Schedule fields)
    initial: bool = False  # takes the run's step-0 model as the keyword `initial`
    final_options: Callable[[Any, Task, dict], dict] | None = None  # its options for a finished run
    #: may take `held_out_logits`: the model's logits on each of `task.val_batches()` (its native
    #: module's output in eval mode, as validation computes them), given when computed already
    held_out: bool = False

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
                   default: bool | Callable[[Task], bool] = True, schedule: dict | None = None,
                   keys: KeyFamilies | None = None, initial: bool = False,
                   final_options: Callable[[Any, Task, dict], dict] | None = None, held_out: bool = False):
    """Function decorator: register `fn(model, task) -> dict` as probe `name`, its keys
    meaning what `keys` declares."""

    def decorate(fn):
        if name in _PROBES:
            raise ValueError(f"probe name {name!r} is already registered")
        if ":" in name:
            raise ValueError(f"probe name {name!r}: ':' separates a module from a name in dotted probe names")
        declare_keys(name, keys or KeyFamilies())
        _PROBES[name] = Probe(name, fn, applies_to, cheap, default, schedule, initial, final_options, held_out)
        return fn

    return decorate


def probe_names() -> list[str]:
    """Every registered probe, those of installed plug-ins included."""
    load_entry_points("phasewatch.probes")
    return sorted(_PROBES)


def _plug_in(name: str) -> Probe:
    """The probe of a dotted name `package.module:name`: one the module registers under that
    name, or a plain function of the module, registered now as a probe of every task."""
    module_name, _, attr = name.partition(":")
    module = import_module(module_name, "probes.names")
    fn = getattr(module, attr, None)
    found = [p for p in _PROBES.values() if p.fn is fn]
    if found:
        return found[0]  # a function the module registered (under whatever name)
    registered = _PROBES.get(attr)
    if registered is not None and registered.fn.__module__ == module.__name__:
        return registered  # a probe the module registered under this name
    if not callable(fn):
        raise ConfigError("probes.names", f"{module_name} has no probe or function {attr!r}",
                          f"Name a function fn(model, task) -> dict of {module_name}, or a probe it registers.")
    if registered is not None:
        raise ConfigError("probes.names", f"{name}: the name {attr!r} is taken by the probe of "
                                          f"{registered.fn.__module__}", "Give your function another name.")
    try:
        register_probe(attr, applies_to=lambda task: True, default=False)(fn)
    except ValueError as err:  # a name the keys of another owner have (e.g. "training")
        raise ConfigError("probes.names", f"{name}: {err}", "Give your function another name.") from None
    return _PROBES[attr]


def get_probe(name: str, task: Task | None = None) -> Probe:
    """The probe `name` (a registered name, or a dotted `package.module:name`), checked to
    apply to `task` when one is given; ConfigError naming the fix otherwise."""
    if ":" in name:
        probe = _plug_in(name)
    elif name in _PROBES or name in probe_names():
        probe = _PROBES[name]
    else:
        raise ConfigError("probes.names", f"unknown probe {name!r}",
                          f"Choose from: {', '.join(probe_names())}, or name your own as package.module:function.")
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
    allowed = probe_names() if running is None else [get_probe(n).name for n in running]
    for name, kwargs in options.items():
        if name not in allowed:
            what = "a registered probe" if running is None else "a probe being run"
            raise ConfigError(field, f"options for {name!r}, which is not {what}",
                              f"Key the options by a probe name ({', '.join(allowed)})"
                              f"{'' if running is None else ', or run the probe too (analyze --probes, fit --probes.names)'}.")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{field}.{name}", f"expected a mapping of option names to values, got {kwargs!r}",
                              f'Write e.g. {{"{name}": {{"option": value}}}}.')
    return options


def default_probes(task: Task) -> list[str]:
    """The probes run on `task` when the run names none."""
    return [n for n, p in sorted((n, _PROBES[n]) for n in probe_names())
            if p.applies_to(task) and (p.default(task) if callable(p.default) else p.default)]

"""Plug-ins: a researcher's own probes and tasks, from their own package, without editing phasewatch.

Two ways in, for probes and tasks alike:

- an entry point of an installed distribution, in the group `phasewatch.probes` or
  `phasewatch.tasks` (in pyproject.toml: `[project.entry-points."phasewatch.probes"]`,
  `mylab = "mylab.probes"`). Its module is imported the first time phasewatch lists or looks
  up probes (tasks), and importing it registers them with the usual decorators
  (`phasewatch.probes.register_probe`, `phasewatch.tasks.register_task`);
- a dotted name on the command line: `--probes.names '[mylab.probes:attention_entropy]'`
  (the module is imported; the name is a probe it registers, or a plain function
  `fn(model, task) -> dict`, registered then as a probe of every task, not run by default),
  `--data.task mylab.tasks.MyTask` (a Task subclass, by its class path).

A plug-in that fails to import is left out with one warning naming it; a dotted name that
cannot be imported is refused with one line naming the module.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

from phasewatch.errors import ConfigError

_LOADED: set[tuple[str, str]] = set()


def load_entry_points(group: str) -> None:
    """Import every not yet imported entry point of `group` (its import registers its plug-ins)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=group):
        if (group, ep.value) in _LOADED:
            continue
        _LOADED.add((group, ep.value))
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001 - a broken plug-in must not stop phasewatch
            warnings.warn(f"phasewatch: plug-in {ep.name!r} ({ep.value}, group {group}) failed to load ({err!r}); "
                          "it is left out", stacklevel=2)


def import_module(name: str, what: str) -> ModuleType:
    """Import the module of a dotted plug-in name; ConfigError naming it when that fails."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError(what, f"cannot import {name!r} ({err})",
                          "Install the package that holds it, or put its folder on PYTHONPATH.") from err

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

A run folder is data, possibly someone else's: the commands that rebuild a run from its
config.yaml (`analyze`, `trajectory`) import only classes of phasewatch, of installed
plug-ins (the modules of the entry points above) and of modules the user names on the
command line (`--allow MODULE`, or a probe's dotted name); `check_trusted` refuses any
other class path in the config before anything is imported.
"""

from __future__ import annotations

import importlib
import re
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
    except Exception as err:  # noqa: BLE001 - not found, or its code fails: the same one line
        raise ConfigError(what, f"cannot import {name!r} ({type(err).__name__}: {err})",
                          "Install the package that holds it, or put its folder on PYTHONPATH.") from err


def installed_modules() -> set[str]:
    """The modules of the installed plug-ins (entry points of phasewatch's groups)."""
    from importlib.metadata import entry_points

    return {ep.module for group in ("phasewatch.probes", "phasewatch.tasks") for ep in entry_points(group=group)}


def _within(module: str, roots: set[str]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def is_trusted(module: str, allowed: tuple[str, ...] = ()) -> bool:
    """Whether `module` is phasewatch's, an installed plug-in's, or one of `allowed`."""
    return _within(module, {"phasewatch", *installed_modules(), *allowed})


#: a string a parser could take for code to import: `package.module.Name` or `package.module:name`
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:\w+)?|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:\w+")


def _importable(module: str) -> bool:
    """Whether the top-level package of `module` could be imported (found without importing
    it): a dotted string that names nothing importable, such as a component `L0.attn`, is data."""
    from importlib.util import find_spec

    try:
        return find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def check_trusted(config: object, source: str, allowed: tuple[str, ...] = (), fix: str | None = None) -> None:
    """ConfigError unless every value of `config` (a parsed YAML tree) that jsonargparse could
    turn into an import names phasewatch, an installed plug-in or a module of `allowed`: a
    `class_path`, a string naming a class or function (`pkg.mod.Name`, `pkg.mod:name`); and
    no string holds configuration of its own (inline YAML, or the path of another config
    file), which could name anything."""

    def refuse(where: str, problem: str, module: str | None) -> None:
        hint = f"If you trust it, pass --allow {module.split('.')[0]}" if module else "Write the values out as a mapping"
        raise ConfigError(where or "config", f"{source} {problem}", fix or hint)

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}.{key}" if where else str(key))
        elif isinstance(node, list):
            for item in node:
                walk(item, where)
        elif isinstance(node, str):
            text = node.strip()
            if _DOTTED.fullmatch(text):
                module = text.partition(":")[0] if ":" in text else (text.rpartition(".")[0] or text)
                if _importable(module) and not is_trusted(module, allowed):
                    refuse(where, f"names {text!r}, which is neither phasewatch's nor an installed plug-in's; "
                                  "importing it would run its code", module)
            elif text.startswith(("{", "[")) or text.lower().endswith((".yaml", ".yml", ".json")):
                refuse(where, f"holds configuration in a string ({text[:40]!r}), which is not read from a run "
                              "folder", None)

    walk(config, "")

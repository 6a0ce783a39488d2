"""Plug-ins: a researcher's own probes and tasks, from their own package, and which code a
configuration may import.

Two ways in: an entry point in the group `phasewatch.probes` or `phasewatch.tasks` (its module
registers its plug-ins when imported), or a dotted name on the command line
(`--probes.names '[mylab.probes:fn]'`, `--data.task mylab.tasks.MyTask`). A plug-in that fails
to import is left out with one warning; a dotted name that cannot be imported is one line.

A run folder's config.yaml may be someone else's: `check_trusted` refuses, before anything is
imported, any name in it outside phasewatch, the installed plug-ins and the modules the user
names, and `only_trusted_imports` has jsonargparse refuse the same while it parses (README,
"Security: what phasewatch loads").
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import yaml

from phasewatch.errors import ConfigError

_LOADED: set[tuple[str, str]] = set()


#: per group: (the state of sys.path it was scanned in, its entry points)
_SCANNED: dict[str, tuple[tuple, tuple]] = {}


def _path_state() -> tuple:
    """sys.path with each folder's modification time: installing or removing a distribution
    changes the folder it goes in, so an unchanged state has the same entry points."""
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def entry_points_of(group: str) -> tuple:
    """The entry points of `group`, read from the installed distributions again only when
    sys.path or one of its folders changed since the last read (a read takes ~50 ms)."""
    from importlib.metadata import entry_points

    state = _path_state()
    scanned = _SCANNED.get(group)
    if scanned is None or scanned[0] != state:
        scanned = _SCANNED[group] = (state, tuple(entry_points(group=group)))
    return scanned[1]


def load_entry_points(group: str) -> None:
    """Import every not yet imported entry point of `group` (its import registers its plug-ins)."""
    for ep in entry_points_of(group):
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
    return {ep.module for group in ("phasewatch.probes", "phasewatch.tasks") for ep in entry_points_of(group)}


def _within(module: str, roots: set[str]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def is_trusted(module: str, allowed: tuple[str, ...] = ()) -> bool:
    """Whether `module` is phasewatch's, an installed plug-in's, or one of `allowed`."""
    return _within(module, {"phasewatch", *installed_modules(), *allowed})


def _dotted_module(text: str) -> str | None:
    """The module a dotted name would import (`pkg.mod.Name` -> `pkg.mod`, `pkg.mod:name` ->
    `pkg.mod`), or None when `text` is not such a name (jsonargparse imports only names of
    identifiers joined by dots)."""
    module, colon, attr = text.partition(":")
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts) or (colon and not attr.isidentifier()):
        return None
    if colon:
        return module
    return ".".join(parts[:-1]) if len(parts) > 1 else None


def _importable(module: str) -> bool:
    """Whether the top-level package of `module` could be imported (found without importing
    it): a dotted string that names nothing importable, such as a component `L0.attn`, is data."""
    from importlib.util import find_spec

    try:
        return find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


#: the most of a file that a string naming it is read for (a config file is far smaller)
_MAX_REFERENCED = 1 << 20


def _referenced_file(text: str, bases: tuple[Path, ...]) -> Path | None:
    """The existing file that `text` names, as a path from the working directory or from one
    of `bases` (jsonargparse reads relative paths from the folder of the config naming them)."""
    if not text or "\n" in text or len(text) > 4096:
        return None
    path = Path(text).expanduser()
    for candidate in (path, *(base / path for base in bases)):  # an absolute path joins as itself
        try:
            if candidate.is_file():
                return candidate
        except OSError:
            continue
    return None


def check_trusted(config: object, source: str, allowed: tuple[str, ...] = (), fix: str | None = None,
                  bases: tuple[str | Path, ...] = ()) -> None:
    """ConfigError unless every module that jsonargparse could import while parsing `config` (a
    parsed YAML tree) is phasewatch's, an installed plug-in's or under one of `allowed`.

    The check follows what jsonargparse does with a value rather than the forms it is written
    in: every string is also read as the YAML it may hold (inline mappings, block scalars,
    quoted names) and, where it names an existing file (from the working directory or one of
    `bases`), as that file's contents; the trees found are checked in the same way. A name
    jsonargparse would import is identifiers joined by dots (`pkg.mod.Name`, `pkg.mod:name`),
    wherever it appears (`class_path`, a bare class name, a list item). A file too large to
    read, or nesting too deep to follow, is refused rather than passed unread."""
    _TrustCheck(source, tuple(allowed), fix, tuple(Path(b) for b in bases)).walk(config, "", 0)


@dataclasses.dataclass(frozen=True)
class _TrustCheck:
    """One `check_trusted` of a config from `source`: the modules `allowed`, the `fix` that
    replaces the refusal's own, the folders `bases` that relative file names are read from."""

    source: str
    allowed: tuple[str, ...]
    fix: str | None
    bases: tuple[Path, ...]

    def walk(self, node: object, where: str, depth: int) -> None:
        """Check a parsed tree at field `where` (dotted keys), `depth` levels down."""
        if depth > 16:
            self.refuse(where, "nests configuration too deeply to check for code it names", None)
        if isinstance(node, dict):
            for key, value in node.items():
                self.walk(value, f"{where}.{key}" if where else str(key), depth + 1)
        elif isinstance(node, list):
            for item in node:
                self.walk(item, where, depth + 1)
        elif isinstance(node, str):
            self._check_string(node, where, depth)

    def _check_string(self, node: str, where: str, depth: int) -> None:
        """A string: as a dotted name, as the YAML it may hold, as the file it may name."""
        text = node.strip()
        module = _dotted_module(text)
        if module is not None and _importable(module) and not is_trusted(module, self.allowed):
            self.refuse(where, f"names {text!r}, which is neither phasewatch's nor an installed plug-in's; "
                               "importing it would run its code", module)
        try:
            parsed = yaml.safe_load(node)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, (dict, list)) or (isinstance(parsed, str) and parsed.strip() != text):
            self.walk(parsed, where, depth + 1)
        path = _referenced_file(text, self.bases)
        contents = None if path is None else self._text_of(path, where)
        if contents is not None:
            try:
                self.walk(yaml.safe_load(contents), where, depth + 1)
            except yaml.YAMLError:
                pass  # not YAML: jsonargparse could not read it as configuration either

    def _text_of(self, path: Path, where: str) -> str | None:
        """The file's text; None for a binary file (a checkpoint, an array: not a config
        jsonargparse could read); refused when too large to read whole."""
        with open(path, "rb") as f:
            data = f.read(_MAX_REFERENCED + 1)
        if b"\0" in data[:8192]:
            return None
        if len(data) > _MAX_REFERENCED:
            self.refuse(where, f"names {str(path)!r}, a file too large to check for code it names", None)
        return data.decode("utf-8", errors="replace")

    def refuse(self, where: str, problem: str, module: str | None) -> None:
        hint = f"If you trust it, pass --allow {module.split('.')[0]}" if module else "Write the values out as a mapping"
        raise ConfigError(where or "config", f"{self.source} {problem}", self.fix or hint)


def named_modules(argv: list[str]) -> tuple[str, ...]:
    """The modules that values on a command line name (`--data.task mylab.tasks.MyTask`):
    trusted, since the user typed them."""
    names = (_dotted_module(value.strip()) for arg in argv for value in arg.split("=", 1)[-1:])
    return tuple(sorted({n for n in names if n is not None}))


@contextmanager
def only_trusted_imports(allowed: tuple[str, ...] = ()) -> Iterator[None]:
    """While the block runs, jsonargparse refuses (ImportDenied, before importing) every import
    path that a parsed value names, except phasewatch's, the installed plug-ins' and those under
    `allowed`: the parser's own guard behind `check_trusted`, for a configuration from a run
    folder. The previous import policy is restored on leaving."""
    from jsonargparse import _common  # the policy's state: set_parsing_settings can add, not restore
    from jsonargparse import set_parsing_settings

    saved = {key: _common.parsing_settings[key] for key in ("import_path_verdicts", "import_paths_enforced")}
    allow = sorted({"phasewatch", *installed_modules(), *allowed} - {"jsonargparse"})
    set_parsing_settings(import_path_denylist=["*"], import_path_allowlist=allow)
    try:
        yield
    finally:
        _common.parsing_settings.update(saved)

"""What metric keys mean, declared once: by each probe at registration, and here for the
training loop's own keys.

A `KeyFamilies` declaration says which of a probe's keys are per-head or per-frequency
detail (not watched by the live detector nor by `analyze`'s transition detection),
which of its array outputs are sets to follow over training (printed when they change),
how the report draws its keys (`Panel`s; panels with the same title are drawn as one),
which keys have no panel of their own family, which are headline keys (the columns of
`phasewatch compare` and the transitions marked on `phasewatch trajectory`), and the stages
the probe knows (`Signature`s: a stage that matches is named, docs/stages.md). The live
detector, the report, `compare`, `trajectory` and the stage detector (`stage_rules()`) read
these declarations; a new probe declares its keys in its own file and needs nothing else.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Union

from phasewatch.phases.stages import Signature, StageRules

#: a panel's keys: a prefix (str), exact keys (tuple), or a regular expression (full match)
KeySpec = Union[str, tuple, re.Pattern]


@dataclasses.dataclass(frozen=True)
class Panel:
    """One panel of the report and of `phasewatch plot`: a title, its keys and its y scale.
    `log_y` also declares the scale its keys are watched on for transitions (`declared_scale`):
    losses, which fall by orders of magnitude, on a log axis and in log10 of their values."""

    title: str
    keys: KeySpec
    log_y: bool = False

    def matches(self, key: str) -> bool:
        if isinstance(self.keys, str):
            return key.startswith(self.keys)
        if isinstance(self.keys, re.Pattern):
            return bool(self.keys.fullmatch(key))
        return key in self.keys


@dataclasses.dataclass(frozen=True)
class KeyFamilies:
    """The meaning of one probe's keys (module docstring).

    Attributes:
        detail: regular expression (searched) of detail keys, e.g. r"^heads/[^/]+/L\\d+H\\d+$".
        tracked: regular expression (full match) of array outputs that are sets of labels
            to follow over training, e.g. r"\\w+_heads".
        panels: how the report draws the keys.
        hidden: key prefixes (or exact keys) that get no panel of their own family when no
            panel takes them.
        headline: keys worth a column in `compare` and a mark on `trajectory`; one alone
            changing makes a stage.
        stages: the stages the probe knows, by what moves in them (phases/stages.py `Signature`).
        tracked_names: what a person calls each tracked set (full match of the output's name ->
            words), e.g. {"match_heads": "learned heads that match a compiled head"}.
        announced: regular expression (full match) of the tracked sets whose changes the
            console prints by default (the others with `--probes.verbose true`).
    """

    detail: str | None = None
    tracked: str | None = None
    panels: tuple[Panel, ...] = ()
    hidden: tuple[str, ...] = ()
    headline: tuple[str, ...] = ()
    stages: tuple[Signature, ...] = ()
    tracked_names: dict[str, str] = dataclasses.field(default_factory=dict)
    announced: str | None = None


#: keys the training loop logs (training/module.py): losses, accuracies, the learning rate
TRAINING = KeyFamilies(
    detail=r"^lr$",
    panels=(Panel("loss", ("train/loss", "val/loss", "val_longer/loss"), log_y=True),
            Panel("accuracy", ("train/acc", "val/acc", "val_longer/acc"))),
    hidden=("lr", "val/seq_acc", "val_longer/seq_acc"),
    headline=("val/acc", "val/loss", "train/acc", "train/loss"),
)

_FAMILIES: dict[str, KeyFamilies] = {"training": TRAINING}


def _hides(hidden: str, key: str) -> bool:
    """A `hidden` entry takes the exact key, or every key under it when it ends with '/'."""
    return key == hidden or (hidden.endswith("/") and key.startswith(hidden))


def declare_keys(owner: str, families: KeyFamilies) -> None:
    """Record what `owner`'s keys mean (register_probe calls it). ValueError, and nothing
    recorded, when the name is declared already, when the declaration would hide the training
    loop's own keys (a detail pattern or hidden prefix catching `val/loss`, say), or when one
    of its panels shares a title with another owner's and their keys cannot be joined."""
    if owner in _FAMILIES:
        raise ValueError(f"the keys of {owner!r} are already declared")
    names = {s.name for f in _FAMILIES.values() for s in f.stages}
    if any(s.name in names for s in families.stages):
        raise ValueError(f"a stage declared for {owner!r} has the name of one declared already")
    caught = [k for k in TRAINING.headline if (families.detail and re.search(families.detail, k))
              or any(_hides(h, k) for h in families.hidden)]
    if caught:
        raise ValueError(f"the keys declared for {owner!r} would hide the training loop's {caught}")
    _FAMILIES[owner] = families
    try:
        panels()
    except ValueError:
        del _FAMILIES[owner]
        raise


def is_detail(key: str) -> bool:
    """A per-head, per-frequency or diagnostic key: its transitions are not detected by default."""
    return any(f.detail and re.search(f.detail, key) for f in _FAMILIES.values())


def is_tracked(output: str) -> bool:
    """A probe output that is a set of labels followed over training (key frequencies, heads)."""
    return any(f.tracked and re.fullmatch(f.tracked, output) for f in _FAMILIES.values())


def tracked_name(output: str) -> str:
    """The words for a tracked set (`tracked_names`), else its name with spaces."""
    for family in _FAMILIES.values():
        for pattern, words in family.tracked_names.items():
            if re.fullmatch(pattern, output):
                return words
    return output.replace("_", " ")


def is_announced(output: str) -> bool:
    """Whether the console prints a change of this tracked set by default."""
    return any(f.announced and re.fullmatch(f.announced, output) for f in _FAMILIES.values())


def panels() -> list[Panel]:
    """Every declared panel, those with the same title merged into one (exact keys joined
    in order), in declaration order."""
    merged: dict[str, Panel] = {}
    for family in _FAMILIES.values():
        for panel in family.panels:
            before = merged.get(panel.title)
            if before is None:
                merged[panel.title] = panel
            elif isinstance(before.keys, tuple) and isinstance(panel.keys, tuple):
                merged[panel.title] = dataclasses.replace(before, keys=before.keys + panel.keys)
            else:
                raise ValueError(f"panel {panel.title!r} is declared twice with keys that cannot be joined")
    return list(merged.values())


def hidden(key: str) -> bool:
    """A key that gets no panel of its own family (when no declared panel takes it)."""
    return any(_hides(h, key) for f in _FAMILIES.values() for h in f.hidden)


def headline_keys() -> list[str]:
    """The headline keys, in declaration order."""
    return list(dict.fromkeys(k for f in _FAMILIES.values() for k in f.headline))


#: the scales of keys no panel takes: the sequence accuracies (hidden; where every answer is one
#: token, the accuracy itself) are accuracies, watched on their values as the accuracies are
#: (undeclared, one spanning two decades was watched in log10: docs/stages.md, How stages are found, 1)
UNDRAWN_SCALES = {"val/seq_acc": "linear", "val_longer/seq_acc": "linear"}


def declared_scale(key: str) -> str | None:
    """The scale `key` is watched on, as declared (phases/scale.py `watch_scale` decides the
    rest): "log" when the first declared panel that takes it draws it on a log axis, "linear"
    when that panel does not; when no panel takes it, its `UNDRAWN_SCALES` entry, else None."""
    panel = next((p for p in panels() if p.matches(key)), None)
    return UNDRAWN_SCALES.get(key) if panel is None else "log" if panel.log_y else "linear"


def _declares(family: KeyFamilies, key: str) -> bool:
    """Whether a declaration speaks of `key` (a panel, a headline, hidden or detail key)."""
    return (any(p.matches(key) for p in family.panels) or key in family.headline
            or any(_hides(h, key) for h in family.hidden) or bool(family.detail and re.search(family.detail, key)))


def key_family(key: str) -> str:
    """The owner whose declaration speaks of `key` (the first declared), else the key's first part."""
    return next((owner for owner, f in _FAMILIES.items() if _declares(f, key)), key.split("/", 1)[0])


def stage_rules() -> StageRules:
    """What the declarations tell the stage detector: every declared stage signature, the
    headline keys, each key's family (`key_family`), the detail keys and the declared scales."""
    return StageRules(signatures=tuple(s for f in _FAMILIES.values() for s in f.stages),
                      headline=frozenset(headline_keys()), family=key_family, detail=is_detail,
                      scale=declared_scale)

"""plugins.entry_points_of: the installed distributions are read once, and again when sys.path
or one of its folders changes (a plug-in installed while the process runs is still seen)."""

import importlib.metadata
import os
import sys

from phasewatch import plugins

GROUP = "phasewatch.test_cache_group"


def install(site, name: str) -> None:
    """A distribution `name` with one entry point in GROUP, as pip lays it out in `site`."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{name} = {name}_module\n")


def test_entry_points_are_read_once_and_again_after_an_install(tmp_path, monkeypatch):
    reads = []
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: reads.append(kw) or real(**kw))
    site = tmp_path / "site"
    site.mkdir()
    install(site, "first")
    assert plugins.entry_points_of(GROUP) == ()
    assert plugins.entry_points_of(GROUP) == () and len(reads) == 1  # nothing changed: not read again

    monkeypatch.setattr(sys, "path", [str(site), *sys.path])  # a folder put on the path
    assert [ep.name for ep in plugins.entry_points_of(GROUP)] == ["first"] and len(reads) == 2
    assert len(plugins.entry_points_of(GROUP)) == 1 and len(reads) == 2

    os.utime(site, ns=(10**18, 10**18))  # the folder as last changed long ago (2001) ...
    plugins.entry_points_of(GROUP)
    install(site, "second")  # ... and a distribution installed into it now
    assert sorted(ep.name for ep in plugins.entry_points_of(GROUP)) == ["first", "second"]
    monkeypatch.setattr(sys, "path", sys.path[1:])
    assert plugins.entry_points_of(GROUP) == ()

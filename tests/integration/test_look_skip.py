"""A watcher look with nothing new to see is cut short (callbacks/transitions.py `look`): a
real tiny fit says, writes and checkpoints the same as with every look made whole."""

import re

import torch

from phasewatch.callbacks.transitions import TransitionWatcher

from .test_step_chunks import fit

LOOK, STAGE_NEWS = TransitionWatcher.look, TransitionWatcher.stage_news
#: longer, faster and logged densely (no probes, for time): a stage said to begin and confirmed, every event said
CHANGES = ("--trainer.max_steps", "100", "--trainer.log_every_n_steps", "2", "--model.lr", "0.01",
           "--transitions.verbose", "true", "--probes.names", "[]")


def said(console: str, folder) -> str:
    """The console, but for the run's folder, its size (its figures name it) and timings."""
    return re.sub(r"\([0-9.]+ [kMG]?B\)|[0-9.]+% of", "x", console.replace(str(folder), "RUN"))


def watcher_state(run_dir) -> dict:
    """The watcher's state in the run's last checkpoint."""
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "TransitionWatcher" in k]
    return state


def test_a_fit_cut_short_where_nothing_is_new_says_and_saves_what_every_look_whole_does(tmp_path, monkeypatch, capsys):
    runs = {}
    # this short fit's one change (the train loss falls 4%) is too small to be said as a stage
    # (`evident`); said here all the same, so that the stage news go through both watchers
    monkeypatch.setattr("phasewatch.callbacks.transitions.evident", lambda stage, series: True)
    for name, whole in (("short", False), ("whole", True)):
        looks, made = [], []

        def look(self, trainer, step, final=False):
            looks.append(step)
            if whole:
                self._rest = None
            return LOOK(self, trainer, step, final)

        monkeypatch.setattr(TransitionWatcher, "look", look)
        monkeypatch.setattr(TransitionWatcher, "stage_news", lambda self, *a, **k: made.append(1) or STAGE_NEWS(self, *a, **k))
        fit(tmp_path / name, True, monkeypatch, *CHANGES)
        folder = tmp_path / name
        runs[name] = dict(looks=len(looks), made=len(made), console=said(capsys.readouterr().out, folder),
                          events=(folder / "events.jsonl").read_text(), state=watcher_state(folder),
                          stages=(folder / "stages.jsonl").read_text() if (folder / "stages.jsonl").exists() else None,
                          metrics=(folder / "metrics.jsonl").read_text())
    short, whole = runs["short"], runs["whole"]
    assert "confirmed stage 1" in whole["console"] and "transition in train/loss" in whole["console"]
    assert short["looks"] == whole["looks"] == whole["made"] > short["made"] > 0
    for part in ("console", "events", "stages", "state", "metrics"):
        assert short[part] == whole[part], part

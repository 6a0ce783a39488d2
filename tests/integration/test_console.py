"""What `phasewatch fit` prints: the watcher's lines never share a console line with the progress bar."""

import pytest

from phasewatch.cli.main import main

from .test_fit import TASKS

#: what only Lightning's progress bar prints
BAR = ("it/s]", "s/it]", "Epoch 0:")


def screen_lines(text: str) -> list[str]:
    """The lines a terminal shows for `text`: within a line, a carriage return goes back to its
    start and what follows overwrites what was there."""
    shown = []
    for raw in text.split("\n"):
        line: list[str] = []
        column = 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            if column < len(line):
                line[column] = char
            else:
                line.append(char)
            column += 1
        shown.append("".join(line).rstrip())
    return shown


def test_screen_lines_sees_a_line_printed_onto_the_bar():
    """The check itself: a print after the bar's unfinished line joins it; tqdm's write does not."""
    glued = "Epoch 0:  5%|▌ | 45/900 [00:36<11:41,  1.22it/s]phasewatch: step 50: transition in val/acc\n"
    assert any("phasewatch:" in s and "it/s]" in s for s in screen_lines(glued))
    cleared = "Epoch 0:  5%|▌ | 45/900 [00:36<11:41,  1.22it/s]\r" + " " * 50 + "\rphasewatch: step 50: x\n"
    assert [s for s in screen_lines(cleared) if s] == ["phasewatch: step 50: x"]


@pytest.mark.slow  # ~35 s of CPU (a fit with a look at every validation); the check itself is tested above
def test_event_lines_never_share_a_line_with_the_progress_bar(tmp_path, capsys, monkeypatch):
    """A real fit with the progress bar and every event printed (--transitions.verbose true):
    each watcher line is a line of its own on the screen (a plain print glued one of this run's
    three onto the bar)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert main(["fit", "--run_dir", str(tmp_path / "run"), *TASKS["modular_addition"], "--data.task.p", "11",
                 "--trainer.max_steps", "60", "--trainer.val_check_interval", "5", "--trainer.log_every_n_steps", "5",
                 "--model.weight_decay", "0.1", "--model.arch.d_model", "32", "--model.arch.d_mlp", "64",
                 "--model.arch.n_heads", "2", "--model.arch.d_head", "16", "--probes.names", "[]",
                 "--transitions.verbose", "true", "--no_wandb"]) == 0
    out = capsys.readouterr().out
    lines = screen_lines(out)
    events = [s for s in lines if "phasewatch: step" in s]
    assert events and any(b in out for b in BAR), out[-3000:]  # event lines, and the bar was drawn
    mixed = [s for s in lines if "phasewatch: " in s and any(b in s for b in BAR)]
    assert not mixed, mixed
    assert all(s.startswith("phasewatch: step") for s in events), events


def test_the_progress_bar_counts_optimisation_steps_though_a_lightning_step_runs_several(tmp_path, capsys,
                                                                                         monkeypatch):
    """On the CPU a Lightning step runs several optimisation steps (`TrainModule.chunked`): the bar
    still counts steps, up to max_steps at the end, never down (it showed the first step of each
    chunk: 51 of 60 at the end)."""
    import re

    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert main(["fit", "--run_dir", str(tmp_path / "run"), *TASKS["modular_addition"], "--data.task.p", "11",
                 "--trainer.max_steps", "60", "--trainer.val_check_interval", "30", "--trainer.log_every_n_steps", "10",
                 "--model.arch.d_model", "16", "--model.arch.d_mlp", "32", "--model.arch.n_heads", "2",
                 "--model.arch.d_head", "8", "--probes.names", "[]", "--transitions.looks", "0", "--no_wandb"]) == 0
    counts = [int(n) for n, total in re.findall(r"\| *(\d+)/(\d+) \[", capsys.readouterr().out) if total == "60"]
    assert counts and counts[-1] == 60, counts
    assert counts == sorted(counts), counts
    # drawn at each refresh (1 step here) a chunk ended at: validation (30) and the checkpoints'
    # log-spaced steps (a logging step, logged inside its chunk, ends none)
    assert 30 in counts and len(set(counts)) >= 20, counts

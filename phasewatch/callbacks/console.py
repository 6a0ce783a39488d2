"""One line to the console during training, never on the progress bar's line.

`say(trainer, line)`: with Lightning's TQDMProgressBar, the line goes through tqdm's `write`,
which clears the bars on the same stream, prints the line and draws the bars again below it
(a plain `print` would append it to the bar's unfinished line); without one, a plain print.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


def say(trainer: pl.Trainer | None, line: str) -> None:
    """Print `line` (one console line) clear of the training's progress bar."""
    if trainer is not None and isinstance(getattr(trainer, "progress_bar_callback", None), TQDMProgressBar):
        Tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)

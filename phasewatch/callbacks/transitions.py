"""Live phase-transition detection: a thin callback around `probes.transitions`.

Every `every_n_validations` validations it takes the series logged so far (kept in memory
by the run folder's logger), detects transitions in the watched ones (all but the detail
keys the probes declare), and reports each new, finished one once: a line on the console,
the event (with `detected_at`, the step at which it was detected) handed to every logger
that records events (the run folder's events, the W&B run summary). A transition counts as finished when the series has gone on for a while after
its end (its end step x `settle`) and at least `points_after` more values of the series
have been logged (a sparse series, like the LLC on its 24 steps, otherwise gets its
transition reported half-seen, and the full one later counts as already reported).
What was reported is kept in checkpoints, so a resumed run does not report it again.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from phasewatch.callbacks.loggers import log_event, logged_series
from phasewatch.probes.keys import is_detail
from phasewatch.probes.transitions import detect_transitions

SAME = 1.5


class TransitionWatcher(pl.Callback):
    """Args:
    metrics: the series to watch (default: every logged series but the detail keys the
        probes declare: per-head, per-pair and per-frequency series, diagnostics, `lr`).
    every_n_validations: how often to look (detection costs ~0.1 s per series of a few hundred
        points; a series of 100 points or more is looked at again once it has grown by `regrow`
        of its points since the last time: 10% more points, ~10% more steps when logged evenly).
    settle: report a transition once the run has reached `settle` x its end step...
    points_after: ... and the series has this many values after its end (at the end of
        training every transition found is reported).
    """

    def __init__(self, metrics: list[str] | None = None, every_n_validations: int = 4, settle: float = 1.5,
                 points_after: int = 3, regrow: float = 0.1):
        self.metrics, self.every, self.settle = metrics, max(1, int(every_n_validations)), settle
        self.points_after, self.regrow = points_after, regrow
        self.reported: list[dict[str, Any]] = []
        self._validations = 0
        self._looked: dict[str, int] = {}  # series -> its number of points when last looked at

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        self._validations += 1
        if self._validations % self.every == 0:
            self.look(trainer, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.look(trainer, trainer.global_step, final=True)

    def look(self, trainer: pl.Trainer, step: int, final: bool = False) -> list[dict]:
        series = {key: s for key, s in logged_series(trainer).items()
                  if (key in self.metrics if self.metrics is not None else not is_detail(key))}
        new = []
        for key, (steps, values) in sorted(series.items()):
            seen = self._looked.get(key, 0)
            if not (final or seen < 100 or len(steps) >= (1 + self.regrow) * seen):
                continue
            self._looked[key] = len(steps)
            for event in detect_transitions(steps, values, key):
                settled = step >= self.settle * event["end"] and sum(s > event["end"] for s in steps) >= self.points_after
                if (final or settled) and not self._known(event):
                    event["detected_at"] = int(step)
                    self.reported.append(event)
                    new.append(event)
                    self._announce(trainer, event)
        return new

    def _known(self, event: dict) -> bool:
        """Already reported: same metric and direction, and spans that overlap once each is
        widened by `SAME` in log-step (estimates move a little as the series grows)."""
        return any(r["metric"] == event["metric"] and r["direction"] == event["direction"]
                   and r["onset"] / SAME <= event["end"] * SAME and event["onset"] / SAME <= r["end"] * SAME
                   for r in self.reported)

    @staticmethod
    def _announce(trainer: pl.Trainer, event: dict) -> None:
        print(f"phasewatch: step {event['detected_at']}: transition in {event['metric']} ({event['direction']}) "
              f"from step {event['onset']} to {event['end']}, midpoint {event['midpoint']}, "
              f"magnitude {event['magnitude']:.4g}")
        log_event(trainer, event)

    def state_dict(self) -> dict[str, Any]:
        return {"reported": self.reported, "validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reported = list(state_dict.get("reported", []))
        self._validations = int(state_dict.get("validations", 0))

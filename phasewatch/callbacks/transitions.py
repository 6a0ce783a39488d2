"""Live phase-transition detection: `TransitionWatcher`, a callback around `phases.detector`.

At every `every_n_validations`-th validation and on a log-spaced grid of `looks` steps (its bars
raised for the looks a run plans: `bar_for`) it runs the detector and the departure test on the
series logged so far (all but the probes' detail keys), each on its scale (`phases.scale`), and
reports each change in stages (`phases.events.Event` with `stage` and `detected_at`): `onset`
(under way), `confirmed` (settled: the run at `settle` x its end, `points_after` values after
it, found in two looks) or `withdrawn` (an onset no transition took up). Every event goes to the
loggers that record events (the run folder's events, W&B). The console gets the run's stages
(`phases.stages`: begins, confirmed with the levels of its headline series, withdrawn; every
per-series event only with `verbose`), clear of the progress bar (`callbacks.console.say`).
While an onset is pending, checkpoints and probes also run on a denser log-spaced grid
(`dense_now`, `dense_metrics`, `dense_probes`: adaptive resolution), and the training metrics
are logged densely early (`logged_at`). State is kept in checkpoints, so a resumed run reports
nothing twice. The rules: docs/phases.md, "Watching live".
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Any

import lightning.pytorch as pl
import numpy as np

from phasewatch.loggers.run_folder import log_event, logged_series, run_folder
from phasewatch.callbacks.console import say
from phasewatch.callbacks.schedule import Schedule
from phasewatch.probes.keys import declared_scale, headline_keys, is_detail, stage_rules
from phasewatch.phases.detector import DECADE_CHANGE, DEPARTURE_Z, TOGETHER, departure, detect_transitions, together
from phasewatch.phases.events import Event
from phasewatch.phases.scale import LOG, watch_scale
from phasewatch.phases.stages import Stage, detect_stages, lead_member, one_activity, write_stages
from phasewatch.errors import require, require_int
from phasewatch.rundir import is_number

#: two events are the same transition when their spans, each widened by this factor in log-step,
#: overlap (estimates move a little as the series grows): the detector's `together`
SAME = TOGETHER
#: an onset is withdrawn when the run reaches this multiple of the last step at which it was found
WITHDRAW = 2.0
#: a confirmed transition found again with more than this factor of its magnitude is a new one
GROWN = 4.0
#: an onset needs this many values of the series from its 10% point on
ONSET_POINTS = 2
#: a change this many standard errors large is an onset when first found (a weaker one when found twice)
SURE = 10.0
#: before the end of training, a change counts (for an onset or a confirmation) only with this
#: detector confidence or more (~1.7 standard errors past the tests: a run looks hundreds of times,
#: and a change that only just passes in one look is often noise that the next one drops)
SURE_ENOUGH = 0.95
# the bars above (and `departure_z`) were set for a look at every validation (bench/README.md);
# a run whose grid adds looks raises them so that its chance of a false alarm per series stays
# that of its validations alone (`bar_for`)

#: besides every validation, a look at each step of a log-spaced grid of this many points (the
#: probes' default schedule: 60), dense early where validations are sparse
LOOKS = 60
#: the `transitions.logs_per_doubling` to ask for (off by default and in the configs for its
#: cost: docs/phases.md, "When the watcher looks"): the training metrics logged at least this many
#: times per doubling of the step (every step up to this step, every 2nd up to twice it, ...)
#: until the trainer's `log_every_n_steps` is denser: the detector fits a change from ~8 points,
#: which a change lasting a doubling then has before its midpoint (quickstart_tiny's memorisation,
#: steps ~27-55: 1 point by its midpoint when logged every 10 steps)
LOGS_PER_DOUBLING = 16


#: a confirmed stage's line gives the levels of a headline series that moved in it by at least
#: this fraction of the series' largest absolute value (linear scale) ...
SHOWN_FRACTION = 0.05
#: ... or by this factor (log scale: a halving or a doubling)
SHOWN_FACTOR = 10**DECADE_CHANGE


def bar_for(z: float, looks: int, reference: int) -> float:
    """The bar of a per-look test (`z` standard errors, one-sided, set for `reference` looks) in
    a run that plans `looks` looks: each look is a test, and the run's chance of a false alarm
    is at most the sum of theirs (Bonferroni), so each gets `reference / looks` of the tail
    probability at `z`; never below `z` (docs/phases.md, "When the watcher looks")."""
    if looks <= reference:
        return float(z)
    tail = 0.5 * math.erfc(z / math.sqrt(2))  # P(Z > z), exact far out where 1 - cdf is 0
    return -NormalDist().inv_cdf(tail * reference / looks)


def logged_at(step: int, every: int, per_doubling: int) -> bool:
    """Whether the training metrics are logged at `step` (the trainer's count after that step's
    update, as Lightning's `log_every_n_steps` counts): every `every` steps, and early on also
    at the multiples of the largest power of two <= step / `per_doubling` below `every` (0: every
    `every` steps only; `every` 0: never)."""
    if every < 1 or step % every == 0:
        return every >= 1
    if per_doubling <= 0:
        return False
    gap = 1 << max(0, (step // per_doubling).bit_length() - 1)
    return gap < every and step % gap == 0


def _same(a: dict, b: dict) -> bool:
    return a["metric"] == b["metric"] and a["direction"] == b["direction"] and together(a, b)


def _continues(pending: dict, event: dict) -> bool:
    """`event` is the change of a pending onset, which has been under way from its onset to the
    last look that found it."""
    return _same({**pending, "end": pending.get("seen_at", pending["detected_at"])}, event)


def _same_change(a: dict, b: dict, series: dict) -> bool:
    """Two stage members are one change: the same series and direction, fitted twice (`_refit`
    on the series' logged steps)."""
    return (a["series"] == b["series"] and a["direction"] == b["direction"]
            and _refit(a, b, series.get(a["series"], ((), ()))[0]))


def _refit(a: dict, b: dict, steps) -> bool:
    """Two fitted changes are one change fitted twice: one's midpoint lies within the other's
    span widened to the logged `steps` around it (a later fit moves a change's ends as more of
    the series comes, and a jump between two logged steps can be fitted anywhere between
    them); a change that follows another, its midpoint past the other's, is a new one."""
    logged = np.asarray(steps, dtype=float)

    def within(e: dict, x: float) -> bool:
        before, after = logged[logged <= e["onset"]], logged[logged >= e["end"]]
        return (before[-1] if len(before) else e["onset"]) <= x <= (after[0] if len(after) else e["end"])

    return within(a, b["midpoint"]) or within(b, a["midpoint"])


def _first_after(steps, end: float) -> float:
    """The first of the logged `steps` after `end` (where a jump between two logged steps that
    was fitted to end before it shows); infinity when none is."""
    return next((float(s) for s in steps if s > end), float("inf"))


def _after(pending: dict, event: dict, steps) -> bool:
    """A pending onset began after `event` had ended: past `_first_after` its end."""
    return pending["onset"] > _first_after(steps, event["end"])


def _apart(a: dict, b: dict, confirmed: list[dict], steps) -> bool:
    """Two changes of a series lie on either side of the end of one of its `confirmed`
    transitions (one began by `_first_after` its end, the other after): they are not one
    change, however close (a series that has settled after a transition and then moves on
    has begun a new one)."""
    return any(_after(a, r, steps) != _after(b, r, steps) for r in confirmed)


def _moving_on(event: dict, left: dict | None, past) -> bool:
    """The series departs from its trend in `event`'s direction from one of the logged steps
    `past` its end (the first few), after the first (`left`: this look's departure; from the
    first one it is part of the change, `_confirmed`): those points are not a level after the
    change but more of it, which the detector fits to the same transition once it has seen it."""
    return (left is not None and left["direction"] == event["direction"] and bool(past)
            and past[0] < left["onset"] <= past[-1])


class TransitionWatcher(pl.Callback):
    """Args:
    metrics: the series to watch (default: every logged series but the detail keys the
        probes declare: per-head, per-pair and per-frequency series, diagnostics, `lr`).
    every_n_validations: how often to look at validations (detection costs ~0.1 s per series of a few hundred
        points; a series is looked at again only once it has new points, and one of 100 points or
        more once it has grown by `regrow` of its points since the last time: 10% more points,
        ~10% more steps when logged evenly, or whenever it has new points while a change in it is
        under way, `_under_way`; the departure test, cheap, at every look with new
        points)...
    looks: ... and also at the steps of a log-spaced grid of this many points (`look_steps`: 0,
        at validations only). The bars of the tests (`departure_z`, `SURE`, `SURE_ENOUGH`) rise
        with the looks the grid adds (`bar_for`).
    settle: confirm a transition once the run has reached `settle` x its end step...
    points_after: ... and the series has this many values after its end (at the end of
        training every transition found is confirmed).
    dense: while an onset is pending, run checkpoints and scheduled probes (the cheap ones,
        those that log a series in transition, every one for a series no probe logs:
        `dense_probes`) also at the steps of a log-spaced grid of `dense_count` points
        (adaptive resolution; False keeps them on their schedules)...
    dense_for: ... until confirmation or withdrawal, for at most this multiple of the onset's
        `detected_at` step.
    departures: also give an onset when a series' newest points leave its recent trend
        (`phases.detector.departure`), before the detector can fit the change (False: onsets
        only from the detector's changes under way)...
    departure_z: ... by this many standard errors (`phases.detector.DEPARTURE_Z`): a higher bar
        says fewer onsets that come to nothing and says the others later (bench/README.md,
        `live_latency.py --frontier`).
    verbose: also print every per-series event (onsets, withdrawals, confirmed transitions of
        every watched series); by default the console gets the stages only (`_stage_line`).
        Every event goes to the loggers either way.
    logs_per_doubling: log the training metrics early on at least this many times per doubling
        of the step, besides every `trainer.log_every_n_steps` (`logged_at`; 0, the default: not;
        `LOGS_PER_DOUBLING` to ask for it; a population's members log as one: each sets its trainer's).
    """

    def __init__(self, metrics: list[str] | None = None, every_n_validations: int = 1, settle: float = 1.1,
                 points_after: int = 3, regrow: float = 0.1, dense: bool = True, dense_count: int = 200, dense_for: float = 3.0,
                 departures: bool = True, departure_z: float = DEPARTURE_Z, verbose: bool = False,
                 looks: int = LOOKS, logs_per_doubling: int = 0):
        self.metrics, self.every, self.settle, self.departures = metrics, max(1, int(every_n_validations)), settle, departures
        self.points_after, self.regrow, self.dense, self.dense_for = points_after, regrow, dense, dense_for
        require_int(dense_count, "transitions.dense_count", 2)
        require(is_number(departure_z) and departure_z > 0, "transitions.departure_z",
                f"{departure_z!r} is not a number of standard errors",
                f"Give a number > 0 ({DEPARTURE_Z:g} by default; higher for fewer onsets that come to nothing, said later), "
                "or --transitions.departures false for no departure test.")
        require_int(looks, "transitions.looks", 0)
        self.dense_count, self.departure_z, self.verbose = dense_count, float(departure_z), bool(verbose)
        self.looks = int(looks)
        require_int(logs_per_doubling, "transitions.logs_per_doubling", 0)
        self.logs_per_doubling = int(logs_per_doubling)
        self._log_every = 0  # the trainer's log_every_n_steps, where this watcher logs densely early (`setup`)
        self._look_grid: set[int] = set()
        self._acts: set[int] | None = None  # the steps `due_at` says, laid out by `plan` (`_acting`)
        self._planned = self._reference = 1  # the looks the run plans, and at validations alone (`plan`)
        self._max_steps = 0  # the run's last step (`plan`; 0: not known)
        self._last_look: int | None = None
        self.reported: list[dict[str, Any]] = []  # every event reported, in order
        self.pending: list[dict[str, Any]] = []  # onsets not yet confirmed or withdrawn
        self._candidates: dict[str, list[dict]] = {}  # series -> transitions found settled but not yet twice
        self._dense_steps: set[int] = set()
        self._validations = 0
        self._looked: dict[str, int] = {}  # series -> its number of points when last looked at
        self._examined: list[str] = []  # the series the last `update` examined (detector or departure test)
        self._keys: dict[str, str | None | bool] = {}  # series -> False (not watched) or its declared scale (`_declared`)
        self._details: dict[str, bool] = {}  # series -> `is_detail` (`_detail`)
        self._rest: int | None = None  # the points logged when the last look left its stages as they were
        self._departed: dict[str, int] = {}  # ... when the departure test last looked at it
        self._fits_under_way: dict[str, list[dict]] = {}  # series -> the detector's changes not yet confirmed (last look)
        self.stages: list[Stage] = []  # the run's stages so far (`stage_news`)
        self._said: dict[int, str] = {}  # stage id -> what was said of it: "begins" or "confirmed"
        self._begun: dict[int, Stage] = {}  # stage id -> the stage as last seen while said to begin
        self._said_as: dict[int, Stage] = {}  # stage id -> the stage as it was said to begin

    # --- when ---------------------------------------------------------------------

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        self._validations += 1
        last = 0 < trainer.max_steps <= trainer.global_step  # the final look follows (on_train_end)
        if self._validations % self.every == 0 and not last:
            self.look(trainer, trainer.global_step)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        # after the probes of this step (ProbeRunner's hook comes first), before its batch
        step = trainer.global_step
        if self._log_every > 1:  # Lightning and the module read it before this step's update
            trainer.log_every_n_steps = 1 if self._early(step + 1) else self._log_every
        if step in self._look_grid and step != self._last_look and not trainer.sanity_checking:
            self.look(trainer, step)

    def due_at(self, step: int, dense: bool = False) -> bool:
        """Whether the watcher acts at the start of `step` (a look of its grid: `look_steps`; a
        step logged early, or the one after, `_early`: it sets the logging); a population leaves
        it out of the other steps (training/population.py)."""
        acts = self._acts
        if acts is not None:  # laid out by `plan`: one `in` a step
            return step in acts
        return step in self._look_grid or self._early(step + 1) or self._early(step)

    def _acting(self, max_steps: int) -> set[int] | None:
        """The steps up to `max_steps` + 1 at which `due_at` is true (None for a run of unknown
        length): the look grid's, and around the steps logged early only (`_early`: none from
        2 x `logs_per_doubling` x the trainer's `log_every_n_steps` on, where `logged_at`'s gap,
        a power of two past step / `logs_per_doubling` / 2, reaches it)."""
        if max_steps <= 0:
            return None
        last = min(max_steps + 1, 2 * self.logs_per_doubling * self._log_every + 1) if self._log_every > 1 else -1
        return self._look_grid | {s for s in range(last + 1) if self._early(s + 1) or self._early(s)}

    def _early(self, step: int) -> bool:
        """The training metrics are logged at `step` early only (`logged_at`, between the
        trainer's own `log_every_n_steps`)."""
        every = self._log_every
        return every > 1 and step % every != 0 and logged_at(step, every, self.logs_per_doubling)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._log_every > 1:
            trainer.log_every_n_steps = self._log_every

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.look(trainer, trainer.global_step, final=True)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._log_every = int(trainer.log_every_n_steps or 0) if self.logs_per_doubling else 0
        interval = getattr(trainer, "val_check_interval", None)
        every = interval if isinstance(interval, int) and interval > 0 else None
        validations = list(range(every, trainer.max_steps + 1, every)) if every and trainer.max_steps > 0 else []
        if trainer.max_steps > 0 and validations:
            self.plan(trainer.max_steps, len(self.look_steps(trainer.max_steps, validations)),
                      len(self.look_steps(trainer.max_steps, validations, grid=False)))
        else:  # looks not known ahead: the bars as given
            self.plan(trainer.max_steps)

    def look_steps(self, max_steps: int, validations: list[int], grid: bool = True) -> list[int]:
        """The steps a run of `max_steps` steps looks at, given its validation steps: every
        `every`-th validation, the steps of a log-spaced grid of `looks` points (the grid's step
        0 left out: nothing is logged yet; none with `grid=False`) and the last step."""
        grid_steps = Schedule(kind="log", count=self.looks).resolve(max_steps) if grid and self.looks and max_steps > 0 else []
        return sorted((set(grid_steps) - {0}) | set(validations[self.every - 1::self.every]) | {max_steps})

    def plan(self, max_steps: int, looks: int | None = None, validations: int | None = None) -> None:
        """Lay out a run of `max_steps` steps: the look grid (`look_steps`), the dense grid
        (adaptive resolution) and the bars for the `looks` it plans in all against the
        `validations` looks it would make without the grid (`bar_for`; None: the bars as given)."""
        self._look_grid = set(self.look_steps(max_steps, [])) - {max_steps} if max_steps > 0 else set()
        self._acts = self._acting(max_steps)
        self._keys, self._details = {}, {}  # the keys' declarations as they are for this run (`_declared`, `_detail`)
        self._planned, self._reference = (looks, validations) if looks and validations else (1, 1)
        self._max_steps = max(int(max_steps), 0)
        self._dense_steps = set(Schedule(kind="log", count=self.dense_count).resolve(max_steps)) if self.dense else set()

    def bar(self, z: float) -> float:
        """`bar_for(z)` at the looks this run plans."""
        return bar_for(z, self._planned, self._reference)

    def dense_now(self, step: int) -> bool:
        """Whether checkpoints run at `step` for adaptive resolution: it is on the dense grid,
        and an onset is pending that was found no more than `dense_for` x its step ago."""
        return step in self._dense_steps and bool(self.dense_metrics(step))

    def dense_metrics(self, step: int) -> set[str]:
        """The series whose pending onsets make `step` dense (`dense_now`): the probes that
        log them run there (`ProbeRunner`); none when it is not."""
        if step not in self._dense_steps:
            return set()
        return {p["metric"] for p in self.pending if step <= self.dense_for * max(p["detected_at"], 1)}

    # --- what ---------------------------------------------------------------------

    def look(self, trainer: pl.Trainer, step: int, final: bool = False) -> list[dict]:
        """Detect in every watched series logged so far; report and return the new events. A look
        with nothing new to see stops after `update`: it examined no series (none had new points
        since the last look, and none is newly due: its state is as it was), no series has a new
        point, and the last look left the stages as they were (`_rest`), so that they would come
        out the same again, with nothing to say (`stage_news` reads the step only at the end)."""
        self._last_look = step
        series = logged_series(trainer)
        new = self.update(series, step, final)
        if not final and not self._examined and _points(series) == self._rest:
            return new  # nothing new to see: the stages as they were (`_rest`), nothing to say
        for event in new:
            if self.verbose:
                say(trainer, _line(trainer, event, series))
            log_event(trainer, event)
        before = _outline(self.stages)
        news = self.stage_news(series, step, final)
        self._rest = _points(series) if not news and _outline(self.stages) == before else None
        for what, stage in news:
            say(trainer, _stage_line(trainer, step, what, stage, series, self.begun_as(what, stage)))
            for logger in trainer.loggers:  # W&B: the stages table and an alert per confirmed stage
                if hasattr(logger, "log_stage"):
                    logger.log_stage(what, stage)
        if news:
            folder = run_folder(trainer)
            if folder is not None:  # the live report's stage timeline (the fit's end writes the final stages)
                write_stages(folder, self.stages_said())
        return new

    def stage_news(self, series: dict, step: int, final: bool = False) -> list[tuple[str, Stage]]:
        """The run's stages so far (phases/stages.py: of the confirmed transitions and the changes
        the detector sees under way that pass the bar an onset needs, `SURE_ENOUGH`), kept in `stages` with ids that carry between looks, and what
        is new to say of them: ("begins", stage) when a stage is first seen, unless it is one
        activity with a stage already said (`one_activity`: no news; it is said once confirmed),
        ("confirmed", stage) once every member is a confirmed transition, each only once the
        stage is `evident`;
        ("withdrawn", stage) at the end for a stage said to begin that was not confirmed and
        that no confirmed stage took up (one sharing a moved series with it over its span, as it
        was said or as last seen, takes it up: nothing is said). A stage said confirmed keeps its members, name and id, and more
        of its changes join it unsaid (`detect_stages`' `keep`); what "begins" claims:
        `_stage_line`."""
        confirmed = [e for e in self.reported if e.get("stage") == "confirmed"]
        under_way = [] if final else [{**e, "under_way": True} for fits in self._fits_under_way.values() for e in fits
                                       if not self._confirmed(e, series.get(e["metric"], ((), ()))[0])
                                       and e["confidence"] >= self._sure_enough()]
        watched = {k: s for k, s in series.items() if not self._detail(k)}
        kept = [s for s in self.stages if self._said.get(s.id) == "confirmed"]  # said confirmed: kept as said
        # ids carry from the last look's stages and from those said to begin, even if a look lost them
        self._begun.update({s.id: s for s in self.stages if self._said.get(s.id) == "begins"})
        here = {s.id for s in self.stages}
        previous = self.stages + [s for k, s in self._begun.items() if k not in here and self._said.get(k) == "begins"]
        rules = stage_rules()
        self.stages = detect_stages(confirmed + under_way, watched, rules, previous=previous, keep=kept)
        self._heir(series)
        news = []
        told = [s for s in self.stages + list(self._said_as.values()) if self._said.get(s.id) in ("begins", "confirmed")]
        for stage in self.stages:
            done = not any(m.get("under_way") for m in stage.members)
            said = self._said.get(stage.id)
            if said is None and not done:
                begun = self._as_begun(stage, rules)
                if (evident(begun, series) and self._beginning(stage, series, step) and not self._regrouped(stage, series)
                        and not any(s.id != stage.id and one_activity(s, stage, series) for s in told)):
                    news.append(("begins", begun))
                    self._said[stage.id], self._said_as[stage.id] = "begins", begun
            elif said != "confirmed" and done and evident(stage, series):
                news.append(("confirmed", stage))
                self._said[stage.id] = "confirmed"
        if final:
            confirmed = [s for s in self.stages if self._said.get(s.id) == "confirmed"]
            for stage_id, said in list(self._said.items()):
                if said != "begins":
                    continue
                seen = [*self._as_said(stage_id), *(s for s in self.stages if s.id == stage_id)]
                taken = any(s.moved & begun.moved and s.onset <= begun.end and begun.onset <= s.end
                            for begun in seen for s in confirmed)
                if not taken:
                    news.append(("withdrawn", Stage(stage_id, step, step, step, [], "")))
                self._said[stage_id] = "joined" if taken else "withdrawn"
        return news

    def stages_said(self) -> list[Stage]:
        """The stages said so far, as said: one said only to begin carries a name only where its
        "begins" line could give it now (`_as_begun`), so that the live report and stages.jsonl
        claim no name the console holds back."""
        rules = stage_rules()
        return [self._as_begun(s, rules) if self._said[s.id] == "begins" else s
                for s in self.stages if self._said.get(s.id)]

    def begun_as(self, what: str, stage: Stage) -> str | None:
        """For a stage's confirmation: the name its "begins" line gave it, where it is confirmed
        under another name or none (a "begins" line without a name claimed none: nothing to
        correct); else None."""
        begun = self._said_as.get(stage.id) if what == "confirmed" else None
        return begun.name if begun is not None and begun.name and begun.name != stage.name else None

    def _as_begun(self, stage: Stage, rules) -> Stage:
        """The stage as a "begins" line may tell it: with its name only where the phases of the
        name's `sequence` declared before it have begun to be told: a stage of one of them was
        said (begins or confirmed) earlier in the run. A signature says what moves in its phase;
        its order in the sequence says what came before (Nanda et al.'s circuit formation is what
        follows memorisation). Offline the whole run is named at once, in that order; live, a
        stage named by its members so far as a later phase, before any earlier one was seen, is
        named against a sequence whose first phases may still come (the quickstart, seed 0: the
        grokking probe's series wiggling at steps 6-30 of a model at initialisation, among them
        a 0.3% dip of the restricted loss at steps 16-21, matched circuit formation while the
        training series had 2 logged points and the test series 1, so that no change could
        show in them: "stage 2 (circuit formation so far) begins at step 6", never
        confirmed). Such a stage is told without the
        name (and said only on evidence without it, `evident`); its confirmation names it as
        the whole run so far does. A copy: the stage itself keeps its name for the grouping."""
        signatures = {s.name: s for s in rules.signatures}
        signature = signatures.get(stage.name)
        if signature is None or signature.sequence is None:
            return stage
        order = [s.name for s in rules.signatures if s.sequence == signature.sequence]
        earlier = set(order[:order.index(stage.name)])
        said = {s.name for s in self._said_as.values()} | {s.name for s in self.stages if self._said.get(s.id) == "confirmed"}
        return stage if not earlier or earlier & said else dataclasses.replace(stage, name=None)

    def _beginning(self, stage: Stage, series: dict, step: int) -> bool:
        """A member of the stage is a change still going on at `step` by the watcher's own
        account: a change in progress (its fitted end after its series' last point), or an
        ended one not yet due for confirmation (the run short of `settle` x its end, or fewer
        than `points_after` values of its series after it). A stage whose changes under way
        are all over by then has not begun now: its fits ended long ago and were never
        confirmed (a fit the detector finds again late, in a series that moved on), and its
        news is its confirmation, if one comes (docs/stages.md, "When a stage is said").
        And one the run can still confirm: its fitted end (the 90% point) at or before the
        run's last step, where known (`plan`). A change whose fit ends after it is not over when
        training ends, so neither a look nor the last one (which confirms a change seen levelling
        off, the detector's test on the finished series) confirms it as fitted: a stage of such
        changes alone, said to begin, could only be withdrawn at the end (quickstart_tiny seed
        10: "stage 5 begins at step 465" said at step 800 of 900, its changes fitted to end at
        1,012-1,059, withdrawn at 900)."""
        def going(m: dict) -> bool:
            if 0 < self._max_steps < m["end"]:
                return False
            if m.get("kind") != "transition":
                return True
            steps = np.asarray(series.get(m["metric"], ((), ()))[0], dtype=float)
            return step < self.settle * m["end"] or int(np.sum(steps > m["end"])) < self.points_after
        return any(m.get("under_way") and going(m) for m in stage.members)

    def _regrouped(self, stage: Stage, series: dict) -> bool:
        """The stage holds a confirmed transition that a stage said to begin and not yet
        confirmed held when last seen (the same change: series, direction, `_refit`): that
        change's beginning was said with that stage, and a look that groups it with other
        changes has made no new stage begin (the quickstart, seed 0: the test loss's confirmed
        falls from step 530 on, members of the stage said to begin at step 325, grouped apart
        at step 2,925 with the fall still under way: "stage 10 begins at step 530"). Said once,
        confirmed. Only where that change leads the stage (the earliest onset: what its "begins"
        line would say): a stage led by a change not said before begins, whatever it holds."""
        if not stage.members:
            return False
        lead = lead_member(stage.members)
        if lead.get("kind", "transition") != "transition" or lead.get("under_way"):
            return False
        return any(_same_change(lead, o, series) for k, said in self._said.items() if said == "begins" and k != stage.id
                   for s in self._as_said(k) for o in s.members
                   if o.get("kind", "transition") == "transition" and not o.get("under_way"))

    def _as_said(self, stage_id: int) -> list[Stage]:
        """A stage said to begin as it was said and as it was last seen among a look's stages."""
        return [s for s in (self._said_as.get(stage_id), self._begun.get(stage_id)) if s is not None]

    def _heir(self, series: dict) -> None:
        """A stage not yet said that holds a change a stage said to begin held (a member of the
        same series and direction, one's midpoint within the other's span: `_refit`, one change
        fitted twice), as it was said or as last seen, when that stage is gone from this look's
        stages, is that stage: it takes its id, so that what was said to begin is confirmed under
        the id it was said with, and not said to begin again under another (a look that groups
        the said stage's changes with others gives the group the id of the previous stage
        sharing most series with it, `detect_stages`' `previous`, which can be one never said)."""
        present = {s.id for s in self.stages}
        gone = [k for k, said in self._said.items() if said == "begins" and k not in present]
        for stage in sorted(self.stages, key=lambda s: (s.onset, s.id)):
            if self._said.get(stage.id) is not None or not gone:
                continue
            held = {}
            for k in gone:
                seen = [m for s in self._as_said(k) for m in s.members]
                common = sum(any(_same_change(m, o, series) for o in seen) for m in stage.members)
                if common:
                    held[k] = common
            if held:
                heir = max(held, key=lambda k: (held[k], -k))
                gone.remove(heir)
                stage.id = heir

    def update(self, series: dict, step: int, final: bool = False) -> list[dict]:
        """The new events at `step` given the series so far ({key: (steps, values)}), recorded
        as reported (`look` without a trainer: what bench/live_latency.py replays)."""
        new: list[dict] = []
        self._examined = []
        for key in sorted(series):
            steps, values = series[key]
            seen = self._looked.get(key, 0)
            due = final or (len(steps) > seen and (seen < 100 or len(steps) >= (1 + self.regrow) * seen
                                                   or self._under_way(key, step)))
            departs = self.departures and not final and len(steps) > self._departed.get(key, 0)
            if not (due or departs) or (declared := self._declared(key)) is False:
                continue  # nothing to do in this series (most of a look's series, most looks), or not watched
            self._examined.append(key)
            left = None
            scale = watch_scale(values, declared)  # the same choice as `phasewatch phases`
            if departs:
                self._departed[key] = len(steps)  # the departure test is cheap: every look with new points
                left = departure(steps, values, key, log_values=scale == LOG, bar=self.bar(self.departure_z))
                left = left and {**left, "scale": scale}
            if due:
                self._looked[key] = len(steps)
            found = detect_transitions(steps, values, key, in_progress=not final, scale=scale) if due else None
            if found is not None:
                self._fits_under_way[key] = [e for e in found if not self._confirmed(e, steps)]
            if found is not None or left is not None:
                new += self._judge(key, steps, found, step, final, left)
        for event in new:
            event["detected_at"] = int(step)
            self.reported.append(event)
        return new

    def _declared(self, key: str) -> str | None | bool:
        """False for a series not watched (not in `metrics`; by default a detail key), else its
        declared scale (`declared_scale`); each key's answer kept (the keys' declarations do
        not change during a fit, `plan` forgets them; a look asks it of every series with new
        points)."""
        if key not in self._keys:
            watched = key in self.metrics if self.metrics is not None else not is_detail(key)
            self._keys[key] = declared_scale(key) if watched else False
        return self._keys[key]

    def _detail(self, key: str) -> bool:
        """`is_detail(key)`, each key's answer kept (as `_declared`'s: a look asks it of every series)."""
        if (detail := self._details.get(key)) is None:
            detail = self._details[key] = is_detail(key)
        return detail

    def _under_way(self, key: str, step: int) -> bool:
        """A change in the series waits to be found again, or has had an onset pending for no
        longer than adaptive resolution lasts (`dense_for` x the step it was said at): looked at
        whenever it has new points, so that its confirmation is not held back by `regrow` (a
        slow change pending longer waits for it, as the detector's cost grows with the series)."""
        return bool(self._candidates.get(key)) or any(
            p["metric"] == key and step <= self.dense_for * max(p["detected_at"], 1) for p in self.pending)

    def _judge(self, key: str, steps, found: list[dict] | None, step: int, final: bool,
               left: dict | None = None) -> list[dict]:
        """The events that this look's findings in one series call for (`found`: the detector's
        transitions, None when it did not look this time; `left`: the series' departure from
        its recent trend, if any). Only a look of the detector withdraws an onset."""
        new: list[dict] = []
        matched: set[int] = set()
        candidates = []
        for event in found or []:
            done = self._confirmed(event, steps)
            # a change already confirmed is not that of an onset that came after it ended
            pending = [p for p in self.pending if _continues(p, event) and not (done and _after(p, event, steps))]
            matched.update(id(p) for p in pending)
            if done or (not final and event["confidence"] < self._sure_enough()):
                continue
            settled = event["kind"] == "transition" and step >= self.settle * event["end"]
            if settled:  # and a level after it: `points_after` values, not departing its way
                past = [s for s in steps if s > event["end"]][:self.points_after]
                settled = len(past) == self.points_after and not _moving_on(event, left, past)
            seen = pending or any(_same(c, event) for c in self._candidates.get(key, []))
            if event["kind"] == "transition" and (final or (settled and seen)):
                self.pending = [p for p in self.pending if all(p is not q for q in pending)]
                new.append(Event.from_dict({**event, "stage": "confirmed"}).to_dict())
            elif settled or not (seen or final or event["snr"] >= self.bar(SURE)):  # said when the next look finds it again
                candidates.append(event)
            elif not final and not pending and sum(s >= event["onset"] for s in steps) >= ONSET_POINTS:
                new.append(self._onset(event, step, matched))
        if found is not None:
            self._candidates[key] = candidates
        if left is not None and not self._confirmed(left, steps, new):
            confirmed = [r for r in self.reported if r["metric"] == key and r.get("stage", "confirmed") == "confirmed"]
            pending = [p for p in self.pending if _continues(p, left) and not _apart(p, left, confirmed, steps)]
            matched.update(id(p) for p in pending)
            if not pending:  # a departure from the trend: a transition under way before the detector can fit it
                new.append(self._onset(left, step, matched))
        for p in [p for p in self.pending if p["metric"] == key]:
            if id(p) in matched and not final:
                p["seen_at"] = int(step)
            elif final or (found is not None and step >= WITHDRAW * max(p.get("seen_at", p["detected_at"]), 1)):
                # at the end nothing stays pending (what the last look confirmed has left the list)
                self.pending.remove(p)
                reason = "training ended" if final else "not found again"
                new.append(Event(p["metric"], p["direction"], p["onset"], scale=p.get("scale"), stage="withdrawn",
                                 reason=reason).to_dict())
        return new

    def _sure_enough(self) -> float:
        """`SURE_ENOUGH` at the looks this run plans (`bar_for` of its margin in standard errors)."""
        normal = NormalDist()
        return normal.cdf(self.bar(normal.inv_cdf(SURE_ENOUGH)))

    def _onset(self, event: dict, step: int, matched: set[int]) -> dict:
        """Make `event` (the detector's change under way, or a departure) a pending onset found
        at `step`; its event (the pending copy also keeps when it was last seen)."""
        onset = Event(event["metric"], event["direction"], event["onset"], snr=event["snr"],
                      confidence=event["confidence"], scale=event.get("scale"), stage="onset", detected_at=int(step))
        self.pending.append(onset.to_dict())
        matched.add(id(self.pending[-1]))
        return dict(self.pending[-1])

    def _confirmed(self, event: dict, steps, also: list[dict] = ()) -> bool:
        """Already confirmed (reported, or among `also`: this look's new events): the same metric
        and direction, overlapping spans (`SAME`) and, for a change with a magnitude, one
        midpoint within the other's span (`_refit`: a change that follows the confirmed one is
        the next change) and at most `GROWN` times it (the start of a change seen early,
        before more of it came, is not the whole change); a departure, which has none, only
        when it began no later than the first of the series' `steps` after the confirmed
        change's end (the fitted end of a jump between two logged steps can come before the
        first step that shows it; after that, the series is on the move again)."""
        return any(r.get("stage", "confirmed") == "confirmed" and _same(r, event)
                   and (event["magnitude"] <= GROWN * r["magnitude"] and _refit(r, event, steps)
                        if "magnitude" in event else not _after(event, r, steps))
                   for r in [*self.reported, *also])

    # --- resume -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a look depends on, so that a resumed run looks, reports and densifies as
        the uninterrupted one would."""
        return {"reported": self.reported, "pending": self.pending, "validations": self._validations,
                "candidates": self._candidates, "looked": self._looked, "departed": self._departed,
                "under_way": self._fits_under_way, "stages": [s.to_dict() for s in self.stages],
                "said": {str(k): v for k, v in self._said.items()},
                "begun": {str(k): s.to_dict() for k, s in self._begun.items()}, "last_look": self._last_look,
                "said_as": {str(k): s.to_dict() for k, s in self._said_as.items()},
                "rest": self._rest}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reported = list(state_dict.get("reported", []))
        self.pending = list(state_dict.get("pending", []))
        self._validations = int(state_dict.get("validations", 0))
        self._candidates = dict(state_dict.get("candidates", {}))
        self._looked = dict(state_dict.get("looked", {}))
        self._departed = dict(state_dict.get("departed", {}))
        self._fits_under_way = dict(state_dict.get("under_way", {}))
        self.stages = [Stage.from_dict(s) for s in state_dict.get("stages", [])]
        self._said = {int(k): v for k, v in state_dict.get("said", {}).items()}
        self._begun = {int(k): Stage.from_dict(s) for k, s in state_dict.get("begun", {}).items()}
        self._said_as = {int(k): Stage.from_dict(s) for k, s in state_dict.get("said_as", {}).items()}
        self._last_look = state_dict.get("last_look")  # a look at the resumed step that was made is not made again
        self._rest = state_dict.get("rest")  # none in older checkpoints: the next look is made whole


def evident(stage: Stage, series: dict) -> bool:
    """Whether a stage has the evidence to be said live: it matches a declared signature (it has
    a name), or two or more series moved in it and one of them is a headline series whose
    change is worth saying (`worth_saying`: levels shown). A lone series' change, or small
    changes alone, are often a piece of a change the finished series shows elsewhere, or a
    wiggle (docs/stages.md, "When a stage is said")."""
    return stage.name is not None or (len({m["series"] for m in stage.members}) >= 2
                                      and bool(stage_levels(stage, series)))


def _outline(stages: list[Stage]) -> list[tuple]:
    """What of the stages the next look's would depend on (ids, spans, names, what moved), to
    tell whether a look left them as they were (`look`'s shortcut)."""
    return [(s.id, s.onset, s.midpoint, s.end, s.name, len(s.members), frozenset(s.moved)) for s in stages]


def _points(series: dict) -> int:
    """The number of points logged in all series (which only grow during a fit: the same number,
    the same series)."""
    return sum(len(steps) for steps, _ in series.values())


def _levels(event: dict, series: dict) -> tuple[float, float]:
    """The series' values at a transition's onset and end (interpolated between logged points)."""
    steps, values = (np.asarray(x, dtype=float) for x in series[event["metric"]])
    ok = np.isfinite(values)
    before, after = np.interp([event["onset"], event["end"]], steps[ok], values[ok])
    return float(before), float(after)


def _line(trainer: pl.Trainer, event: dict, series: dict) -> str:
    """The console line of an event (`series`: the series so far, for a transition's levels)."""
    at, metric, direction = event["detected_at"], event["metric"], event["direction"]
    at = f"{trainer.member} step {at}" if getattr(trainer, "member", None) else f"step {at}"  # a population's
    if event["stage"] == "onset":
        return f"phasewatch: {at}: transition under way in {metric} ({direction}) since step {event['onset']}"
    if event["stage"] == "withdrawn" and event["reason"] == "training ended":
        return (f"phasewatch: {at}: withdrawn: training ended before the change in {metric} ({direction}) "
                f"from step {event['onset']} was confirmed as a transition")
    if event["stage"] == "withdrawn":
        return (f"phasewatch: {at}: withdrawn: the change in {metric} ({direction}) from step "
                f"{event['onset']} was not a transition")
    before, after = _levels(event, series)
    return (f"phasewatch: {at}: transition in {metric} ({direction}) from step {event['onset']} to {event['end']}, "
            f"midpoint {event['midpoint']}: {before:.3g} -> {after:.3g}{' (log scale)' if event.get('scale') == LOG else ''}")


def worth_saying(event: dict, series: dict) -> bool:
    """Whether a confirmed change of a headline key moved its series by at least
    `SHOWN_FRACTION` of its largest absolute value (on a linear scale) or by a factor of
    `SHOWN_FACTOR` (on a log scale) between its onset and end: its levels go in the stage's line."""
    if event.get("stage", "confirmed") != "confirmed" or event["metric"] not in headline_keys():
        return False
    before, after = _levels(event, series)
    if event.get("scale") == LOG:
        return max(before, after) >= SHOWN_FACTOR * min(before, after)
    return abs(after - before) >= SHOWN_FRACTION * float(np.nanmax(np.abs(series[event["metric"]][1])))


def stage_levels(stage: Stage, series: dict) -> list[str]:
    """The levels of the stage's headline series that moved in it by more than a trifle
    (`worth_saying`): each series' values at its first member's onset and its last member's end
    in the stage ("grok/restricted_loss 0.496 -> 0.0009 (log scale)")."""
    out = []
    for key in dict.fromkeys(m["series"] for m in stage.members):
        if key not in series:
            continue
        members = [m for m in stage.members if m["series"] == key]
        span = {"metric": key, "onset": min(m["onset"] for m in members), "end": max(m["end"] for m in members),
                "scale": members[0].get("scale")}
        if worth_saying(span, series):
            before, after = _levels(span, series)
            out.append(f"{key} {before:.3g} -> {after:.3g}{' (log scale)' if span['scale'] == LOG else ''}")
    return out


def _stage_line(trainer: pl.Trainer, step: int, what: str, stage: Stage, series: dict | None = None,
                begun_as: str | None = None) -> str:
    """The console line of a stage's news (`TransitionWatcher.stage_news`). "begins" claims the
    lead (the series that moved first so far) and a name only where the members so far already
    match its signature ("so far": more members may come); not the other members, which the
    confirmation lists, with the levels of its headline series (`stage_levels`, given `series`),
    and, where its "begins" line named it otherwise (`begun_as`, `TransitionWatcher.begun_as`),
    that name, so that the claim is corrected where it was made ("confirmed stage 4 cleanup
    (said to begin as circuit formation so far): ...")."""
    at = f"{trainer.member} step {step}" if getattr(trainer, "member", None) else f"step {step}"
    if what == "begins":
        name = f" ({stage.name} so far)" if stage.name else ""
        return f"phasewatch: {at}: stage {stage.id}{name} begins at step {stage.onset}, led by {stage.lead}"
    if what == "withdrawn":
        return f"phasewatch: {at}: stage {stage.id} was said to begin but training ended before it was confirmed"
    levels = stage_levels(stage, series) if series is not None else []
    summary = stage.summary()
    if begun_as:
        head = f"stage {stage.id} {stage.name or '(unnamed)'}"
        summary = f"{head} (said to begin as {begun_as} so far){summary[len(head):]}"
    return f"phasewatch: {at}: confirmed {summary}" + (f"; {', '.join(levels)}" if levels else "")


def dense_now(trainer: pl.Trainer) -> bool:
    """Whether the run's transition watcher asks for dense checkpoints now."""
    return bool(dense_metrics(trainer))


def dense_metrics(trainer: pl.Trainer) -> set[str]:
    """The series whose transitions under way ask for dense probes now (`dense_probes`)."""
    return set().union(*(cb.dense_metrics(trainer.global_step) for cb in trainer.callbacks
                         if isinstance(cb, TransitionWatcher)))


def dense_probes(metrics: set[str], keys: dict[str, set[str]], cheap: set[str] = frozenset()) -> set[str]:
    """The probes to run densely for transitions under way in `metrics`, given the keys each
    probe logs (`keys`: name -> keys): a probe that logs one of them, and the `cheap` ones
    (cheap enough to run at every validation); every probe for a series that no probe logs
    (the loss, the accuracy, any other series of the training loop: the model as a whole is
    changing)."""
    if not metrics:
        return set()
    if any(all(m not in logged for logged in keys.values()) for m in metrics):
        return set(keys)
    return {name for name, logged in keys.items() if name in cheap or not metrics.isdisjoint(logged)}

"""Run probes during training and hand their values to every logger (a thin adapter: the
measurements live in `phasewatch.probes`). Probes run on their schedule (log-spaced by
default) at the start of a step, cheap ones also at every validation, and more densely while
the transition watcher has an onset pending (adaptive resolution; `budget` bounds its cost).
Scalars go to every logger, arrays to the run folder; tracked sets (key frequencies, heads,
head pairs) are followed over time and their changes printed; all of it survives a resume.
A population's members get the probes that have a form over stacked weights (probes/stacked.py)
measured for all of them at once (`StackedProbes`). When exactly probes run: docs/phases.md
("When probes run")."""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import torch

from phasewatch.loggers.run_folder import run_folder
from phasewatch.callbacks.schedule import Schedule
from phasewatch.callbacks.transitions import dense_metrics, dense_probes
from phasewatch.errors import require
from phasewatch.models import eval_mode, native_module, restore_modes
from phasewatch.probes import check_options, default_probes, get_probe
from phasewatch.callbacks.console import say
from phasewatch.probes.keys import is_announced, is_tracked, tracked_name
from phasewatch.probes.stacked import STACKED
from phasewatch.rundir import RunFolder, is_number


class ProbeRunner(pl.Callback):
    """Args:
    names: probes to run on the schedule (default: every probe that applies to the task);
        a registered name, or a plug-in's dotted `package.module:name` (phasewatch/plugins.py).
    schedule: when (default: 60 log-spaced steps, step 0 and the last step included).
    every_validation: run the cheap ones among `names` at every validation (and at step
        0) instead of on the schedule.
    options: keyword arguments per probe, e.g. {"heads": {"thresholds": {"induction": 0.5}},
        "composition": {"factor": 3}}.
    schedules: a schedule of its own for some probes, e.g. {"llc": {"kind": "log", "count": 20}}
        for a costly one (a probe that names a default schedule of its own, like llc's 24
        log-spaced steps, keeps it unless given one here).
    budget: the most time that the extra runs of adaptive resolution may bring the probes to,
        as a share of the run's other wall time so far (training, validation, logging,
        checkpoints), e.g. 0.1; null (the default): no bound. Runs on the schedule and at
        validations always happen. With a budget, which extra steps get probes depends on the
        machine's speed: a repeated or resumed run can probe other extra steps (the values
        at a step do not change), so the default leaves it off.
    """

    def __init__(self, names: list[str] | None = None, schedule: Schedule = Schedule(kind="log", count=60),
                 every_validation: bool = True, options: dict[str, dict] | None = None,
                 schedules: dict[str, Schedule] | None = None, budget: float | None = None, verbose: bool = False):
        self.names, self.schedule, self.every_validation = names, schedule.validate("probes.schedule"), every_validation
        if budget is not None:
            require(is_number(budget) and budget >= 0, "probes.budget", f"{budget!r} is not a share of training time",
                    "Give a number >= 0, e.g. 0.1 for 10%, or null for no bound.")
        self.budget, self.verbose = budget, bool(verbose)
        self.clock = ProbeClock()
        for name in names or []:
            get_probe(name)  # imports plug-ins named by a dotted name, whose options are checked next
        self.options = check_options(options or {}, "probes.options")
        self.schedules = {k: v.validate(f"probes.schedules.{k}") for k, v in (schedules or {}).items()}
        # when each tracked set changed: key -> [(step, labels)]
        self.history: dict[str, list[tuple[int, list[str]]]] = {}
        self._steps: set[int] = set()
        self._probes: list = []
        self._own_steps: dict[str, set[int]] = {}
        self._due_steps: set[int] = set()
        self._keys: dict[str, set[str]] = {}  # probe -> the scalar keys it has logged (which series are whose)
        self._validated_at: int | None = None
        self._held_out: HeldOutLogits | None = None  # validation's logits, while it runs
        self._initial = None  # a frozen copy of the model at step 0, for `initial` probes
        self._initial_state: dict | None = None  # its weights, restored from a checkpoint
        #: (probe name, options, step, hook) -> this run's values of a probe measured over stacked
        #: weights (`StackedProbes`), None for a probe without that form: set by a population
        #: for its members, and at setup for a run alone with `model.vectorised`
        self.stacked: MemberProbes | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        task = pl_module.task
        names = default_probes(task) if self.names is None else self.names
        self._probes = [get_probe(n, task) for n in names]
        for name in self.schedules:
            get_probe(name, task)
        own = {p.name: Schedule(**p.schedule) for p in self._probes if p.schedule} | self.schedules
        if self.stacked is None and (getattr(pl_module, "hparams", None) or {}).get("vectorised"):
            # a population's member re-run alone measures as the population does (one of one)
            self.stacked = StackedProbes.of_one(pl_module.model, task).values_of(0)
        if self.stacked is not None:  # the population asks who else will want a probe now
            self.stacked.plan(lambda at, name, trainer=trainer: name in self._will_run(trainer, at))
        self._steps = set(self.schedule.resolve(trainer.max_steps))
        self._own_steps = {name: set(s.resolve(trainer.max_steps)) for name, s in own.items()}
        # the steps where `_scheduled` has a probe without the dense grid (`due_at`)
        self._due_steps = set().union(*(self._own_steps[p.name] if p.name in self._own_steps
                                        else {0} if p.cheap and self.every_validation else self._steps
                                        for p in self._probes))

    # --- when ---------------------------------------------------------------------

    def _scheduled(self, trainer: pl.Trainer, count: bool = True) -> list:
        """The probes due at this step: those on their own schedule when it has the step,
        the others when the shared schedule has it. Cheap probes that run at every
        validation join only at step 0, the initial-weights baseline. Adaptive resolution
        adds the cheap ones and those whose series are in transition (all of them for a series
        that no probe logs) at the steps of its dense grid, as long as the budget allows
        (`count`: the clock counts the extra runs; False: only asked, nothing runs)."""
        step = trainer.global_step
        wanted = dense_probes(dense_metrics(trainer), {p.name: self._keys.get(p.name, set()) for p in self._probes},
                              {p.name for p in self._probes if p.cheap})
        due = []
        for p in self._probes:
            dense = p.name in wanted
            if p.name in self._own_steps:
                if step in self._own_steps[p.name]:
                    due.append(p)
            elif p.cheap and self.every_validation:
                if self._validated_at != step and (step == 0 or (dense and self.clock.allows(p.name, self.budget, count))):
                    due.append(p)
            elif step in self._steps or (dense and self.clock.allows(p.name, self.budget, count)):
                due.append(p)
        return due

    def _will_run(self, trainer: pl.Trainer, at: str) -> set[str]:
        """The names of the probes this run is about to run at the hook now running (`at`:
        "validation" for a validation's end, else a step's start or the training's end), its
        clock left as it is: what a population's other members ask `StackedProbes`, so that a
        probe is measured for the members that will want it, not for every member acting."""
        probes = self._at_validation() if at == "validation" else self._scheduled(trainer, count=False)
        return {p.name for p in probes}

    def due_at(self, step: int, dense: bool = False) -> bool:
        """Whether probes may run at the start of `step` (`on_train_batch_start`): a probe's
        schedule (its own, else the shared one; step 0 for the cheap ones of `every_validation`)
        has the step, or `dense` (the run's transition watcher has the step on its dense grid
        with an onset pending). False: nothing runs there, so a population may leave this
        callback out of the step (training/population.py)."""
        return bool(self._probes) and (dense or step in self._due_steps)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._run(trainer, pl_module, self._scheduled(trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run(trainer, pl_module, self._scheduled(trainer))  # the last step has no next batch
        if self.clock.extra or self.clock.refused:
            member = getattr(trainer, "member", None)
            left = (f", left out {sum(self.clock.refused.values())} "
                    f"({', '.join(f'{k} {v}' for k, v in sorted(self.clock.refused.items()))}) to stay within "
                    f"{self.budget:.0%} of training time (--probes.budget)") if self.clock.refused else ""
            print(f"phasewatch: {member + ': ' if member else ''}probes took {self.clock.share():.1%} of the run's "
                  f"other time; adaptive resolution added {self.clock.extra} probe runs{left}")

    def _at_validation(self) -> list:
        """The probes that run at every validation's end."""
        return [p for p in self._probes if p.cheap and p.name not in self._own_steps] if self.every_validation else []

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a probe that reads the held-out set's logits at the end gets validation's (one pass, not two)
        if self._held_out is not None:  # a validation that did not end
            self._held_out.close()
        if trainer.state.fn == "fit" and not trainer.sanity_checking and any(p.held_out for p in self._at_validation()):
            self._held_out = HeldOutLogits(pl_module.model)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        held_out, self._held_out = self._held_out, None
        logits = None if held_out is None else held_out.logits(pl_module.task, _param_dtype(pl_module.model))
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        self._validated_at = trainer.global_step
        self._run(trainer, pl_module, self._at_validation(), logits, at="validation")

    # --- what ---------------------------------------------------------------------

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, probes: list,
             held_out: list[torch.Tensor] | None = None, at: str = "step") -> None:
        if not probes:
            return
        step = trainer.global_step
        given = None if self.stacked is None else (lambda name, options: self.stacked(name, options, step, at))
        results = measure(pl_module.model, pl_module.task, probes, self.options, self._initial_model(pl_module, step),
                          self.clock, given, held_out)
        scalars = record_results(results, run_folder(trainer), step)
        for name, values in results.items():
            self._keys.setdefault(name, set()).update(k for k in values if k in scalars)
            for key, value in values.items():
                if not is_number(value) and is_tracked(key):  # (a tracked set is labels, never a number)
                    self._track(step, key, [str(v) for v in value], getattr(trainer, "member", None), trainer)
        if scalars:
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)

    def _track(self, step: int, key: str, labels: list[str], member: str | None = None,
               trainer: pl.Trainer | None = None) -> None:
        history = self.history.setdefault(key, [])
        previous = history[-1][1] if history else None
        if previous is None or sorted(previous) != sorted(labels):
            history.append((step, labels))
            if previous is not None and (self.verbose or is_announced(key)):  # a population's member is named
                at = f"member {member}, step {step}" if member else f"step {step}"
                say(trainer, f"phasewatch: {at}: {tracked_name(key)} {_show(previous)} -> {_show(labels)}")

    def _initial_model(self, pl_module: pl.LightningModule, step: int):
        """The model at step 0 when a probe wants it: copied at step 0, rebuilt from the
        checkpoint's copy after a resume; None when neither is there (a run resumed from a
        checkpoint of an older phasewatch), and the baseline is then left out."""
        if self._initial is None and any(p.initial for p in self._probes):
            if self._initial_state is not None:
                self._initial = frozen_copy(pl_module.model)
                self._initial.load_state_dict(self._initial_state)
            elif step == 0:
                self._initial = frozen_copy(pl_module.model)
        return self._initial

    # --- resume -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"history": {k: [[s, list(v)] for s, v in h] for k, h in self.history.items()},
                                 "keys": {k: sorted(v) for k, v in self._keys.items()}}
        if self._initial is not None:
            state["initial"] = {k: v.detach().cpu() for k, v in self._initial.state_dict().items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: [(int(s), list(v)) for s, v in h] for k, h in state_dict.get("history", {}).items()}
        self._initial_state = state_dict.get("initial")
        self._keys = {k: set(v) for k, v in state_dict.get("keys", {}).items()}


def frozen_copy(model):
    """A copy of `model` in eval mode without gradients."""
    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


def measure(model, task, probes: list, options: dict[str, dict], initial=None,
            clock: "ProbeClock | None" = None,
            given: Callable[[str, dict], dict | None] | None = None,
            held_out: list[torch.Tensor] | None = None) -> dict[str, dict[str, Any]]:
    """Each probe's values on the model (in eval mode, without gradients; its mode is
    restored afterwards). Probes that want the run's step-0 model get `initial`. Each
    probe's time goes to `clock` when given. `given(name, options)`: a probe's values
    measured otherwise (over a population's stacked weights), None to run the probe.
    `held_out`: the model's logits on the task's held-out batches, for `held_out` probes."""
    modes: list[tuple[torch.nn.Module, bool]] = []  # each module's mode before the probes
    out = {}
    try:
        with torch.no_grad():
            for p in probes:
                started = time.perf_counter()
                own = options.get(p.name, {})
                values = None if given is None else given(p.name, own)
                if values is None:
                    if not modes:  # (switched only for a probe that runs on the model)
                        modes = eval_mode(model)
                    extra = {"initial": initial} if p.initial else {}
                    if held_out is not None and getattr(p, "held_out", False):
                        extra["held_out_logits"] = held_out
                    values = p(model, task, **own, **extra)
                out[p.name] = values
                if clock is not None:
                    clock.record(p.name, time.perf_counter() - started)
        return out
    finally:
        restore_modes(modes)


def _param_dtype(model) -> torch.dtype | None:
    """The dtype of the model's first parameter (None without parameters)."""
    return next((p.dtype for p in model.parameters()), None)


class HeldOutLogits:
    """The logits of one validation's passes (a forward hook on the model's native module,
    which `TrainModule.validation_step` runs on each held-out batch), for the `held_out` probes
    that run at its end: the same numbers as their own pass, which they then skip."""

    def __init__(self, model):
        self.seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        self._handle = native_module(model).register_forward_hook(
            lambda module, args, output: self.seen.append((args[0] if args else None, output)))

    def logits(self, task, dtype: torch.dtype | None = None) -> list[torch.Tensor] | None:
        """The logits of each of `task.val_batches()`, in order; None unless the passes were
        exactly those batches (e.g. a population's validation, which runs otherwise) and, with
        `dtype` (the model's), computed in it (not under a mixed-precision autocast, which the
        probe's own pass would not share). Stops keeping them."""
        self.close()
        batches, seen, self.seen = task.val_batches(), self.seen, []
        same = len(seen) == len(batches) and all(
            tokens is not None and tokens.shape == batch.tokens.shape and torch.equal(tokens.cpu(), batch.tokens)
            and (dtype is None or logits.dtype == dtype)
            for (tokens, logits), batch in zip(seen, batches))
        return [logits for _, logits in seen] if same else None

    def close(self) -> None:
        self._handle.remove()


class StackedProbes:
    """The probes of a population's members that have a form over stacked weights
    (`probes.stacked.STACKED`): the first member to ask for one at a step gets it measured
    for every member expected to ask (`expect`, by default all) whose turn at the hook now
    running is not over (`done`) and that will run it there (its runner's plan,
    `MemberProbes.plan`; a member without one counts as wanting it) in one pass; the others are handed their values as they ask. Probes without
    that form (or whose form refuses the model): None (run member by member)."""

    def __init__(self, template: torch.nn.Module, params: Callable[[], dict[str, torch.Tensor]], models: list, task):
        self.template, self.params, self.models, self.task = template, params, models, task
        self.expected: list[int] = list(range(len(models)))
        self._done: set[int] = set()  # the expected members whose turn at the hook is over
        self._step: int | None = None
        self._values: dict[tuple[str, str], dict[int, dict]] = {}  # (probe, options) -> member -> values
        #: member -> whether it will run probe `name` at the hook now running (`at`)
        self._plans: dict[int, Callable[[str, str], bool]] = {}

    @classmethod
    def of_one(cls, model, task) -> "StackedProbes":
        """A run alone as a population of one (its parameters with a member dimension of 1)."""
        module = native_module(model)
        return cls(module, lambda: {name: p.unsqueeze(0) for name, p in module.named_parameters()}, [model], task)

    def expect(self, members: list[int]) -> None:
        """The members whose probes may run next (a population's hook): measured together."""
        self.expected, self._done = members, set()

    def done(self, member: int) -> None:
        """Member `member`'s callbacks have run at the hook now running: it asks nothing more
        there, whatever its plan now says."""
        self._done.add(member)

    def values_of(self, member: int) -> "MemberProbes":
        """Member `member`'s `ProbeRunner.stacked`."""
        return MemberProbes(self, member)

    def values(self, member: int, name: str, options: dict, step: int, at: str = "step") -> dict | None:
        """Member `member`'s values of probe `name` at `step` (the weights of that step),
        asked at the hook `at` (`ProbeRunner._will_run`)."""
        fn = STACKED.get(name)
        if fn is None:
            return None
        if step != self._step:
            self._step, self._values = step, {}
        got = self._values.setdefault((name, repr(sorted(options.items()))), {})
        if member not in got:
            # not the members whose turn at this hook is over (`done`): a watcher's look in it may
            # since have made the step dense for one, which it will not act on before the next hook
            todo = sorted({member} | {k for k in self.expected
                                      if k not in got and k not in self._done and self._wants(k, at, name)})
            params = self.params()
            if len(todo) < len(self.models):
                params = {key: p[todo] for key, p in params.items()}
            values = fn(self.template, params, [self.models[k] for k in todo], self.task, **options)
            if values is None:  # no stacked form for this model
                return None
            got.update(zip(todo, values))
        return got[member]

    def _wants(self, member: int, at: str, name: str) -> bool:
        plan = self._plans.get(member)
        return plan is None or plan(at, name)


class MemberProbes:
    """One member's view of a population's `StackedProbes` (`ProbeRunner.stacked`): its values
    of a probe at a step, `(name, options, step[, at])` -> values or None; `plan(fn)` tells
    the population which probes the member will run at the hook now running (`fn(at, name)`)."""

    def __init__(self, probes: StackedProbes, member: int):
        self.probes, self.member = probes, member

    def __call__(self, name: str, options: dict, step: int, at: str = "step") -> dict | None:
        return self.probes.values(self.member, name, options, step, at)

    def plan(self, fn: Callable[[str, str], bool]) -> None:
        self.probes._plans[self.member] = fn


class ProbeClock:
    """What the probes cost in this process, as the run goes: the wall time of each probe's
    runs, apart from the run's other time (training, validation, logging, checkpoints).
    A probe's first run is setup (a compiled reference, caches, the initial-weights
    baseline) and counted in neither. The clocks of one process share their probe time
    (a population's members: their probes run one after another in one training loop)."""

    _probe_seconds = 0.0  # every clock of the process: probe runs after the first
    _setup_seconds = 0.0  # and first runs

    def __init__(self):
        self.cost: dict[str, float] = {}  # each probe's last run after the first (seconds)
        self.refused: dict[str, int] = {}  # extra runs left out for the budget
        self.extra = 0  # extra runs allowed
        self._seen: set[str] = set()
        self._started: tuple[float, float, float] | None = None

    def start(self) -> None:
        self._started = (time.perf_counter(), ProbeClock._probe_seconds, ProbeClock._setup_seconds)

    def record(self, name: str, seconds: float) -> None:
        if name in self._seen:
            ProbeClock._probe_seconds += seconds
            self.cost[name] = seconds
        else:
            self._seen.add(name)
            ProbeClock._setup_seconds += seconds

    def spent(self) -> tuple[float, float]:
        """(probe seconds, other seconds) since `start`."""
        if self._started is None:
            return 0.0, 0.0
        t0, probe0, setup0 = self._started
        probe, setup = ProbeClock._probe_seconds - probe0, ProbeClock._setup_seconds - setup0
        return probe, max(0.0, time.perf_counter() - t0 - probe - setup)

    def share(self) -> float:
        probe, other = self.spent()
        return probe / other if other > 0 else 0.0

    def allows(self, name: str, budget: float | None, count: bool = True) -> bool:
        """Whether an extra run of probe `name` keeps the probes within `budget` of the
        other time so far (always when there is no budget, or nothing is known of its cost
        yet); counts the runs it allows and refuses (with `count`)."""
        if budget is not None and name in self.cost and self._started is not None:
            probe, other = self.spent()
            if probe + self.cost[name] > budget * other:
                if count:
                    self.refused[name] = self.refused.get(name, 0) + 1
                return False
        if count:
            self.extra += 1
        return True


def record_results(results: dict[str, dict[str, Any]], folder: RunFolder, step: int) -> dict[str, float]:
    """Save the array values in the run folder at `step`; return the scalars."""
    scalars: dict[str, float] = {}
    for probe, values in results.items():
        for key, value in values.items():
            if is_number(value):  # logged as a metric; anything else is saved as an array
                scalars[key] = float(value)
            else:
                array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
                folder.save_array(probe, key, step, array)
    return scalars


def _show(labels: list[str]) -> str:
    return "{" + ", ".join(sorted(labels, key=lambda x: (len(x), x))) + "}"

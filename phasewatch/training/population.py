"""Population training: N members of one architecture trained in one process, one step for all.

`phasewatch fit --population.seeds 0-15` (a count, a range or a list) trains one member per
seed. Member k is the run `phasewatch fit` makes alone with `seed_everything: k` and, when
`population.vary_data` (default: the task samples its batches), `data.task.seed: k`; its
config.yaml (`member_config`) re-runs it alone, bit for bit on the CPU (`model.vectorised`).
The members' parameters are stacked (`PopulationModule.stacked`); one vmapped forward and
backward pass and one AdamW update them all, equal to N independent optimizers. Each member
keeps an ordinary run folder (`runs/<name>/m00`, ...) written by its own callbacks and
loggers (`MemberCallbacks`, through a `MemberTrainer`); the population's folder holds its
config and checkpoints/last.ckpt (every member's state, written at `checkpoints.last_every`
and at the end), from which `--run_dir runs/<name> --ckpt_path last` resumes every member.
Refused: clipping by global norm, interventions, `on_nonfinite: skip`; a non-finite loss in
any member stops the population. How and why: docs/populations.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import re
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
import yaml
from torch.utils.data import DataLoader, IterableDataset

from phasewatch.callbacks.checkpoints import save_at_stop, shared_views, stops_after_step
from phasewatch.callbacks.probes import ProbeRunner, StackedProbes
from phasewatch.callbacks.transitions import TransitionWatcher
from phasewatch.models import native_module
from phasewatch.models.factory import one_build
from phasewatch.models.plain import plain_twin, stacked_logits
from phasewatch.rundir import RunFolder, member_name
from phasewatch.tasks.base import Batch
from phasewatch.errors import ConfigError
from phasewatch.training.module import (TaskDataModule, TrainModule, adamw_with_warmup, answer_outputs, emit,
                                        padded, vectorised_outputs)


def parse_seeds(spec: object) -> list[int]:
    """The seeds of `--population.seeds`: a count (`16`: seeds 0-15), a range (`0-15`), a
    list (`1,4,9` or a YAML list), or ranges and seeds mixed (`0-3,8`). ConfigError for
    anything else, for a negative seed, and for a seed given twice."""
    fix = "Use a count (16), a range (0-15) or a list (1,4,9)."
    if isinstance(spec, bool):
        raise ConfigError("population.seeds", f"not seeds: {spec!r}", fix)
    if isinstance(spec, int):
        if spec < 1:
            raise ConfigError("population.seeds", f"a population needs at least one member, got {spec}", fix)
        return list(range(spec))
    if isinstance(spec, (list, tuple)):
        parts = [str(s) for s in spec]
    elif isinstance(spec, str) and spec.strip():
        text = spec.strip()
        if re.fullmatch(r"\d+", text):
            return parse_seeds(int(text))
        parts = text.split(",")
    else:
        raise ConfigError("population.seeds", f"not seeds: {spec!r}", fix)
    seeds: list[int] = []
    for part in parts:
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ConfigError("population.seeds", f"not a seed or a range of seeds: {part.strip()!r}", fix)
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise ConfigError("population.seeds", f"the range {part.strip()} runs backwards", f"Write {last}-{first}.")
        seeds += range(first, last + 1)
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError("population.seeds", f"seed {twice[0]} is given twice", "Give every seed once.")
    return seeds


def member_config(config: dict[str, Any], seed: int, vary_data: bool, run_dir: Path) -> dict[str, Any]:
    """The config that re-runs one member alone: the population's, with the member's seed (and
    data seed when `vary_data`), its own run folder, no population, and `model.vectorised`
    (the member's step as a population of one, so that the re-run repeats its arithmetic)."""
    out = copy.deepcopy(config)
    out["seed_everything"] = seed
    if vary_data:
        out["data"]["task"].setdefault("init_args", {})["seed"] = seed
    out["run_dir"] = str(run_dir)
    out.setdefault("checkpoints", {})["dirpath"] = str(RunFolder(run_dir).checkpoints)
    # re-run alone through the population's own arithmetic (TrainModule's `vectorised`)
    out.setdefault("model", {})["vectorised"] = "own" if vary_data else "shared"
    out.pop("population", None)
    out.pop("ckpt_path", None)
    return out


@dataclasses.dataclass
class Members:
    """What `build_members` makes of a population's config: per member, its TrainModule, its
    data, its callbacks (probes, transitions, checkpoints, report), loggers and run folder."""

    modules: list[TrainModule] = dataclasses.field(default_factory=list)
    data: list[TaskDataModule] = dataclasses.field(default_factory=list)
    callbacks: list[list[pl.Callback]] = dataclasses.field(default_factory=list)
    loggers: list[list] = dataclasses.field(default_factory=list)
    roots: list[str] = dataclasses.field(default_factory=list)


#: the fields in which members' configs differ (`member_config`), as paths in a parsed config
MEMBER_FIELDS = ("seed_everything", "data.task.init_args.seed", "run_dir", "checkpoints.dirpath")


def member_namespaces(parser, configs: list[dict[str, Any]]) -> list[Any]:
    """Each member's config parsed: the first by `parser`, the others as copies of it with their
    own `MEMBER_FIELDS` (the only fields in which members' configs differ), which is what
    parsing each gives (tested) at one parse for the population instead of one per member."""
    first = parser.parse_object(configs[0])
    out = [first]
    for config in configs[1:]:
        ns = first.clone()
        for path in MEMBER_FIELDS:
            value = _lookup(config, path)
            if value is not _MISSING:
                ns[path] = value
        out.append(ns)
    return out


_MISSING = object()


def _lookup(config: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(config, dict) or part not in config:
            return _MISSING
        config = config[part]
    return config


#: libyaml's writer where installed: the same text as yaml.safe_dump, 4x faster (a member's config)
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def build_members(parser, config: dict[str, Any], seeds: list[int], vary_data: bool, root: Path,
                  make_loggers) -> Members:
    """Every member of a population of `seeds`, built by `parser` (fit's) from its own config
    (`member_config`, written to its folder's config.yaml) after `seed_everything(seed)`, as
    LightningCLI builds a run alone. `make_loggers(folder, label, own_config)` gives a
    member's loggers."""
    from lightning.pytorch import seed_everything

    folders = [RunFolder(root / member_name(k)) for k in range(len(seeds))]
    configs = [member_config(config, seed, vary_data, folder.root) for seed, folder in zip(seeds, folders)]
    out = Members()
    # one_build: the members' bridges constructed once, each member's own weights drawn (build_model)
    with one_build(), out_of_the_collectors_way():
        for seed, folder, own, ns in zip(seeds, folders, configs, member_namespaces(parser, configs)):
            folder.create()
            if not folder.config.exists():
                folder.write_atomic(folder.config, yaml.dump(own, Dumper=DUMPER, sort_keys=False))
            seed_everything(seed, workers=True, verbose=False)  # as LightningCLI seeds a run alone
            init = parser.instantiate_classes(ns)
            out.modules.append(init.get("model"))
            out.data.append(init.get("data"))
            out.callbacks.append([init.get(key) for key in ("probes", "transitions", "checkpoints", "report")])
            out.loggers.append(make_loggers(folder, f"{root.name}-{folder.root.name}", own))
            out.roots.append(str(folder.root))
    return out


#: whether `out_of_the_collectors_way` froze the process's objects (`gc.freeze`), for `thaw`
_FROZEN = False


@contextlib.contextmanager
def out_of_the_collectors_way() -> Iterator[None]:
    """While a population's members are built, no cyclic garbage collection, and once they are
    built every object of the process moved out of the collector's full collections
    (`gc.freeze`) until the fit ends (`thaw`, from `MemberCallbacks.teardown` or `on_exception`).
    The members' objects (~3,000 a proxy member's bridge) trigger a full collection over the
    whole heap, 0.3-0.4 CPU s at 64 proxy members, in the set-up (bench/README.md, population,
    session 22); the build's own cyclic garbage (~270 objects a proxy member) then waits for
    the fit's end. The collector changes no value. A process whose collector is off, or that
    froze objects itself, is left as it is; a build that fails freezes nothing."""
    global _FROZEN
    if not gc.isenabled() or gc.get_freeze_count() or _FROZEN:
        yield
        return
    gc.disable()
    try:
        yield
        gc.freeze()
        _FROZEN = True
    finally:
        gc.enable()


def thaw() -> None:
    """The objects `out_of_the_collectors_way` froze, back in the collector's reach."""
    global _FROZEN
    if _FROZEN:
        _FROZEN = False
        gc.unfreeze()


#: a validation pass's residual stream on the CPU (floats, over its members): a RASP task's
#: held-out inputs (reverse: 3,125 of length 6 a member) stacked for 16 or 64 members fall out of
#: the CPU's caches and the pass slows up to 2x; 2 members a pass of the real reverse, 11 of the
#: proxy, every member of a small held-out set (bench/README.md, population, session 17)
PASS_FLOATS = 2**21


def _key(name: str) -> str:
    return name.replace(".", "__")  # parameter names may not hold dots


class PopulationModule(pl.LightningModule):
    """Trains `members` (TrainModules of one architecture and one set of hyperparameters) as
    one stack of parameters: see the module's docstring. The members keep their own models,
    whose parameters are views into the stack, for their probes and checkpoints."""

    def __init__(self, members: list[TrainModule], vary_data: bool):
        super().__init__()
        first = members[0]
        for k, member in enumerate(members[1:], 1):
            if member.arch != first.arch:
                raise ConfigError("population", f"member {k} has another architecture than member 0",
                                  "Build every member from the same config (only the seeds differ).")
        self.members, self.vary_data = members, vary_data
        self.task, self.loss_dtype = first.task, first.loss_dtype
        self.hparams_of_members = dict(first.hparams)
        # the stacked probes read member 0's module (a copy: hooks), the step runs through its
        # plain twin (no bridge: fewer host calls a pass), as a member re-run alone does
        self._template = copy.deepcopy(native_module(first.model))
        self._plain, self._plain_names = plain_twin(first.model)
        self._width = first.model.cfg.d_model  # (`members_per_pass`)
        names = [name for name, _ in self._template.named_parameters()]
        per_member = [dict(native_module(m.model).named_parameters()) for m in members]
        self.stacked = torch.nn.ParameterDict({
            _key(name): torch.nn.Parameter(torch.stack([p[name].detach() for p in per_member]),
                                           requires_grad=per_member[0][name].requires_grad)
            for name in names})
        self._names = names
        # the optimizer's order of parameters is a member's (TrainModule.configure_optimizers),
        # so that a member's checkpoint holds its slice of the optimizer state in its own order
        by_id = {id(p): name for name, p in per_member[0].items()}
        self._order = [by_id[id(p)] for p in first.model.parameters() if p.requires_grad]
        self._pending: dict[str, torch.Tensor] | None = None
        self.hook_state: dict[str, Any] | None = None  # what members' checkpoints share within a hook (`_once`)
        self.member_loggers: list[list] = [[] for _ in members]
        self._link()

    # --- the members' views ------------------------------------------------------------

    def _link(self) -> None:
        """Point every member's parameters at its slice of the stack (after a move to a device):
        each member moved only when it is elsewhere, its parameters walked once (`_views`)."""
        def views(member: TrainModule) -> list[tuple[torch.nn.Parameter, str]]:
            return [(param, _key(name)) for name, param in native_module(member.model).named_parameters()]

        if not hasattr(self, "_views"):
            self._views = [views(member) for member in self.members]
        for k, member in enumerate(self.members):
            if member.device != self.device:  # a move may put new Parameters in the module: walked again
                member.to(self.device)
                self._views[k] = views(member)
            for param, key in self._views[k]:
                param.data = self.stacked[key].data[k]

    def on_fit_start(self) -> None:
        self._link()

    def on_train_start(self) -> None:
        self._link()

    # --- the step ----------------------------------------------------------------------

    def stacked_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the members stacked (member first), named as the template's."""
        return {name: self.stacked[_key(name)] for name in self._names}

    def _member_outputs(self, batch: Batch | list[Batch], counts: bool = True,
                        in_passes: bool = False) -> dict[str, torch.Tensor]:
        """Per member (a leading member dimension): the mean loss over answer tokens `loss`
        and, with `counts`, the sums that accuracy and validation need (`loss_sum`, `tokens`,
        `correct`, `seq_ok`). `batch` is one batch for every member (without `vary_data`), the members'
        batches stacked, or a list of them when their shapes differ (a RASP task draws each
        step's length per member): then one vectorised pass per shape. With `in_passes`
        (validation), each shape's pass is cut into passes of `members_per_pass` members."""
        if not isinstance(batch, list):
            params = self.stacked_parameters()
            return self._vectorised(params, batch, not self.vary_data, counts, in_passes)
        groups: dict[tuple, list[int]] = {}
        for k, b in enumerate(batch):
            groups.setdefault(tuple(b.tokens.shape), []).append(k)
        if len(groups) == 1:
            return self._member_outputs(stack_batches(batch), counts, in_passes)
        parts, order = [], []
        for members in groups.values():
            index = torch.tensor(members, device=self.device)
            params = {name: self.stacked[_key(name)].index_select(0, index) for name in self._names}
            stacked = stack_batches([batch[k] for k in members])
            parts.append(self._vectorised(params, stacked, False, counts, in_passes))
            order += members
        back = torch.argsort(torch.tensor(order, device=self.device))
        return {key: torch.cat([p[key] for p in parts])[back] for key in parts[0]}

    def members_per_pass(self, batch: Batch, one_batch: bool) -> int | None:
        """How many members one validation pass on the CPU takes: as many as keep its residual
        stream (positions x d_model, summed over the members) within `PASS_FLOATS`, at least
        2; None (every member in one pass) on an accelerator."""
        if self.device.type != "cpu":
            return None
        positions = batch.tokens.numel() if one_batch else batch.tokens[0].numel()
        return max(2, PASS_FLOATS // max(1, positions * self._width))

    def _vectorised(self, params: dict[str, torch.Tensor], batch: Batch, one_batch: bool,
                    counts: bool, in_passes: bool = False) -> dict[str, torch.Tensor]:
        """`vectorised_outputs` through the plain twin: `one_batch` for every member, or the
        members' stacked; with `in_passes`, `members_per_pass` members a pass (member k's
        stack then holds its pass's members: a stack of one runs doubled, as ever)."""
        params = {self._plain_names[name]: p for name, p in params.items()}
        size = next(iter(params.values())).shape[0]
        step = self.members_per_pass(batch, one_batch) if in_passes else None
        if step is None or step >= size:
            return self._outputs(params, batch, one_batch, counts)
        parts = [self._outputs({name: p[start:start + step] for name, p in params.items()},
                               batch if one_batch else batch.take(slice(start, start + step)), one_batch, counts)
                 for start in range(0, size, step)]
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}

    def _outputs(self, params: dict[str, torch.Tensor], batch: Batch, one_batch: bool,
                 counts: bool) -> dict[str, torch.Tensor]:
        """`stacked_outputs` where the twin is one `stacked_logits` covers, else
        `vectorised_outputs` (vmap): the same values bit for bit, in fewer host calls."""
        out = stacked_outputs(self._plain, params, batch, one_batch, counts, self.loss_dtype)
        if out is None:
            return vectorised_outputs(self._plain, params, batch, one_batch, counts, self.loss_dtype)
        return out

    def _padded(self, batch: Batch | list[Batch]) -> Batch:
        """The members' training batches each `padded` to the task's longest input
        (`padded_members`), as a member re-run alone pads its own (TrainModule's `vectorised`)."""
        return padded_members(batch, self.task.n_ctx)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor | None:
        logging = not (self.global_step + 1) % self.trainer.log_every_n_steps  # Lightning's rule, as TrainModule
        out = self._member_outputs(self._padded(batch), counts=logging)
        losses = out["loss"]
        on_cpu = self.trainer.strategy.root_device.type == "cpu"
        if not on_cpu:  # the fused AdamW skips a step whose loss is not finite, on the device (as TrainModule)
            self.optimizers().optimizer.found_inf = (~torch.isfinite(losses.detach())).any().float()
        if on_cpu or logging:
            bad = (~torch.isfinite(losses.detach())).nonzero().flatten().tolist()
            if bad:
                names = ", ".join(member_name(k) for k in bad)
                print(f"phasewatch: error: the training loss of {names} is not finite at step {self.global_step}; "
                      "the population stops here, without that update. The checkpoints and every metric so far "
                      "are kept. Lower --model.lr, or train those seeds alone with --model.on_nonfinite skip.")
                self.trainer.should_stop = True
                self.nonfinite_step = self.global_step
                return None
        if logging:  # handed to the members' loggers after the callbacks, as Lightning does (on_train_batch_end)
            lr = float(torch.tensor(self.lr_schedulers().get_last_lr()[0]))  # self.log keeps it as float32
            acc = (out["correct"].float() / out["tokens"].float())
            self._pending = {"train/loss": losses.detach(), "train/acc": acc, "lr": lr}
            self.log("train/loss", losses.detach().mean(), prog_bar=True, logger=False, batch_size=1)
        return losses.sum()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._pending is not None:
            step = self.global_step - 1  # the step the values were computed at
            # each series read from the device once (one sync), not once per member
            read = {key: (v.tolist() if torch.is_tensor(v) else v) for key, v in self._pending.items()}
            for k, loggers in enumerate(self.member_loggers):
                emit(loggers, {key: (v[k] if isinstance(v, list) else v) for key, v in read.items()}, step)
            self._pending = None

    def on_validation_epoch_start(self) -> None:
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_group = self.task.val_groups()

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        out = self._member_outputs(batch, in_passes=True)
        sums = torch.stack([out[k].double() for k in ("loss_sum", "tokens", "correct", "seq_ok")], dim=-1)
        sizes = [len(b) for b in batch] if isinstance(batch, list) else [batch.tokens.shape[-2]] * len(sums)
        seqs = torch.tensor(sizes, dtype=sums.dtype, device=sums.device)[:, None]
        group = self._val_group[batch_idx]
        sums = torch.cat([sums, seqs], dim=-1)
        self._val_sums[group] = self._val_sums[group] + sums if group in self._val_sums else sums

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:  # Lightning logs nothing of a sanity check
            return
        read = {group: sums.tolist() for group, sums in self._val_sums.items()}  # one sync per group
        for k, loggers in enumerate(self.member_loggers):
            values: dict[str, float] = {}
            for group, sums in read.items():
                loss, tokens, correct, seq_ok, seqs = sums[k]
                values |= {f"{group}/loss": loss / tokens, f"{group}/acc": correct / tokens,
                           f"{group}/seq_acc": seq_ok / seqs}
            emit(loggers, values, self.global_step)
        val = self._val_sums.get("val")
        if val is not None:
            self.log("val/acc", (val[:, 2] / val[:, 1]).mean(), prog_bar=True, logger=False)

    # --- optimizer and checkpoints -----------------------------------------------------

    def configure_optimizers(self):
        params = [self.stacked[_key(name)] for name in self._order]
        return adamw_with_warmup(params, self.hparams_of_members,
                                 fused=self.trainer.strategy.root_device.type != "cpu")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.trainer.global_step == 0:  # as ScheduledCheckpoints: no loop state before the first step
            checkpoint.pop("loops", None)

    def member_checkpoint(self, index: int, callbacks: list, weights_only: bool = False) -> dict[str, Any]:
        """What `trainer.save_checkpoint(weights_only=...)` writes for an ordinary run, for member
        `index`: its weights, the loop state and, unless `weights_only`, its slice of the
        optimizer state, the shared learning-rate schedule and its callbacks' states (a full
        checkpoint, which `phasewatch fit` resumes alone)."""
        trainer, member = self.trainer, self.members[index]
        # the member's weights are views into the stack, so each is copied (torch.save would write
        # the whole stack); a weight the bridge names under several paths once (`shared_views`,
        # as a run alone's checkpoint holds it)
        state = shared_views(member.state_dict())
        copies = {ident: v.detach().clone() for ident, v in {id(v): v for v in state.values()}.items()}
        ckpt = {
            "epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "state_dict": {k: copies[id(v)] for k, v in state.items()},
            "hyper_parameters": dict(member.hparams), "phasewatch_skipped_steps": 0,
        }
        if hasattr(member, "_hparams_name"):
            ckpt["hparams_name"] = member._hparams_name
        if not weights_only:
            n, opt = len(self.members), self._once("optimizer", lambda: trainer.optimizers[0].state_dict())
            state = {i: {key: (v[index].clone() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v)
                         for key, v in s.items()} for i, s in opt["state"].items()}
            ckpt |= {"callbacks": {cb.state_key: cb.state_dict() for cb in callbacks},
                     "optimizer_states": [{"state": state, "param_groups": opt["param_groups"]}],
                     "lr_schedulers": self._once("lr_schedulers", lambda: [c.scheduler.state_dict()
                                                                           for c in trainer.lr_scheduler_configs])}
        if trainer.global_step > 0 or weights_only:  # (full at step 0: none, as ScheduledCheckpoints saves it)
            ckpt["loops"] = self._once("loops", lambda: {
                "fit_loop": trainer.fit_loop.state_dict(), "validate_loop": trainer.validate_loop.state_dict(),
                "test_loop": trainer.test_loop.state_dict(), "predict_loop": trainer.predict_loop.state_dict()})
        return ckpt

    def _once(self, key: str, read):
        """`read()`, read once for every member saving within one hook (`MemberCallbacks._each`
        opens `hook_state`: the trainer's optimizer, schedule and loops do not change while
        the members' callbacks run), else at every call."""
        if self.hook_state is None:
            return read()
        if key not in self.hook_state:
            self.hook_state[key] = read()
        return self.hook_state[key]


def stacked_outputs(twin: torch.nn.Module, params: dict[str, torch.Tensor], batch: Batch, shared: bool,
                    counts: bool, loss_dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """`vectorised_outputs` (the same keys and values, bit for bit on the CPU) from
    `stacked_logits`, the twin's pass written with the member dimension, and `answer_outputs`,
    the reductions vmap's pass makes per member, over the member dimension. None where `stacked_logits`
    does not cover the twin, and for one batch shared by every member (`shared`: vmap, whose
    unbatched inputs take other layouts through the kernels, rounding the key biases' gradients
    otherwise; tests/unit/test_stacked_logits.py)."""
    if shared:  # vmap runs one batch for every member in other layouts, which round otherwise
        return None
    logits = stacked_logits(twin, params, batch.tokens, batch.extras.get("attend"))
    if logits is None:
        return None
    return answer_outputs(logits, batch.targets, batch.loss_mask, counts, loss_dtype)


class MemberTrainer:
    """What one member's callbacks see of the population's trainer: its own loggers,
    callbacks and run folder, and checkpoints of the member alone; everything else (the
    step, the schedule, the state) is the population trainer's."""

    def __init__(self, trainer: pl.Trainer, population: PopulationModule, index: int, loggers: list,
                 callbacks: list, root: str):
        self.__dict__.update(_trainer=trainer, _population=population, _index=index, loggers=loggers,
                             callbacks=callbacks, default_root_dir=root, saved=False, member=member_name(index),
                             frozen=None)

    def __getattr__(self, name: str) -> Any:
        frozen = self.__dict__.get("frozen")
        if frozen is not None and name in frozen:
            return frozen[name]
        return getattr(self.__dict__["_trainer"], name)

    @property
    def logger(self):
        return self.loggers[0] if self.loggers else None

    @property
    def log_every_n_steps(self) -> int:
        frozen = self.__dict__.get("frozen")
        return frozen["log_every_n_steps"] if frozen is not None else self._trainer.log_every_n_steps

    @log_every_n_steps.setter
    def log_every_n_steps(self, value: int) -> None:  # the members log as one (the watcher's early logging)
        self._trainer.log_every_n_steps = value

    @property
    def should_stop(self) -> bool:
        return self._trainer.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._trainer.should_stop = value

    @property
    def lightning_module(self) -> TrainModule:
        return self._population.members[self._index]

    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False, storage_options=None) -> None:
        torch.save(self._population.member_checkpoint(self._index, self.callbacks, weights_only), filepath)
        self.saved = True


#: the callback hooks a member's callbacks are given (the ones phasewatch's callbacks use)
MEMBER_HOOKS = ("on_train_start", "on_train_batch_start", "on_train_batch_end", "on_validation_end", "on_train_end",
                "on_exception")
#: the hooks of every step: there the members' callbacks run only at the steps where one is due
STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")

#: the trainer's values that stay the same while one hook runs for every member: read once
#: per hook for the population (Lightning computes some of them, e.g. `enable_validation`)
#: instead of once per member and callback
FROZEN = ("global_step", "current_epoch", "max_steps", "val_check_batch", "enable_validation", "sanity_checking",
          "received_sigterm", "is_global_zero", "log_every_n_steps")


def overrides(callback: pl.Callback, hook: str) -> bool:
    """Whether `callback` does anything at `hook` (its class overrides Lightning's no-op)."""
    return getattr(type(callback), hook) is not getattr(pl.Callback, hook)


def due_at(callbacks: list[pl.Callback], step: int, dense: bool = False) -> bool:
    """Whether any of `callbacks` may act at `step` (`ProbeRunner.due_at`,
    `ScheduledCheckpoints.due_at`); a callback that does not say (no `due_at`) always may."""
    return any(not hasattr(cb, "due_at") or cb.due_at(step, dense) for cb in callbacks)


class MemberCallbacks(pl.Callback):
    """Runs every member's own callbacks (probes, transition watcher, checkpoints, live report)
    against its `MemberTrainer`, and writes the population's last.ckpt on its own schedule.

    Decided once per hook for the population: which of the members' callbacks act at that
    hook at all (those that override it), the trainer's `FROZEN` values, and at the hooks of
    every step (`STEP_HOOKS`) whether anything is due (`due_at` of member 0's callbacks: the
    members' schedules are one config's), else which members' transition watchers ask for the
    step (dense grid, onset pending): on the other steps no member's callback runs."""

    def __init__(self, callbacks: list[list[pl.Callback]], loggers: list[list], roots: list[str], last: Path):
        self.callbacks, self.loggers, self.roots, self.last = callbacks, loggers, roots, last
        self.views: list[MemberTrainer] = []
        self.hooked: dict[str, list[tuple[MemberTrainer, TrainModule, list[pl.Callback]]]] = {}
        self.watchers: list[list[TransitionWatcher]] = [[cb for cb in cbs if isinstance(cb, TransitionWatcher)]
                                                        for cbs in callbacks]
        self.last_every: int | None = None
        self.probes: StackedProbes | None = None  # the members' probes over the stacked weights
        self._last_step: int | None = None  # the step the population's last.ckpt holds, where this run wrote it

    def setup(self, trainer: pl.Trainer, pl_module: PopulationModule, stage: str) -> None:
        self.views = [MemberTrainer(trainer, pl_module, k, self.loggers[k], self.callbacks[k], self.roots[k])
                      for k in range(len(self.callbacks))]
        pl_module.member_loggers = self.loggers
        self.probes = StackedProbes(pl_module._template, pl_module.stacked_parameters,
                                    [member.model for member in pl_module.members], pl_module.task)
        for k, cbs in enumerate(self.callbacks):
            for runner in (cb for cb in cbs if isinstance(cb, ProbeRunner)):
                runner.stacked = self.probes.values_of(k)
        for view, member in zip(self.views, pl_module.members):
            for logger in view.loggers:
                logger.log_hyperparams(dict(member.hparams))
            for cb in view.callbacks:
                cb.setup(view, member, stage)
        self.hooked = {hook: [(view, member, [cb for cb in view.callbacks if overrides(cb, hook)])
                              for view, member in zip(self.views, pl_module.members)] for hook in MEMBER_HOOKS}
        every = {cb.last_every for cbs in self.callbacks for cb in cbs if hasattr(cb, "last_every")}
        self.last_every = min(every) if every else None

    def acting(self, hook: str, step: int, sigterm: bool = False) -> list[tuple[MemberTrainer, TrainModule, list]]:
        """The members whose callbacks run at `hook` of `step` (each with its view, module and
        the callbacks that override the hook): every member at a hook that is not a step's, at
        a step where member 0's callbacks are due (`due_at`) and on SIGTERM; else the members
        whose transition watcher asks for the step (`dense_now`), none on most steps."""
        hooked = self.hooked[hook]
        if hook not in STEP_HOOKS or sigterm or not hooked or due_at(hooked[0][2], step):
            return hooked
        return [hooked[k] for k, watchers in enumerate(self.watchers)
                if hooked[k][2] and any(w.dense_now(step) for w in watchers)]

    def _each(self, hook: str, trainer: pl.Trainer, pl_module: PopulationModule, *args: Any) -> None:
        acting = [entry for entry in self.acting(hook, trainer.global_step, bool(trainer.received_sigterm)) if entry[2]]
        if not acting:  # (most steps)
            return
        frozen = {name: getattr(trainer, name) for name in FROZEN}
        saved = False
        self.probes.expect([view._index for view, _, _ in acting])
        pl_module.hook_state = {}
        try:
            for view, member, callbacks in acting:
                view.saved, view.frozen = False, frozen
                try:
                    for cb in callbacks:
                        getattr(cb, hook)(view, member, *args)
                finally:
                    view.frozen = None
                self.probes.done(view._index)
                saved |= view.saved
        finally:
            pl_module.hook_state = None
        if saved and self._last_due(hook, frozen):  # the population's own checkpoint, after every member's
            self._save_last(trainer)

    def _save_last(self, trainer: pl.Trainer) -> None:
        tmp = self.last.with_name(self.last.name + ".tmp")
        self.last.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(tmp, weights_only=False)
        os.replace(tmp, self.last)
        self._last_step = trainer.global_step

    def _last_due(self, hook: str, frozen: dict[str, Any]) -> bool:
        """Whether the population's last.ckpt is written now that members saved: at the end, on
        SIGTERM and every `checkpoints.last_every` steps (the members' step checkpoints in
        between do not rewrite every member's state)."""
        return (hook == "on_train_end" or bool(frozen["received_sigterm"]) or self.last_every is None
                or frozen["global_step"] % self.last_every == 0)

    def on_train_start(self, trainer, pl_module) -> None:
        self._each("on_train_start", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._each("on_train_batch_start", trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._each("on_train_batch_end", trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._each("on_validation_end", trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._each("on_train_end", trainer, pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: PopulationModule, stage: str) -> None:
        status = "failed" if getattr(pl_module, "nonfinite_step", None) is not None else "success"
        for view, member in zip(self.views, pl_module.members):
            for cb in view.callbacks:
                cb.teardown(view, member, stage)
            for logger in view.loggers:
                logger.finalize(status)
        thaw()  # the objects frozen after the members' build (`out_of_the_collectors_way`)

    def on_exception(self, trainer: pl.Trainer, pl_module: PopulationModule, exception: BaseException) -> None:
        if stops_after_step(trainer, exception):  # members' last.ckpt at the step (their on_exception),
            self._each("on_exception", trainer, pl_module, exception)  # then the population's, also where
            if self._last_step != trainer.global_step:  # every member's already held the step (a full
                save_at_stop(trainer, lambda: self._save_last(trainer))  # step checkpoint, copied to last)
        for view in self.views:  # as Lightning closes a run's own loggers when it fails
            for logger in view.loggers:
                logger.finalize("failed")
        thaw()

    def state_dict(self) -> dict[str, Any]:
        return {"members": [{cb.state_key: cb.state_dict() for cb in cbs} for cbs in self.callbacks]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for cbs, states in zip(self.callbacks, state_dict.get("members", [])):
            for cb in cbs:
                if cb.state_key in states:
                    cb.load_state_dict(states[cb.state_key])


class _Lockstep(IterableDataset):
    """The members' training batches, step by step, stacked along a leading member dimension:
    drawn in one call where the task can (`Task.train_batches`), encoded a length at a time
    where it draws its batches as inputs of a length (`encoded_members`: RASP tasks, padded
    already), else member by member."""

    def __init__(self, members: list[TaskDataModule], start: int):
        self.members, self.start = members, start

    def __iter__(self) -> Iterator[Batch | list[Batch]]:
        first, step = self.members[0], self.start
        seeds = [getattr(m.task, "seed", None) for m in self.members]
        tasks = [m.task for m in self.members]

        def draw(step: int) -> Batch | None:
            if None not in seeds and (batch := first.task.train_batches(seeds, step, first.batch_size)) is not None:
                return batch
            return encoded_members(tasks, step, first.batch_size, first.task.n_ctx)

        batch, vocab = draw(step), first.task.d_vocab
        if batch is None:
            for batches in zip(*(m.train_dataloader().dataset for m in self.members)):
                yield in_vocabulary(member_batches(batches), vocab, first.task)
            return
        while True:
            yield in_vocabulary(batch, vocab, first.task)
            step += 1
            batch = draw(step)


def in_vocabulary(batch: Batch | list[Batch], vocab: int, task: object) -> Batch | list[Batch]:
    """`batch` (the members' own batches, stacked or a list), checked on the host: every token id
    in the task's vocabulary. A run alone fails on an id out of it (the embedding's index
    error); the members' stacked embedding reads one table of every member's rows, where such
    an id would read another member's row and train on, so it fails here instead (a task's bug,
    named with the fix)."""
    for b in batch if isinstance(batch, list) else (batch,):
        tokens = b.tokens
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            bad = tokens[(tokens < 0) | (tokens >= vocab)][0]
            raise ValueError(f"{type(task).__name__} drew token id {int(bad)}, outside its vocabulary of {vocab} ids "
                             f"(0 to {vocab - 1}): the population stops before training on it. Make the task's "
                             "batches draw ids below its d_vocab, or raise d_vocab.")
    return batch


def padded_members(batch: Batch | list[Batch], length: int) -> Batch:
    """The members' training batches (stacked, or a list when their shapes differ) each `padded`
    to `length` (the task's longest input) and stacked: a RASP task's lengths, drawn per member,
    are then one vectorised pass, and member k's arithmetic does not depend on the other
    members' lengths. A member at `length` attends everywhere where another is padded (exact).
    Validation is not padded (one pass per shape)."""
    if not isinstance(batch, list):
        return padded(batch, length)
    return stack_batches(_attending([padded(b, length) for b in batch]))


def _attending(batches: list[Batch]) -> list[Batch]:
    """`batches`, each with an `attend` mask where any has one (ones where it had none)."""
    if not any("attend" in b.extras for b in batches):
        return batches
    return [b if "attend" in b.extras else Batch(b.tokens, b.targets, b.loss_mask, {"attend": torch.ones_like(b.loss_mask)})
            for b in batches]


def encoded_members(tasks: list, step: int, batch_size: int | None, length: int) -> Batch | None:
    """`padded_members` of the members' training batches at `step`, for a task that draws a
    batch as its length and inputs (`train_rows`, RASP tasks): each member's own draw, then
    the members of one length encoded and padded together (`encoded`: a length's inputs
    encoded once for every member), not member by member; a member whose step draws a length
    too many to list (`train_rows` None) draws its own batch (`train_batch`). None where a task
    does not draw so."""
    if not all(hasattr(task, "train_rows") for task in tasks):
        return None
    draws = [task.train_rows(step, batch_size) for task in tasks]
    groups: dict[int, list[int]] = {}
    for k, drawn in enumerate(draws):
        if drawn is not None:
            groups.setdefault(drawn[0], []).append(k)
    alone = [k for k, drawn in enumerate(draws) if drawn is None]
    parts = _attending([padded(tasks[0].encoded(n, torch.stack([draws[k][1] for k in members])), length)
                        for n, members in groups.items()]
                       + [stack_batches([padded(tasks[k].train_batch(step, batch_size), length)]) for k in alone])
    back = torch.argsort(torch.tensor([k for members in groups.values() for k in members] + alone))
    extras = {"attend": torch.cat([p.extras["attend"] for p in parts])[back]} if "attend" in parts[0].extras else {}
    return Batch(*(torch.cat([getattr(p, f) for p in parts])[back] for f in ("tokens", "targets", "loss_mask")), extras)


def member_batches(batches) -> Batch | list[Batch]:
    """The members' batches stacked, or as a list when their shapes differ."""
    same = len({tuple(b.tokens.shape) for b in batches}) == 1
    return stack_batches(batches) if same else list(batches)


def stack_batches(batches) -> Batch:
    """One batch whose tensors have a leading member dimension (of the extras only `padded`'s
    `attend`: the training and validation steps read no other)."""
    extras = {"attend": torch.stack([b.extras["attend"] for b in batches])} if "attend" in batches[0].extras else {}
    return Batch(*(torch.stack([getattr(b, f) for b in batches]) for f in ("tokens", "targets", "loss_mask")), extras)


class PopulationData(pl.LightningDataModule):
    """The members' data: with `vary_data`, every member's own batches, stacked; otherwise
    member 0's (every member sees the same)."""

    def __init__(self, members: list[TaskDataModule], vary_data: bool):
        super().__init__()
        self.members, self.vary_data = members, vary_data

    def train_dataloader(self) -> DataLoader:
        for member in self.members:
            member.trainer = self.trainer
        if not self.vary_data:
            return self.members[0].train_dataloader()
        start = self.trainer.global_step if self.trainer is not None else 0
        return DataLoader(_Lockstep(self.members, start), batch_size=None, collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        if not self.vary_data:
            return self.members[0].val_dataloader()
        task = self.members[0].task
        batches = [in_vocabulary(member_batches(group), task.d_vocab, task)
                   for group in zip(*(m.task.val_batches() for m in self.members))]
        return DataLoader(batches, batch_size=None, collate_fn=_identity)


def _identity(x):
    return x

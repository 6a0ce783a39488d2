"""Population training: N members of one architecture trained in one process, one step for all.

`phasewatch fit --population.seeds 0-15` (or a count, `16`, or a list, `1,4,9`) trains one
member per seed. Member k is the run that `phasewatch fit` would make alone with
`seed_everything: k` (its initialisation) and, for a task that samples its training batches
(`Task.full_batch` False), `data.task.seed: k` (its batches, and for RASP tasks its split);
a full-batch task (modular addition) keeps the population's data seed, so every member sees
the same split (`--population.vary_data true|false` overrides either choice). Each member
is built by the same parser from its own config, so its initial weights and data are exactly
those of the run alone.

How one step trains every member: the members' parameters are stacked along a leading member
dimension (`PopulationModule.stacked`), the forward pass and the loss run once for all of them
(`torch.func.vmap` of `functional_call` over the model's own module), and one AdamW updates
the stack. AdamW is elementwise, so this equals N independent optimizers
(tests/unit/test_population.py proves it, and tests/integration/test_population.py checks
member k against the run alone on every task family). What is not elementwise stays per
member or is refused: the loss is each member's own mean (their sum is back-propagated, and
member k's parameters get only member k's gradient); clipping by global norm
(`trainer.gradient_clip_val`) is refused; per-member learning rates and weight decays are not
supported (every member takes the population's).

Every member is an ordinary run. `runs/<name>/m00`, `m01`, ... each hold config.yaml (which
re-runs the member alone through the same vectorised step, `model.vectorised`: bit for bit on
the CPU), metrics.jsonl, events.jsonl, arrays, checkpoints and, with W&B, a W&B run of their
own (grouped under the population's name). The members' weights are views
into the stack, so the probes, the transition watcher, the checkpoints and the live report of
each member run on it as in an ordinary run (`MemberTrainer` is what they see of the trainer).
The population's own folder (`runs/<name>`) holds its config.yaml and checkpoints/last.ckpt,
from which `phasewatch fit --run_dir runs/<name> --ckpt_path last` resumes every member.

Limits: a NaN or infinite loss in any member stops the whole population (`on_nonfinite:
stop`, naming the members; `skip` is refused). On the CPU the losses are checked at every
step; on an accelerator the fused AdamW skips every member's update at a step where any loss
is not finite, and the check is read at logging steps. Interventions are refused.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from phasewatch.models import native_module
from phasewatch.rundir import RunFolder, member_name
from phasewatch.tasks.base import Batch
from phasewatch.errors import ConfigError
from phasewatch.training.module import TaskDataModule, TrainModule, adamw_with_warmup, vectorised_outputs


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


def _key(name: str) -> str:
    return name.replace(".", "__")  # parameter names may not hold dots


class PopulationModule(pl.LightningModule):
    """Trains `members` (TrainModules of one architecture and one set of hyperparameters) as
    one stack of parameters: see the module's docstring. The members keep their own models,
    whose parameters are views into the stack, for their probes and checkpoints."""

    def __init__(self, members: list[TrainModule], shared_data: bool):
        super().__init__()
        first = members[0]
        for k, member in enumerate(members[1:], 1):
            if member.arch != first.arch:
                raise ConfigError("population", f"member {k} has another architecture than member 0",
                                  "Build every member from the same config (only the seeds differ).")
        self.members, self.shared_data = members, shared_data
        self.task, self.loss_dtype = first.task, first.loss_dtype
        self.hparams_of_members = dict(first.hparams)
        # the forward pass of every member runs through a copy of member 0's module
        self._template = copy.deepcopy(native_module(first.model))
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
        self.member_loggers: list[list] = [[] for _ in members]
        self._link()

    # --- the members' views ------------------------------------------------------------

    def _link(self) -> None:
        """Point every member's parameters at its slice of the stack (after a move to a device)."""
        for k, member in enumerate(self.members):
            member.to(self.device)
            for name, param in native_module(member.model).named_parameters():
                param.data = self.stacked[_key(name)].data[k]

    def on_fit_start(self) -> None:
        self._link()

    def on_train_start(self) -> None:
        self._link()

    # --- the step ----------------------------------------------------------------------

    def _member_outputs(self, batch: Batch | list[Batch], counts: bool = True) -> dict[str, torch.Tensor]:
        """Per member (a leading member dimension): the mean loss over answer tokens `loss`
        and, with `counts`, the sums that accuracy and validation need (`loss_sum`, `tokens`,
        `correct`, `seq_ok`). `batch` is one batch for every member (shared data), the members'
        batches stacked, or a list of them when their shapes differ (a RASP task draws each
        step's length per member): then one vectorised pass per shape."""
        if not isinstance(batch, list):
            params = {name: self.stacked[_key(name)] for name in self._names}
            return self._vectorised(params, batch, self.shared_data, counts)
        groups: dict[tuple, list[int]] = {}
        for k, b in enumerate(batch):
            groups.setdefault(tuple(b.tokens.shape), []).append(k)
        if len(groups) == 1:
            return self._member_outputs(stack_batches(batch), counts)
        parts, order = [], []
        for members in groups.values():
            index = torch.tensor(members, device=self.device)
            params = {name: self.stacked[_key(name)].index_select(0, index) for name in self._names}
            parts.append(self._vectorised(params, stack_batches([batch[k] for k in members]), False, counts))
            order += members
        back = torch.argsort(torch.tensor(order, device=self.device))
        return {key: torch.cat([p[key] for p in parts])[back] for key in parts[0]}

    def _vectorised(self, params: dict[str, torch.Tensor], batch: Batch, shared: bool,
                    counts: bool) -> dict[str, torch.Tensor]:
        return vectorised_outputs(self._template, params, batch, shared, counts, self.loss_dtype)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor | None:
        logging = not (self.global_step + 1) % self.trainer.log_every_n_steps  # Lightning's rule, as TrainModule
        out = self._member_outputs(batch, counts=logging)
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
        out = self._member_outputs(batch)
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

    def member_checkpoint(self, index: int, callbacks: list) -> dict[str, Any]:
        """What `trainer.save_checkpoint` writes for an ordinary run, for member `index`: its
        weights, its slice of the optimizer state, the shared schedule and loop state, and
        its callbacks' states. `phasewatch fit` resumes it alone."""
        trainer, n = self.trainer, len(self.members)
        opt = trainer.optimizers[0].state_dict()
        state = {i: {key: (v[index].clone() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v)
                     for key, v in s.items()} for i, s in opt["state"].items()}
        member = self.members[index]
        ckpt = {
            "epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "state_dict": {k: v.detach().clone() for k, v in member.state_dict().items()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks},
            "optimizer_states": [{"state": state, "param_groups": opt["param_groups"]}],
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "hyper_parameters": dict(member.hparams), "phasewatch_skipped_steps": 0,
        }
        if trainer.global_step > 0:
            ckpt["loops"] = {"fit_loop": trainer.fit_loop.state_dict(), "validate_loop": trainer.validate_loop.state_dict(),
                             "test_loop": trainer.test_loop.state_dict(), "predict_loop": trainer.predict_loop.state_dict()}
        return ckpt


def emit(loggers: list, metrics: dict[str, float], step: int) -> None:
    """Hand values to loggers as Lightning's logger connector does: `step` (the step that
    TrainModule logs as "step") is the x-axis, not a value."""
    for logger in loggers:
        logger.log_metrics(metrics, step)
        logger.save()


class MemberTrainer:
    """What one member's callbacks see of the population's trainer: its own loggers,
    callbacks and run folder, and checkpoints of the member alone; everything else (the
    step, the schedule, the state) is the population trainer's."""

    def __init__(self, trainer: pl.Trainer, population: PopulationModule, index: int, loggers: list,
                 callbacks: list, root: str):
        self.__dict__.update(_trainer=trainer, _population=population, _index=index, loggers=loggers,
                             callbacks=callbacks, default_root_dir=root, saved=False, member=member_name(index))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_trainer"], name)

    @property
    def logger(self):
        return self.loggers[0] if self.loggers else None

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
        torch.save(self._population.member_checkpoint(self._index, self.callbacks), filepath)
        self.saved = True


#: the callback hooks a member's callbacks are given (the ones phasewatch's callbacks use)
MEMBER_HOOKS = ("on_train_start", "on_train_batch_start", "on_train_batch_end", "on_validation_end", "on_train_end")


class MemberCallbacks(pl.Callback):
    """Runs every member's own callbacks (probes, transition watcher, checkpoints, live report)
    against its `MemberTrainer`, and keeps the population's last.ckpt next to the members'."""

    def __init__(self, callbacks: list[list[pl.Callback]], loggers: list[list], roots: list[str], last: Path):
        self.callbacks, self.loggers, self.roots, self.last = callbacks, loggers, roots, last
        self.views: list[MemberTrainer] = []

    def setup(self, trainer: pl.Trainer, pl_module: PopulationModule, stage: str) -> None:
        self.views = [MemberTrainer(trainer, pl_module, k, self.loggers[k], self.callbacks[k], self.roots[k])
                      for k in range(len(self.callbacks))]
        pl_module.member_loggers = self.loggers
        for view, member in zip(self.views, pl_module.members):
            for logger in view.loggers:
                logger.log_hyperparams(dict(member.hparams))
            for cb in view.callbacks:
                cb.setup(view, member, stage)

    def _each(self, hook: str, trainer: pl.Trainer, pl_module: PopulationModule, *args: Any) -> None:
        for view, member in zip(self.views, pl_module.members):
            view.saved = False
            for cb in view.callbacks:
                getattr(cb, hook)(view, member, *args)
        if any(view.saved for view in self.views):  # the population's own checkpoint, after every member's
            tmp = self.last.with_name(self.last.name + ".tmp")
            self.last.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(tmp, weights_only=False)
            os.replace(tmp, self.last)

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

    def on_exception(self, trainer: pl.Trainer, pl_module: PopulationModule, exception: BaseException) -> None:
        for view in self.views:  # as Lightning closes a run's own loggers when it fails
            for logger in view.loggers:
                logger.finalize("failed")

    def state_dict(self) -> dict[str, Any]:
        return {"members": [{cb.state_key: cb.state_dict() for cb in cbs} for cbs in self.callbacks]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for cbs, states in zip(self.callbacks, state_dict.get("members", [])):
            for cb in cbs:
                if cb.state_key in states:
                    cb.load_state_dict(states[cb.state_key])


class _Lockstep(IterableDataset):
    """The members' training batches, step by step, stacked along a leading member dimension."""

    def __init__(self, streams: list[IterableDataset]):
        self.streams = streams

    def __iter__(self) -> Iterator[Batch | list[Batch]]:
        for batches in zip(*self.streams):
            yield member_batches(batches)


def member_batches(batches) -> Batch | list[Batch]:
    """The members' batches stacked, or as a list when their shapes differ."""
    same = len({tuple(b.tokens.shape) for b in batches}) == 1
    return stack_batches(batches) if same else list(batches)


def stack_batches(batches) -> Batch:
    """One batch whose tensors have a leading member dimension (extras are left out: the
    training and validation steps do not read them)."""
    return Batch(*(torch.stack([getattr(b, f) for b in batches]) for f in ("tokens", "targets", "loss_mask")))


class PopulationData(pl.LightningDataModule):
    """The members' data: with `shared`, member 0's batches (every member sees the same);
    otherwise every member's own, stacked."""

    def __init__(self, members: list[TaskDataModule], shared: bool):
        super().__init__()
        self.members, self.shared = members, shared

    def train_dataloader(self) -> DataLoader:
        for member in self.members:
            member.trainer = self.trainer
        if self.shared:
            return self.members[0].train_dataloader()
        streams = [m.train_dataloader().dataset for m in self.members]
        return DataLoader(_Lockstep(streams), batch_size=None, collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        if self.shared:
            return self.members[0].val_dataloader()
        batches = [member_batches(group) for group in zip(*(m.task.val_batches() for m in self.members))]
        return DataLoader(batches, batch_size=None, collate_fn=_identity)


def _identity(x):
    return x

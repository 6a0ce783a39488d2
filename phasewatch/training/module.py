"""The LightningModule and the data module that train any phasewatch task.

Metric keys logged (DESIGN.md): `train/loss`, `train/acc`, `lr` every logged step;
at every validation, over the whole held-out set: `val/loss` (mean cross-entropy per
answer token), `val/acc` (fraction of answer tokens right) and `val/seq_acc` (fraction
of sequences with every answer token right). A task that names a second validation set
(`Task.val_groups`, e.g. RASP's lengths beyond those trained on) gets the same three
under its own prefix (`val_longer/acc`, ...).

Steps between which nothing is due (validation, a callback's hook) run several to a Lightning
step (`TrainModule.chunked`), a logging step's values handed to the loggers inside the chunk: the
same arithmetic and the same metrics, bit for bit on the CPU, with Lightning's per-step work paid
once per chunk (bench/README.md, fit_speed).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset

from phasewatch.callbacks.checkpoints import shared_views
from phasewatch.callbacks.interventions import Interventions
from phasewatch.callbacks.transitions import TransitionWatcher
from phasewatch.models import (ModelConfig, build_model, call_with, eval_mode, native_module, parameters_kept,
                               restore_modes)
from phasewatch.models.plain import plain_twin
from phasewatch.errors import ConfigError, require, require_int  # noqa: F401
from phasewatch.tasks.base import Batch, Task, masked_loss, masked_loss_and_acc


#: device copies of recently served batches kept by TrainModule.transfer_batch_to_device
RESIDENT_BATCHES = 16


class StepStream(IterableDataset):
    """Endless training batches: the batch at step s is `task.train_batch(s, batch_size)`,
    starting at `start` (the step a resumed run continues from). Where `unused()` says that
    nobody reads Lightning's batch (steps in chunks draw their own: `TrainModule._chunk`), an
    empty batch (`UNUSED`) stands in for it, not drawn."""

    def __init__(self, task: Task, batch_size: int | None, start: int, unused=None):
        self.task, self.batch_size, self.start, self.unused = task, batch_size, start, unused

    def __iter__(self) -> Iterator[Batch]:
        step = self.start
        while True:
            yield UNUSED if self.unused is not None and self.unused() else self.task.train_batch(step, self.batch_size)
            step += 1


#: what Lightning's loop is handed where no step reads its batch (`StepStream`)
UNUSED = Batch(torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
               torch.zeros(0, 0, dtype=torch.bool))


def _identity(x):
    return x


def quickstart_task() -> Task:
    """The embedded default: (a + b) mod 59 with half the pairs for training (see
    configs/quickstart.yaml, which spells out the same run)."""
    from jsonargparse import lazy_instance

    from phasewatch.tasks.modular_addition import ModularAddition

    return lazy_instance(ModularAddition, p=59, op="+", frac_train=0.5, seed=0)


class TaskDataModule(pl.LightningDataModule):
    """Serves a task's training stream and its fixed validation set.

    Args:
        task: the task (on the command line: `--data.task ModularAddition --data.task.p 97`);
            default: the quickstart's modular addition mod 59.
        batch_size: None for the task's natural batch (full batch for grokking).
    """

    def __init__(self, task: Task = quickstart_task(), batch_size: int | None = None):
        super().__init__()
        if batch_size is not None:
            require_int(batch_size, "data.batch_size", 1, "Use a positive batch size, or null for the task's default.")
        self.task, self.batch_size = task, batch_size

    def train_dataloader(self) -> DataLoader:
        start = self.trainer.global_step if self.trainer is not None else 0
        return DataLoader(StepStream(self.task, self.batch_size, start, self._batches_unused), batch_size=None,
                          collate_fn=_identity, pin_memory=self.pins())

    def _batches_unused(self) -> bool:
        """Whether the module runs its steps in chunks (`TrainModule.chunked`), which draw each
        step's batch themselves: Lightning's own is not read. Only a plan of this trainer's fit
        counts: one left by a fit that raised (no `on_train_end`) is not this fit's."""
        plan = getattr(self.trainer.lightning_module, "_fit_plan", None) if self.trainer is not None else None
        return plan is not None and plan.trainer is self.trainer and plan.chunked

    def pins(self) -> bool:
        """Whether training batches are pinned in host memory (copied to the GPU without
        blocking): on CUDA, where every step has a new batch. A full-batch task served whole
        repeats one set, which stays on the device (TrainModule.transfer_batch_to_device)."""
        return (self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
                and not (self.task.full_batch and self.batch_size is None))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.task.val_batches(), batch_size=None, collate_fn=_identity)


class TrainModule(pl.LightningModule):
    """Trains a TransformerBridge on a task with AdamW and a linear warm-up.

    Args:
        task: set from `data.task` by the CLI (do not pass it on the command line).
        arch: the architecture; unset fields take the task's defaults.
        lr, weight_decay, betas: AdamW (defaults: Nanda et al. 2023).
        warmup_steps: linear warm-up, lr * min(step / warmup_steps, 1) (the paper's schedule,
            so step 0 runs at lr 0); 0 disables it.
        loss_dtype: "float32" or "float64"; None uses the task's choice (grokking: float64).
        vectorised: None (default) for the plain step. "shared" or "own": the population's
            vectorised step (`vectorised_outputs`) run as a population of one, with the data
            the population's members shared ("shared") or each its own ("own"). A population
            writes it into each member's config.yaml, so that `phasewatch fit --config
            mNN/config.yaml` repeats the member's arithmetic bit for bit on the CPU
            (docs/populations.md); the plain step rounds differently (one float32 ulp in
            the logits), which a long run amplifies.
        on_nonfinite: what a NaN or infinite training loss does: "stop" (default: training
            ends with a message naming the step; the weights, the last checkpoint and every
            metric so far stay as they were) or "skip" (that step's update is skipped and
            counted in `train/skipped_steps`). On the CPU the loss is checked at every step;
            on an accelerator, reading it would stall the device every step, so the check
            runs on the device (the fused AdamW skips a non-finite step's update there) and
            is read at logging steps only: "stop" then ends training at the next logging
            step, every non-finite update before it skipped.
    """

    def __init__(
        self,
        task: Task | None = None,
        arch: ModelConfig | None = None,
        lr: float = 1e-3,
        weight_decay: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_steps: int = 10,
        loss_dtype: str | None = None,
        on_nonfinite: str = "stop",
        vectorised: str | None = None,
    ):
        super().__init__()
        if task is None:
            raise ConfigError("data.task", "no task given", "Pass --data.task NAME (e.g. ModularAddition) or a config.")
        require(isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0, "model.lr",
                f"must be a positive number, got {lr!r}", "Use e.g. 1e-3.")
        require(isinstance(weight_decay, (int, float)) and weight_decay >= 0, "model.weight_decay",
                f"must be >= 0, got {weight_decay!r}", "Use e.g. 1.0 (grokking) or 0.")
        require(lr * weight_decay < 1, "model.weight_decay",
                f"lr x weight_decay = {lr * weight_decay:.3g}, but AdamW multiplies the weights by 1 - lr x "
                "weight_decay every step, so it must stay below 1", "Lower the weight decay or the learning rate.")
        require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "model.betas",
                f"must be two numbers in [0, 1), got {betas!r}", "Use e.g. [0.9, 0.98].")
        require_int(warmup_steps, "model.warmup_steps", 0)
        require(loss_dtype in (None, "float32", "float64"), "model.loss_dtype", f"unknown dtype {loss_dtype!r}",
                "Use float32, float64 or leave it unset.")
        require(on_nonfinite in ("stop", "skip"), "model.on_nonfinite", f"unknown choice {on_nonfinite!r}",
                "Use stop or skip.")
        require(vectorised in (None, "shared", "own"), "model.vectorised", f"unknown choice {vectorised!r}",
                "Use shared, own or leave it unset (a population member's config sets it).")
        self.save_hyperparameters(ignore=["task"])
        if dataclasses.is_dataclass(self.hparams.get("arch")):  # plain data, so checkpoints load with weights_only
            self.hparams["arch"] = dataclasses.asdict(self.hparams["arch"])
        self.task = task
        self.arch = (arch or ModelConfig()).resolve(task)
        self.model = build_model(self.arch, task)
        self.loss_dtype = getattr(torch, loss_dtype) if loss_dtype else task.loss_dtype
        self.skipped_steps = 0
        self._skips_logged = 0  # skipped_steps as last logged
        self._train_log: tuple[int, dict] | None = None  # a logging step's values (`on_train_batch_end`)
        self.shown: dict[str, float] = {}  # the latest training loss and accuracy, for the progress bar
        self._nonfinite: torch.Tensor | None = None  # non-finite steps since the last logging step (accelerators)
        self._first_nonfinite: torch.Tensor | None = None
        self._resident: dict[int, tuple[Batch, Batch]] = {}  # host batch id -> (host batch, device copy)
        # auxiliary loss terms: callables (module) -> {name: weighted scalar tensor}, added
        # to the training loss (callbacks/interventions.py's aux_loss)
        self.aux_terms: list = []
        self._fit_plan: FitPlan | None = None  # what this fit decided once (`on_train_start`)
        self._chunk_ends_by = 0.0  # `time.monotonic()` by which a chunk ends for the progress bar (`_due_at`)
        self._modes_before_validation: list[tuple[torch.nn.Module, bool]] = []  # `on_validation_model_eval`

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    # --- several optimisation steps per Lightning step ---------------------------------

    #: run steps in chunks where `chunked` allows (tests switch it off to compare)
    chunks = True

    @property
    def automatic_optimization(self) -> bool:
        """Lightning's automatic optimisation, except in chunks (`chunked`), which step the
        optimizer themselves."""
        return not self.chunked()

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = value

    def chunked(self) -> bool:
        """Whether training steps run several to a Lightning step (`_chunk`): with the plain
        step, no gradient clipping or accumulation, steps counted by Lightning's batches
        (validation every `val_check_interval` steps), and every callback that acts at
        training steps saying at which (`_chunk_aware`). Decided when a fit's training
        starts (`on_train_start`, a resumed fit's too): Lightning asks several times a step."""
        trainer = self._trainer
        plan = self._fit_plan
        if plan is not None and plan.trainer is trainer and trainer.state.fn == "fit":
            return plan.chunked
        return self._chunkable(trainer)

    def _chunkable(self, trainer: pl.Trainer | None) -> bool:
        return bool(self.chunks and trainer is not None and trainer.state.fn == "fit"
                    and not self.hparams.get("vectorised") and not self.aux_terms
                    and not trainer.gradient_clip_val
                    and trainer.accumulate_grad_batches == 1 and trainer.log_every_n_steps >= 1
                    and trainer.limit_train_batches == 1.0 and trainer.check_val_every_n_epoch is None
                    and trainer._val_check_time_interval is None
                    and all(_chunk_aware(cb) for cb in trainer.callbacks))

    def on_train_start(self) -> None:
        self._fit_plan = None  # decided afresh for this fit
        chunked = self._chunkable(self.trainer)
        self._fit_plan = FitPlan.of(self.trainer, chunked, self._loop_steps() if chunked else None)

    def _loop_steps(self):
        """Lightning's count of optimizer steps in chunks (manual optimisation): `global_step`."""
        return self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress

    def on_train_end(self) -> None:
        self._fit_plan = None

    def _due_at(self, step: int) -> bool:
        """Whether anything happens between the optimisation step that ends at `step` and the
        next but the training log (which a chunk hands over itself, `_hand_over`): validation,
        the end, a stop or a signal, a callback's hook (its `due_at`, as a population asks:
        training/population.py), or the progress bar's next draw (`FitPlan.bar_seconds`)."""
        plan = self._fit_plan
        trainer = plan.trainer
        if (step >= plan.max_steps or trainer.should_stop or trainer.received_sigterm
                or (plan.val_every and step % plan.val_every == 0)):
            return True
        dense = False
        for watcher in plan.watchers:
            if watcher.dense_now(step):
                dense = True
                break
        for cb in plan.due:
            if cb.due_at(step, dense):
                return True
        return plan.bar_seconds is not None and time.monotonic() >= self._chunk_ends_by

    def _step_now(self) -> int:
        """`global_step`, in chunks read from Lightning's counter straight (`FitPlan.steps`)."""
        plan = self._fit_plan
        return plan.steps.total.completed if plan is not None and plan.steps is not None else self.global_step

    def _chunk(self, batch_idx: int) -> torch.Tensor | None:
        """Optimisation steps from this one up to the next where anything is due, or one whose
        loss is not finite: each as Lightning's automatic optimisation runs it (zero_grad,
        backward, the optimizer's and the scheduler's step; no update where the loss is not
        finite; on an accelerator the fused AdamW skips it on the device, `_checked_on_device`),
        on the batch of its step, without Lightning's hooks around each (no callback that
        `chunked` allows has any). A logging step's values go to the loggers where the step ends
        (`_hand_over`), as Lightning's `on_train_batch_end` would hand them over with nothing else
        due there. Lightning's own batch is not used (nor drawn: `StepStream`): after a chunk its
        stream's position is no longer the step. Lightning's counters count each step."""
        optimizer, sched = self.optimizers().optimizer, self.lr_schedulers()
        plan = self._fit_plan
        loop = plan.trainer.fit_loop.epoch_loop
        steps = plan.steps  # Lightning's global_step: steps.total.completed
        data = plan.trainer.datamodule
        device, pin = self.device, data.pins()
        train_batch, batch_size = self.task.train_batch, data.batch_size
        if plan.bar_seconds is not None:
            self._chunk_ends_by = time.monotonic() + plan.bar_seconds
        while True:
            batch = train_batch(steps.total.completed, batch_size)
            if device.type != "cpu":
                batch = self.transfer_batch_to_device(batch.pin_memory() if pin else batch, device, 0)
            loss = self._step(batch, batch_idx)
            optimizer.zero_grad()
            if loss is not None:
                loss.backward()
            steps.increment_ready()
            optimizer.step()  # with no gradients (a skipped step) it changes nothing
            steps.increment_completed()
            sched.step()
            if loss is None or self._due_at(steps.total.completed):
                return loss
            if self._train_log is not None:  # a logging step with nothing else due: logged here
                self._hand_over()
            # the step just done, counted as Lightning counts a batch (validation and logging
            # follow its counts) before the next
            for count in (loop.batch_progress.increment_processed, loop.batch_progress.increment_completed,
                          loop.batch_progress.increment_ready, loop.batch_progress.increment_started):
                count()
            loop._batches_that_stepped += 1

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor | None:
        if not self.automatic_optimization:
            return self._chunk(batch_idx)
        return self._step(batch, batch_idx)

    def _step(self, batch: Batch, batch_idx: int) -> torch.Tensor | None:
        """One training step's loss (None: no update), logged at logging steps."""
        if self.hparams.get("vectorised"):
            return self._vectorised_step(batch)
        logits = native_module(self.model)(batch.tokens)
        aux = {name: term for fn in self.aux_terms for name, term in fn(self).items()}
        if (self._step_now() + 1) % self._trainer.log_every_n_steps:
            # not a logging step (Lightning's own rule): skip the metric bookkeeping, which
            # costs as much as a small model's step
            return self._checked(masked_loss(logits, batch, self.loss_dtype) + sum(aux.values()), logging=False)
        task_loss, acc = masked_loss_and_acc(logits, batch, self.loss_dtype)
        loss = task_loss + sum(aux.values())
        if self._checked(loss, logging=True) is None:
            return None
        values = {}
        if aux:  # the loss breakdown: the task's loss and each auxiliary term (weight included)
            values = {"train/task_loss": task_loss, **{f"train/aux/{name}": term for name, term in aux.items()}}
        self._log_train({**values, "train/loss": loss, "train/acc": acc})
        return loss

    def _as_population_of_one(self, batch: Batch, counts: bool) -> dict[str, torch.Tensor]:
        """`vectorised_outputs` of this model as a stack of one member (its parameters, and
        with "own" data its batch, given a leading member dimension of 1)."""
        module, names = plain_twin(self.model)  # as the population's step (models.plain)
        params = {names[name]: p.unsqueeze(0) for name, p in native_module(self.model).named_parameters()}
        shared = self.hparams.vectorised == "shared"
        if not shared:
            batch = Batch(batch.tokens.unsqueeze(0), batch.targets.unsqueeze(0), batch.loss_mask.unsqueeze(0),
                          {k: v.unsqueeze(0) for k, v in batch.extras.items() if k == "attend"})
        return vectorised_outputs(module, params, batch, shared, counts, self.loss_dtype)

    def _vectorised_step(self, batch: Batch) -> torch.Tensor | None:
        """The training step of `vectorised`: PopulationModule.training_step's arithmetic."""
        logging = not (self._step_now() + 1) % self._trainer.log_every_n_steps
        out = self._as_population_of_one(padded(batch, self.task.n_ctx), counts=logging)  # as the population
        aux = {name: term for fn in self.aux_terms for name, term in fn(self).items()}
        loss = out["loss"].sum() + sum(aux.values())  # the population back-propagates the sum over members
        if not logging:
            return self._checked(loss, logging=False)
        if self._checked(loss, logging=True) is None:
            return None
        self._log_train({**{f"train/aux/{name}": term for name, term in aux.items()}, "train/loss": out["loss"][0],
                         "train/acc": out["correct"][0].float() / out["tokens"][0].float()})
        return loss

    def _log_train(self, values: dict[str, torch.Tensor | float]) -> None:
        """A logging step's training values, with the learning rate and the count of skipped
        steps where it grew, for `on_train_batch_end` to hand to the loggers."""
        values["lr"] = float(torch.tensor(self.lr_schedulers().get_last_lr()[0]))  # float32, as self.log kept it
        if self.skipped_steps != self._skips_logged:
            values["train/skipped_steps"] = float(self.skipped_steps)
            self._skips_logged = self.skipped_steps
        self._train_log = (self._step_now(), {key: value.detach() if isinstance(value, torch.Tensor) else value
                                              for key, value in values.items()})

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """A logging step's training values to the loggers, filed under the step whose weights
        gave them, after the callbacks' hooks (where Lightning hands over what `self.log`
        collected): straight, as the population does, since Lightning's `self.log` and logger
        connector cost about 10,000 Python calls a logging step (bench/README.md, fit_speed).
        The progress bar shows the training loss and accuracy from `shown`. In chunks, a logging
        step where nothing else is due is handed over at once (`_chunk`)."""
        if self._train_log is not None:
            self._hand_over()

    def _hand_over(self) -> None:
        """The logging step's values (`_log_train`) to the loggers and the progress bar."""
        (step, values), self._train_log = self._train_log, None
        metrics = {key: float(value) for key, value in values.items()}
        emit(self.loggers, metrics, step)
        self.shown = {key: metrics[key] for key in ("train/loss", "train/acc") if key in metrics}

    @property
    def defer_checks(self) -> bool:
        """Whether the non-finite check stays on the device (see `on_nonfinite`): on an
        accelerator (tests patch this property to run that path on the CPU)."""
        return self.trainer.strategy.root_device.type != "cpu"

    def _checked(self, loss: torch.Tensor, logging: bool) -> torch.Tensor | None:
        """The loss, or None (no update this step) when it is NaN or infinite."""
        if self.defer_checks:
            return self._checked_on_device(loss, logging)
        if torch.isfinite(loss):
            return loss
        if self.hparams.on_nonfinite == "skip":
            self.skipped_steps += 1
            if logging:
                self._log_train({})
            return None
        self._stop_on_nonfinite(f"the training loss is {loss.item()} at step {self.global_step}; training stops "
                                "here, without that update.", self.global_step)
        return None

    def _checked_on_device(self, loss: torch.Tensor, logging: bool) -> torch.Tensor:
        """The accelerator's check: no host sync except at logging steps."""
        bad = ~torch.isfinite(loss.detach())
        self.optimizers().optimizer.found_inf = bad.float()  # the fused AdamW skips the update on the device
        if self._nonfinite is None:
            self._nonfinite = torch.zeros((), dtype=torch.long, device=loss.device)
            self._first_nonfinite = torch.full((), -1, dtype=torch.long, device=loss.device)
        self._first_nonfinite = torch.where((self._first_nonfinite < 0) & bad, self.global_step, self._first_nonfinite)
        self._nonfinite = self._nonfinite + bad
        if logging:
            count = int(self._nonfinite)  # this step's loss is read for the log anyway
            if count:
                if self.hparams.on_nonfinite == "skip":
                    self.skipped_steps += count  # logged with this step's values
                else:
                    first = int(self._first_nonfinite)
                    self._stop_on_nonfinite(f"the training loss was not finite at {count} step(s) from step {first} "
                                            f"to {self.global_step}; their updates were skipped and training stops "
                                            "here.", first)
                self._nonfinite.zero_()
                self._first_nonfinite.fill_(-1)
        return loss

    def _stop_on_nonfinite(self, what: str, step: int) -> None:
        print(f"phasewatch: error: {what} The checkpoints and every metric so far are kept. "
              "Lower --model.lr, or pass --model.on_nonfinite skip to skip such steps.")
        self.trainer.should_stop = True
        self.nonfinite_step = step

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["phasewatch_skipped_steps"] = self.skipped_steps
        shared_views(checkpoint["state_dict"])  # the bridge's repeated weights pickled once each

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.skipped_steps = self._skips_logged = int(checkpoint.get("phasewatch_skipped_steps", 0))
        loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
        auto = loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {}).get("step")
        manual = loop.get("epoch_loop.manual_optimization.optim_step_progress")
        if auto and manual:  # Lightning counts steps in one of two places (`chunked`): resume from either
            for part in ("total", "current"):
                steps = max(auto[part]["completed"], manual[part]["completed"])
                for tracker in (auto[part], manual[part]):
                    tracker["ready"] = tracker["completed"] = steps

    def _log_step(self) -> None:
        # The step a validation's values are filed under: the number of optimizer steps applied
        # to the weights that produced them (as in checkpoint names). Lightning uses a logged
        # "step" value as the x-axis instead of its own counter.
        self.log("step", float(self.global_step), on_epoch=True, batch_size=1)

    def on_validation_model_zero_grad(self) -> None:
        """Every parameter's gradient released before validation, as Lightning's `self.zero_grad()`
        does (`nn.Module.zero_grad`: set to None), in one walk over the modules (`parameters()`
        walks them and keeps a set of those seen; a parameter reached twice is released twice)."""
        for module in self.modules():
            for param in module._parameters.values():
                if param is not None and param.grad is not None:
                    param.grad = None

    def on_validation_model_eval(self) -> None:
        """Every module in eval mode for validation, as Lightning's `trainer.model.eval()`, and
        the bridge's own model too, each set once (`eval_mode`)."""
        self._modes_before_validation = eval_mode(self.trainer.model, self.model)

    def on_validation_model_train(self) -> None:
        """Every module's mode as it was before validation (`on_validation_model_eval`)."""
        restore_modes(self._modes_before_validation)
        self._modes_before_validation = []

    def on_validation_epoch_start(self) -> None:
        # per validation set (Task.val_groups), summed over its batches (which differ in
        # length for rasp tasks): loss, answer tokens, correct tokens, whole-answer-correct
        # sequences, sequences
        groups = self.task.val_groups()
        self._val_group = groups
        self._val_sums = {g: torch.zeros(5, dtype=torch.float64, device=self.device) for g in dict.fromkeys(groups)}

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        if self.hparams.get("vectorised"):  # PopulationModule.validation_step's arithmetic
            out = self._as_population_of_one(batch, counts=True)
            sums = torch.stack([out[k][0].double() for k in ("loss_sum", "tokens", "correct", "seq_ok")])
            seqs = torch.tensor([float(len(batch))], dtype=sums.dtype, device=sums.device)
            self._val_sums[self._val_group[batch_idx]] += torch.cat([sums, seqs])
            return
        logits = native_module(self.model)(batch.tokens)
        picked = logits[batch.loss_mask].to(self.loss_dtype)
        targets = batch.targets[batch.loss_mask]
        correct = picked.argmax(-1) == targets
        per_pos = torch.ones_like(batch.loss_mask)
        per_pos[batch.loss_mask] = correct
        self._val_sums[self._val_group[batch_idx]] += torch.stack([
            F.cross_entropy(picked, targets, reduction="sum").double(), torch.tensor(len(targets), device=self.device),
            correct.sum(), per_pos.all(dim=-1).sum(), torch.tensor(len(batch), device=self.device),
        ]).double()

    def on_validation_epoch_end(self) -> None:
        """The validation's values, filed under the step whose weights gave them. In a fit they go
        to the loggers straight (`emit`, as Lightning's logger connector would hand them over),
        and into `trainer.callback_metrics` and `progress_bar_metrics` as `self.log` would leave
        them: `self.log` and the logger connector cost about 2,000 Python calls a value
        (bench/README.md, fit_speed). Elsewhere (`phasewatch validate`, a sanity check) through
        `self.log`."""
        values, shown = {}, {}
        for group, (loss, tokens, correct, seq_ok, seqs) in self._val_sums.items():
            values |= {f"{group}/loss": loss / tokens, f"{group}/acc": correct / tokens, f"{group}/seq_acc": seq_ok / seqs}
            if group == "val":
                shown |= {"val/loss": values["val/loss"], "val/acc": values["val/acc"]}
        trainer = self.trainer
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            for key, value in values.items():
                self.log(key, value, prog_bar=key in shown)
            self._log_step()
            return
        step = self.global_step
        emit(self.loggers, {key: value.item() for key, value in values.items()}, step)
        logged = {**values, "step": torch.tensor(float(step), device=self.device)}
        trainer.callback_metrics.update(logged)
        trainer.logged_metrics.update(logged)
        trainer.progress_bar_metrics.update({key: value.item() for key, value in shown.items()})

    def transfer_batch_to_device(self, batch: Batch, device: torch.device, dataloader_idx: int) -> Batch:
        """The batch on `device`. A batch served again (a full-batch task's training set,
        the validation set) keeps its device copy: no copy per step. Others are copied
        without blocking (from pinned memory on CUDA, see TaskDataModule)."""
        if device.type == "cpu":
            return batch
        hit = self._resident.get(id(batch))
        if hit is not None and hit[0] is batch:
            return hit[1]
        moved = batch.to(device, non_blocking=True)
        self._resident[id(batch)] = (batch, moved)
        while len(self._resident) > RESIDENT_BATCHES:
            self._resident.pop(next(iter(self._resident)))
        return moved

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return adamw_with_warmup(params, self.hparams, fused=self.defer_checks)


def _chunk_aware(callback: pl.Callback) -> bool:
    """Whether `callback` lets training steps run in chunks: it says at which steps it acts
    (`due_at(step, dense)`), or acts at none (no hook of a training step), or it is the
    progress bar (drawn at the end of each chunk) or interventions that have none to run."""
    if hasattr(callback, "due_at") or isinstance(callback, TQDMProgressBar):
        return True
    if isinstance(callback, Interventions):
        return not callback.items
    return not any(is_overridden(hook, callback, pl.Callback) for hook in STEP_HOOKS)


#: the callback hooks Lightning calls at every training step
STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_before_zero_grad")


#: a chunk ends after this many seconds where a progress bar is drawn, so that it moves on (`_due_at`)
BAR_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """What a fit decides once, when its training starts: whether its steps run in chunks, the
    callbacks that say when they act (`due_at`), its transition watchers (dense steps), and what
    the trainer fixes for the fit: `max_steps`, the validation interval in steps (`val_every`,
    0: none), Lightning's count of steps in chunks (`steps`) and, with a progress bar,
    `bar_seconds` (`BAR_SECONDS`)."""

    trainer: pl.Trainer
    chunked: bool
    due: tuple
    watchers: tuple
    max_steps: int = -1
    val_every: int = 0
    steps: Any = None
    bar_seconds: float | None = None

    @classmethod
    def of(cls, trainer: pl.Trainer, chunked: bool, steps=None) -> "FitPlan":
        callbacks = trainer.callbacks
        interval = trainer.val_check_batch
        bar = trainer.progress_bar_callback
        return cls(trainer, chunked, tuple(cb for cb in callbacks if hasattr(cb, "due_at")),
                   tuple(cb for cb in callbacks if isinstance(cb, TransitionWatcher)), trainer.max_steps,
                   interval if trainer.enable_validation and isinstance(interval, int) else 0, steps,
                   BAR_SECONDS if bar is not None and bar.is_enabled else None)


def padded(batch: Batch, length: int) -> Batch:
    """`batch` (any leading dimensions) with every sequence padded at its end to `length`
    positions (token 0, target 0, out of the loss) and `extras["attend"]` marking the real
    positions, which `vectorised_outputs` masks the padding out of attention by: what the
    vectorised step trains on, so that a RASP population's lengths are one pass. As it is when
    its sequences already have `length` positions."""
    pad = length - batch.tokens.shape[-1]
    if pad <= 0:
        return batch

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(*t.shape[:-1], pad)], dim=-1)

    attend = fill(torch.ones_like(batch.loss_mask))
    return Batch(fill(batch.tokens), fill(batch.targets), fill(batch.loss_mask), {"attend": attend})


def vectorised_outputs(module: torch.nn.Module, params: dict[str, torch.Tensor], batch: Batch, shared: bool,
                       counts: bool, loss_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One pass of `module` for a stack of members (`params`: every parameter with a leading
    member dimension), `torch.func.vmap` of `functional_call`: per member, the mean loss over
    answer tokens `loss` and, with `counts`, `loss_sum`, `tokens`, `correct` and `seq_ok`.
    `batch` is one batch for every member (`shared`) or the members' batches stacked; a batch
    `padded` passes its `attend` to the model as the attention mask. The population's step
    (training/population.py), and a member's re-run alone (`vectorised`)."""
    from torch.func import vmap

    attend = batch.extras.get("attend")

    def one(params, tokens, targets, mask, attend):
        logits = call_with(module, params, (tokens,) if attend is None else (tokens, attend))
        return answer_outputs(logits, targets, mask, counts, loss_dtype)

    # A stack of one takes other paths through PyTorch's batched kernels than a stack of two or
    # more (the key bias's gradient, zero in exact arithmetic, then differs in its last bits), so
    # it runs beside a detached copy of itself: every stack size then rounds alike
    # (tests/unit/test_population.py)
    alone = next(iter(params.values())).shape[0] == 1
    if alone:
        params = {name: torch.cat([p, p.detach()]) for name, p in params.items()}
        if not shared:
            batch = Batch(*(torch.cat([t, t]) for t in (batch.tokens, batch.targets, batch.loss_mask)))
            attend = None if attend is None else torch.cat([attend, attend])
    data = None if shared else 0
    with parameters_kept(module):
        out = vmap(one, in_dims=(0, data, data, data, None if attend is None else data))(
            params, batch.tokens, batch.targets, batch.loss_mask, attend)
    return {key: value[:1] for key, value in out.items()} if alone else out


def answer_outputs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, counts: bool,
                   loss_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`vectorised_outputs`' values from logits (..., batch, positions, classes) of one member
    (inside vmap) or of a stack of members (a leading member dimension: `stacked_outputs`):
    every position's cross-entropy weighted by the mask (`masked_mean_loss` without boolean
    indexing, which vmap cannot do) and summed per member, the same reductions either way."""
    per = F.cross_entropy(logits.to(loss_dtype).flatten(0, -2), targets.flatten(), reduction="none")
    answers = mask.flatten(-2)
    loss_sum, tokens = (per.view(answers.shape) * answers).sum(-1), answers.sum(-1)
    out = {"loss": loss_sum / tokens}
    if counts:
        right = (logits.argmax(-1) == targets) & mask
        out |= {"loss_sum": loss_sum, "tokens": tokens, "correct": right.flatten(-2).sum(-1),
                "seq_ok": (right | ~mask).all(-1).sum(-1)}
    return out


def emit(loggers: list, metrics: dict[str, float], step: int) -> None:
    """Hand values to loggers as Lightning's logger connector does: `step` (the step whose
    weights gave them) is the x-axis, not a value."""
    for logger in loggers:
        logger.log_metrics(metrics, step)
        logger.save()


def adamw_with_warmup(params, hp: Mapping[str, Any], fused: bool) -> dict[str, Any]:
    """AdamW and its linear warm-up, lr * min(step / warmup_steps, 1), stepped every step: what
    `configure_optimizers` returns for TrainModule and PopulationModule. `hp` holds `lr`,
    `weight_decay`, `betas` and `warmup_steps`. With `fused` (on accelerators) AdamW runs as
    one kernel per step and can skip a step on the device (its `found_inf`); otherwise each of its
    operations is one call over all tensors (`foreach`: on the CPU, the same updates bit for bit as
    PyTorch's default for-loop there, in fewer host calls; tests/unit/test_adamw_foreach.py)."""
    opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"], betas=tuple(hp["betas"]),
                            fused=True if fused else None, foreach=None if fused else True)
    warmup = hp["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup) if warmup else 1.0)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

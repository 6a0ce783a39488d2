"""The Task protocol, the batch format every task produces, and the task registry.

A task is data only: it says what the tokens are, how big the vocabulary and context
are, which positions carry a loss, and hands out training batches (a pure function of
the data seed and the step, so a resumed run sees exactly the batches it would have
seen) and a fixed validation set. A task never builds or imports a model.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Int
from torch import Tensor

from phasewatch.errors import ConfigError, require, require_int


@dataclasses.dataclass(frozen=True)
class Batch:
    """Tokens in, one target per position, and which positions count in the loss.

    `targets[b, i]` is what the model should output at position `i` (ids in the task's
    output vocabulary); entries where `loss_mask` is False are ignored (set to 0).
    `extras` holds task-specific tensors indexed by batch first that probes use, e.g.
    the boolean (batch, pos) masks `first_copy` / `second_copy` for induction, or the
    (batch,) `length` of each sequence.
    """

    tokens: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]
    loss_mask: Bool[Tensor, "batch pos"]
    extras: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.tokens.shape == self.targets.shape == self.loss_mask.shape):
            raise ValueError(
                f"Batch tensors disagree in shape: tokens {tuple(self.tokens.shape)}, "
                f"targets {tuple(self.targets.shape)}, loss_mask {tuple(self.loss_mask.shape)}"
            )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _map(self, fn) -> "Batch":
        return Batch(fn(self.tokens), fn(self.targets), fn(self.loss_mask), {k: fn(v) for k, v in self.extras.items()})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """A copy in page-locked memory (the DataLoader calls it with pin_memory=True)."""
        return self._map(torch.Tensor.pin_memory)

    def spread(self, n: int) -> "Batch":
        """At most `n` of its sequences, spread evenly over the batch (all of them when it holds no more)."""
        if n >= len(self):
            return self
        return self.take(spread_index(len(self), n))

    def take(self, index: Tensor | slice) -> "Batch":
        """The sequences at `index` (a 1-d tensor of row numbers, in its order, or a slice: views)."""
        return self._map(lambda t: t[index])


def spread_index(size: int, n: int) -> Tensor:
    """The row numbers of `Batch.spread`: min(n, size) of 0..size-1, spread evenly over them."""
    if n >= size:
        return torch.arange(size)
    return torch.linspace(0, size - 1, n).round().long().unique()


def padded(batches: list[Batch]) -> tuple[Batch, Tensor | None]:
    """The batches as one, their sequences padded at the end to the longest, and the
    attention mask [batch, pos] (1 for a real position) that keeps a padded position out of
    every real one's attention; None when all have one length (nothing padded). Padded
    positions carry no loss and token 0; 2-d extras are padded with zeros, 1-d ones joined.
    One forward pass over it gives every sequence what a pass of its own batch gives (up to
    float rounding), which costs far less than one pass per length (a RASP task's held-out
    set holds one batch per length)."""
    width = max(b.tokens.shape[1] for b in batches)

    def pad(t: Tensor) -> Tensor:
        return F.pad(t, (0, width - t.shape[1])) if t.dim() == 2 else t

    joined = Batch(torch.cat([pad(b.tokens) for b in batches]), torch.cat([pad(b.targets) for b in batches]),
                   torch.cat([pad(b.loss_mask) for b in batches]),
                   {k: torch.cat([pad(b.extras[k]) for b in batches]) for k in batches[0].extras})
    if all(b.tokens.shape[1] == width for b in batches):
        return joined, None
    return joined, torch.cat([pad(torch.ones_like(b.tokens)) for b in batches])


def mask_kwargs(mask: Tensor | None, device: torch.device | str) -> dict[str, Tensor]:
    """The forward pass's keyword for `padded`'s attention mask (none when nothing is padded)."""
    return {} if mask is None else {"attention_mask": mask.to(device)}


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, step, stream).

    Training batches are drawn from `step_generator(seed, step)`, so a resumed run draws
    the same batch at the same step; `stream` separates independent uses (validation
    data uses stream 1).
    """
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + stream) * 1_000_000_007 + step) % (2**63 - 1))
    return g


def minibatch(pool: Batch, size: int | None, seed: int, step: int) -> Batch:
    """`size` examples of a finite set, drawn without replacement by
    `step_generator(seed, step)`; the whole set when `size` is None or not smaller."""
    if size is None or size >= len(pool):
        return pool
    idx = torch.randperm(len(pool), generator=step_generator(seed, step))[:size]
    return Batch(pool.tokens[idx], pool.targets[idx], pool.loss_mask[idx], {k: v[idx] for k, v in pool.extras.items()})


class Task(abc.ABC):
    """What every task provides. Subclasses are registered by `register_task`.

    Use `make_task(name, **kwargs)` to build one by its registry name, or pass the class
    on the command line (`--data.task ModularAddition --data.task.p 97`). Invalid
    arguments raise ConfigError from `__init__`, before any training.
    """

    name: ClassVar[str]
    #: True when a training "step" uses the whole training set (grokking); False when
    #: every step draws a fresh batch (streaming tasks).
    full_batch: ClassVar[bool] = False

    seed: int

    @property
    @abc.abstractmethod
    def d_vocab(self) -> int:
        """Number of input token ids."""

    @property
    def d_vocab_out(self) -> int:
        """Number of output classes (the unembedding's width). Defaults to d_vocab."""
        return self.d_vocab

    @property
    @abc.abstractmethod
    def n_ctx(self) -> int:
        """The longest input sequence this task produces."""

    @property
    def loss_dtype(self) -> torch.dtype:
        """Dtype in which the cross-entropy is computed (grokking needs float64)."""
        return torch.float32

    @property
    def causal(self) -> bool:
        """Whether the task can be solved with causal attention (False for tracr programs
        that read later positions, like reverse)."""
        return True

    @abc.abstractmethod
    def train_batch(self, step: int, batch_size: int | None) -> Batch:
        """The training batch at `step` (a pure function of seed and step). `batch_size`
        None means the task's natural size (the full training set for full-batch tasks)."""

    def train_batches(self, seeds: list[int], step: int, batch_size: int | None) -> Batch | None:
        """The training batches at `step` of this task with each data seed of `seeds` (its
        other arguments the same), stacked along a leading dimension, extras left out: entry k
        is `train_batch` of the task with seed `seeds[k]`. Drawn in one call for a population
        (training/population.py); None (the default) where a task draws them one by one."""
        return None

    @abc.abstractmethod
    def val_batches(self) -> list[Batch]:
        """The fixed held-out set, as one or more batches (several when lengths differ)."""

    def val_groups(self) -> list[str]:
        """The key prefix each of `val_batches()` is reported under, in the same order:
        "val" (`val/loss`, `val/acc`, ...) for the held-out set. A task may name a second
        set, as RASP tasks' "val_longer" for lengths longer than any trained on."""
        return ["val"] * len(self.val_batches())

    def default_model(self) -> dict[str, Any]:
        """Architecture defaults for this task (keys of the trainer's ModelConfig)."""
        return {}



_REGISTRY: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: register a Task subclass under `name`; duplicate names are refused."""

    def decorate(cls: type[Task]) -> type[Task]:
        if name in _REGISTRY:
            raise ValueError(f"task name {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def task_names() -> list[str]:
    """Every registered task, those of installed plug-ins (entry points `phasewatch.tasks`) included."""
    from phasewatch.plugins import load_entry_points

    load_entry_points("phasewatch.tasks")
    return sorted(_REGISTRY)


def task_class(name: str) -> type[Task]:
    if name not in task_names():
        raise ConfigError("task", f"unknown task {name!r}", f"Choose one of: {', '.join(task_names())}.")
    return _REGISTRY[name]


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task by name, e.g. `make_task("modular_addition", p=113)`."""
    return task_class(name)(**kwargs)


def masked_loss(logits: torch.Tensor, batch: Batch, loss_dtype: torch.dtype) -> torch.Tensor:
    """Cross-entropy (in `loss_dtype`) over the batch's loss positions."""
    return F.cross_entropy(logits[batch.loss_mask].to(loss_dtype), batch.targets[batch.loss_mask])


def masked_mean_loss(logits: torch.Tensor, batch: Batch, loss_dtype: torch.dtype) -> torch.Tensor:
    """`masked_loss` without boolean indexing: every position's cross-entropy, weighted by the
    mask. The same number (up to the order of summation), with shapes that do not depend on
    the mask, so that it runs under `torch.func.vmap` (the LLC's chains side by side)."""
    per = F.cross_entropy(logits.to(loss_dtype).flatten(0, -2), batch.targets.flatten(), reduction="none")
    weight = batch.loss_mask.flatten().to(per.dtype)
    return (per * weight).sum() / weight.sum()


def masked_loss_and_acc(
    logits: torch.Tensor, batch: Batch, loss_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy (in `loss_dtype`) and accuracy over the batch's loss positions."""
    picked = logits[batch.loss_mask].to(loss_dtype)
    targets = batch.targets[batch.loss_mask]
    return F.cross_entropy(picked, targets), (picked.argmax(-1) == targets).float().mean()

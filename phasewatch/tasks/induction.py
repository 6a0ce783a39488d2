"""Repeated random segments: the task on which induction heads form (Olsson et al. 2022).

Each sequence is BOS, a random segment of random length L in [min_len, max_len], the
same segment again, then random filler up to `seq_len` tokens. The repeat offset L varies
per sequence: with a fixed offset a model learns a positional shortcut instead of
induction (see docs/reference.md). Next-token loss on every position.

`extras` masks (both of shape batch x pos, over input positions):
- `first_copy`: positions predicting tokens 2..L of the first copy (not predictable);
- `second_copy`: positions predicting tokens 2..L of the second copy (predictable by
  induction). The in-context-learning gap is loss(second_copy) - loss(first_copy).
"""

from __future__ import annotations

from typing import Any

import torch

from phasewatch.tasks.base import Batch, Task, register_task, require, require_int, step_generator
from phasewatch.errors import ConfigError


@register_task("induction")
class Induction(Task):
    """Args:
    vocab_size: random tokens are 0..vocab_size-1; BOS is vocab_size.
    seq_len: tokens per sequence including BOS (the model sees seq_len - 1 inputs).
    min_len, max_len: range of the repeated segment's length.
    batch_size: sequences per step; n_val: size of the fixed held-out set; seed: data seed.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 33,
        min_len: int = 4,
        max_len: int = 16,
        batch_size: int = 32,
        n_val: int = 512,
        seed: int = 0,
    ):
        require_int(vocab_size, "data.task.vocab_size", 2, "Use at least 2 tokens (the reference uses 64).")
        require_int(min_len, "data.task.min_len", 2, "Segments need at least 2 tokens for a copy to be predictable.")
        require_int(max_len, "data.task.max_len", min_len, "Set max_len >= min_len.")
        require_int(seq_len, "data.task.seq_len", 2)
        if 1 + 2 * max_len > seq_len:
            raise ConfigError(
                "data.task.seq_len",
                f"{seq_len} tokens cannot hold BOS plus two copies of a {max_len}-token segment",
                f"Set seq_len >= {1 + 2 * max_len} or lower max_len.",
            )
        require_int(batch_size, "data.task.batch_size", 1)
        require_int(n_val, "data.task.n_val", 1)
        require_int(seed, "data.task.seed", 0)
        self.vocab_size, self.seq_len, self.min_len, self.max_len = vocab_size, seq_len, min_len, max_len
        self.batch_size, self.n_val, self.seed = batch_size, n_val, seed
        self._val = self.make_batch(step_generator(seed, 0, stream=1), n_val)

    @property
    def bos(self) -> int:
        return self.vocab_size

    @property
    def d_vocab(self) -> int:
        return self.vocab_size + 1

    @property
    def n_ctx(self) -> int:
        return self.seq_len - 1

    def make_batch(self, generator: torch.Generator, size: int) -> Batch:
        return self._assemble(*self._draw(generator, size), extras=True)

    def _draw(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's random draws: the tokens (BOS not yet in place) and the segments' lengths."""
        seq = torch.randint(0, self.vocab_size, (size, self.seq_len), generator=generator)
        lengths = torch.randint(self.min_len, self.max_len + 1, (size,), generator=generator)
        return seq, lengths

    def _assemble(self, seq: torch.Tensor, lengths: torch.Tensor, extras: bool) -> Batch:
        """The batch of `_draw`'s draws, over any leading dimensions (a population's members)."""
        seq[..., 0] = self.bos
        pos = torch.arange(self.seq_len)
        L = lengths[..., None]
        second = (pos >= 1 + L) & (pos < 1 + 2 * L)
        # copy the first segment into the second: position q in the second copy reads q - L
        seq = torch.gather(seq, -1, torch.where(second, pos - L, pos))
        tokens, targets = seq[..., :-1].contiguous(), seq[..., 1:].contiguous()
        mask = torch.ones_like(tokens, dtype=torch.bool)
        if not extras:
            return Batch(tokens, targets, mask)
        ipos = torch.arange(self.seq_len - 1)
        first_copy = (ipos >= 1) & (ipos <= L - 1)
        second_copy = (ipos >= L + 1) & (ipos <= 2 * L - 1)
        return Batch(tokens, targets, mask, {"first_copy": first_copy, "second_copy": second_copy, "length": lengths})

    def train_batch(self, step: int, batch_size: int | None) -> Batch:
        return self.make_batch(step_generator(self.seed, step), batch_size or self.batch_size)

    def train_batches(self, seeds: list[int], step: int, batch_size: int | None) -> Batch:
        draws = [self._draw(step_generator(seed, step), batch_size or self.batch_size) for seed in seeds]
        return self._assemble(torch.stack([d[0] for d in draws]), torch.stack([d[1] for d in draws]), extras=False)

    def val_batches(self) -> list[Batch]:
        return [self._val]

    def default_model(self) -> dict[str, Any]:
        # docs/reference.md's CPU-sized reference: 2 layers, attention only, no LayerNorm,
        # d_model 64, 4 heads of 16.
        return dict(n_layers=2, d_model=64, n_heads=4, d_head=16, attn_only=True, normalization="none")

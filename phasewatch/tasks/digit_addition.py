"""n-digit addition (Nanda et al. 2023, appendix: 5-digit addition with infinite data).

Sequence `a_1..a_n + b_1..b_n = c_0..c_n`, most significant digit first; the answer has
n+1 digits, the first being the final carry (0 or 1). The model sees the sequence minus
its last token and predicts the next token; only the n+1 positions that predict answer
digits carry a loss. Answer token i (0 = the carry) is predicted at position
`answer_positions[i]`; per-token loss and accuracy use that.
"""

from __future__ import annotations

from typing import Any

import torch

from phasewatch.tasks.base import Batch, Task, minibatch, register_task, require, require_int, step_generator

PLUS, EQUALS = 10, 11


@register_task("digit_addition")
class DigitAddition(Task):
    """Addition of two n-digit numbers, fresh random problems every step or a finite set.

    Args:
        n_digits: digits per operand (default 5).
        n_train: None for infinite data (fresh problems every step, as in the paper);
            an integer for a fixed training set of that many problems.
        batch_size: problems per step (paper: 64).
        n_val: size of the fixed held-out set.
        seed: data seed.
    """

    def __init__(
        self, n_digits: int = 5, n_train: int | None = None, batch_size: int = 64, n_val: int = 1024, seed: int = 0
    ):
        require_int(n_digits, "data.task.n_digits", 1, "Use at least 1 digit (the paper uses 5).")
        require(n_digits <= 18, "data.task.n_digits", f"{n_digits} digits overflow 64-bit integers", "Use at most 18 digits.")
        if n_train is not None:
            require_int(n_train, "data.task.n_train", 1, "Use a positive size, or null for infinite data.")
        require_int(batch_size, "data.task.batch_size", 1)
        require_int(n_val, "data.task.n_val", 1)
        require_int(seed, "data.task.seed", 0)
        self.n_digits, self.n_train, self.batch_size, self.n_val, self.seed = n_digits, n_train, batch_size, n_val, seed
        self._val = self.make_batch(step_generator(seed, 0, stream=1), n_val)
        self._train = None if n_train is None else self.make_batch(step_generator(seed, 0, stream=2), n_train)

    def make_batch(self, generator: torch.Generator, size: int) -> Batch:
        n = self.n_digits
        a_digits = torch.randint(0, 10, (size, n), generator=generator)
        b_digits = torch.randint(0, 10, (size, n), generator=generator)
        powers = 10 ** torch.arange(n - 1, -1, -1)
        total = (a_digits * powers).sum(-1) + (b_digits * powers).sum(-1)
        answer_powers = 10 ** torch.arange(n, -1, -1)
        c_digits = (total[:, None] // answer_powers) % 10
        seq = torch.cat(
            [a_digits, torch.full((size, 1), PLUS), b_digits, torch.full((size, 1), EQUALS), c_digits], dim=1
        )
        tokens, targets = seq[:, :-1], seq[:, 1:].clone()
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[:, self.answer_positions] = True
        targets[~mask] = 0
        return Batch(tokens.contiguous(), targets.contiguous(), mask)

    @property
    def answer_positions(self) -> list[int]:
        """Input positions whose prediction is answer token 0 (the carry), 1, ..., n."""
        first = 2 * self.n_digits + 1  # the '=' position predicts c_0
        return list(range(first, first + self.n_digits + 1))

    @property
    def d_vocab(self) -> int:
        return 12

    @property
    def n_ctx(self) -> int:
        return 3 * self.n_digits + 2

    def train_batch(self, step: int, batch_size: int | None) -> Batch:
        size = batch_size or self.batch_size
        if self._train is None:
            return self.make_batch(step_generator(self.seed, step), size)
        return minibatch(self._train, size, self.seed, step)

    def val_batches(self) -> list[Batch]:
        return [self._val]

    def default_model(self) -> dict[str, Any]:
        # The paper's digit-addition runs use a 1-layer transformer.
        return dict(n_layers=1, d_model=128, n_heads=4, d_head=32, d_mlp=512, act_fn="relu", normalization="none")

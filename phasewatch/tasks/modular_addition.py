"""Modular arithmetic, the grokking task of Power et al. 2022 and Nanda et al. 2023.

Input `[a, b, =]` with `=` the token `p`; the answer `(a op b) mod p` is read at the last
position only. The split follows the progress-measures paper's code: all pairs in
row-major order (a outer, b inner), `random.seed(seed)`, `random.shuffle`, the first
`int(frac_train * n)` pairs train and the rest test (3,830 of 12,769 at p=113, 30%).
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from phasewatch.tasks.base import Batch, Task, minibatch, register_task, require, require_int

OPS = ("+", "-", "*", "/")


def is_prime(n: int) -> bool:
    """Whether n is a prime number (trial division)."""
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


#: bytes per pair while the table is built: a Python tuple of two ints in a list, and its rows of
#: tokens, targets (int64) and loss mask (bool)
PAIR_BYTES = 120 + 3 * 8 * 2 + 3


def full_batch_bytes(n_pairs: int, d_vocab: int) -> int:
    """About the memory of the full-batch table of `n_pairs` pairs and of one float32 forward
    pass's logits over it (3 positions x `d_vocab`): what training on it needs at the least."""
    return n_pairs * (PAIR_BYTES + 3 * d_vocab * 4)


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@register_task("modular_addition")
class ModularAddition(Task):
    """(a op b) mod p for op in + - * / (division multiplies by the modular inverse of b,
    so b ranges over 1..p-1 and p must be prime). Full-batch training; loss in float64.

    Args:
        p: the modulus (>= 2; the Fourier progress measures additionally need an odd prime).
        op: one of "+", "-", "*", "/".
        frac_train: fraction of all pairs used for training, in (0, 1).
        seed: the split seed (the paper's `random.seed(seed)`).
    """

    full_batch = True

    def __init__(self, p: int = 113, op: str = "+", frac_train: float = 0.3, seed: int = 0):
        require_int(p, "data.task.p", 2, "Use a modulus of at least 2, e.g. 113 as in Nanda et al. 2023.")
        require(op in OPS, "data.task.op", f"unknown operation {op!r}", f"Use one of {', '.join(OPS)}.")
        require(
            op != "/" or is_prime(p),
            "data.task.p",
            f"division mod {p} needs every nonzero b to be invertible, but {p} is not prime",
            "Use a prime modulus with op '/'.",
        )
        require(
            isinstance(frac_train, (int, float)) and not isinstance(frac_train, bool) and 0 < frac_train < 1,
            "data.task.frac_train",
            f"must lie strictly between 0 and 1, got {frac_train!r}",
            "Use e.g. 0.3 (the paper's training fraction).",
        )
        require_int(seed, "data.task.seed", 0)
        n_pairs = p * (p - 1 if op == "/" else p)
        need, have = full_batch_bytes(n_pairs, p + 1), physical_memory()
        require(have is None or need <= have, "data.task.p",
                f"p = {p} gives {n_pairs:,} pairs, and the full-batch table with one forward pass over it needs "
                f"about {need / 2**30:,.1f} GiB, more than this machine's {(have or 0) / 2**30:,.1f} GiB",
                f"Use a smaller modulus (p = 113, as in Nanda et al. 2023, needs "
                f"{full_batch_bytes(113 * 113, 114) / 2**30:.2f} GiB).")
        self.p, self.op, self.frac_train, self.seed = p, op, float(frac_train), seed
        pairs = self.all_pairs()
        state = random.getstate()  # the paper's procedure, without disturbing the global RNG
        random.seed(seed)
        random.shuffle(pairs)
        random.setstate(state)
        n_train = int(self.frac_train * len(pairs))
        require(
            0 < n_train < len(pairs),
            "data.task.frac_train",
            f"{frac_train} of {len(pairs)} pairs leaves an empty train or test set",
            "Choose a fraction that keeps at least one pair on each side.",
        )
        self._train = self._batch(pairs[:n_train])
        self._test = self._batch(pairs[n_train:])

    def all_pairs(self) -> list[tuple[int, int]]:
        """All (a, b) inputs in row-major order (a outer, b inner)."""
        bs = range(1, self.p) if self.op == "/" else range(self.p)
        return [(a, b) for a in range(self.p) for b in bs]

    def answer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p = self.p
        if self.op == "+":
            return (a + b) % p
        if self.op == "-":
            return (a - b) % p
        if self.op == "*":
            return (a * b) % p
        return (a * torch.tensor([pow(int(x), -1, p) for x in b])) % p

    def _batch(self, pairs: list[tuple[int, int]]) -> Batch:
        ab = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        tokens = torch.cat([ab, torch.full((len(ab), 1), self.p)], dim=1)
        targets = torch.zeros_like(tokens)
        targets[:, -1] = self.answer(ab[:, 0], ab[:, 1])
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[:, -1] = True
        return Batch(tokens, targets, mask)

    @property
    def equals_token(self) -> int:
        return self.p

    @property
    def d_vocab(self) -> int:
        return self.p + 1

    @property
    def n_ctx(self) -> int:
        return 3

    @property
    def loss_dtype(self) -> torch.dtype:
        return torch.float64

    def train_set(self) -> Batch:
        return self._train

    def train_batch(self, step: int, batch_size: int | None) -> Batch:
        return minibatch(self._train, batch_size, self.seed, step)

    def val_batches(self) -> list[Batch]:
        return [self._test]

    def default_model(self) -> dict[str, Any]:
        # Nanda et al. 2023: 1 layer, d_model 128, 4 heads of 32, d_mlp 512, ReLU, no
        # LayerNorm, attention without biases.
        return dict(
            n_layers=1, d_model=128, n_heads=4, d_head=32, d_mlp=512, act_fn="relu",
            attn_only=False, normalization="none", attn_bias=False,
        )

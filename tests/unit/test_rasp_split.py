"""A RASP task's split and batches from the process's shared tables (tasks/rasp.py): the held-out
set and training batches equal those worked out from the definitions (`split_score`, `encode`)."""

import itertools

import pytest
import torch

from phasewatch.tasks import make_task
from phasewatch.tasks.base import step_generator
from phasewatch.tasks.rasp import _enumerated, _scores, split_score


@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_the_scores_of_a_length_are_split_score_of_each_input(seed):
    """Every input of lengths 1-6 over 5 tokens (19,530): the vectorised scores are the floats
    `split_score` gives, bit for bit (its int / 2**64 rounds once; so does the array's)."""
    for n in range(1, 7):
        inputs, messages = _enumerated((1, 2, 3, 4, 5), False, n)
        assert inputs == tuple(itertools.product((1, 2, 3, 4, 5), repeat=n))
        assert _scores(seed, messages).tolist() == [split_score(seed, xs) for xs in inputs]


def _batches_equal(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "targets", "loss_mask")) \
        and torch.equal(a.extras["length"], b.extras["length"])


@pytest.mark.parametrize("vocab,n_val,seed", [([1, 2, 3, 4], 256, 3), ([1, 2, 3, 4, 5, 6, 7, 8], 16, 5)])
def test_held_out_set_and_pool_are_those_of_the_definition(vocab, n_val, seed):
    """Per length: the round(0.2 x count) inputs of smallest split_score held out (a stable sort:
    ties in enumeration order), validated on as `encode` of them in enumeration order (a length
    with more than 4,096 held out: n_val of them, evenly spaced), the rest the training pool;
    a training batch is `encode` of the inputs the step's generator draws from that pool. The
    second task of the case fills the shared tables first with another data seed."""
    max_len = 5
    make_task("rasp", program="reverse", vocab=vocab, max_seq_len=max_len, seed=seed + 1, n_val_per_length=n_val)
    task = make_task("rasp", program="reverse", vocab=vocab, max_seq_len=max_len, seed=seed, n_val_per_length=n_val)
    val = iter(task.val_batches())
    for n in range(1, max_len + 1):
        inputs = list(itertools.product(vocab, repeat=n))
        n_held = round(0.2 * len(inputs))
        if n_held < 1:
            continue
        by_score = sorted(range(len(inputs)), key=lambda i: split_score(seed, inputs[i]))
        held = sorted(by_score[:n_held])
        train = [inputs[i] for i in sorted(by_score[n_held:])]
        if len(held) > 4096:
            held = [held[int(i)] for i in torch.linspace(0, len(held) - 1, n_val).round().long().unique()]
        assert _batches_equal(next(val), task.encode([inputs[i] for i in held])), n
        assert list(task._train_pool[n]) == train, n
    assert next(val, None) is None
    for step in range(30):
        g = step_generator(seed, step)
        n = int(torch.randint(1, max_len + 1, (1,), generator=g))
        index = torch.randint(0, len(task._train_pool[n]), (8,), generator=g)
        assert _batches_equal(task.train_batch(step, 8), task.encode([task._train_pool[n][i] for i in index])), step


def test_tasks_of_another_vocabulary_or_length_keep_their_own_tables():
    """The encoded inputs are shared by the tasks of one program, vocabulary and longest input
    only: a task with the tokens in another order (other ids) or another longest input encodes
    its own."""
    tasks = [make_task("rasp", program="reverse", vocab=v, max_seq_len=m, seed=s)
             for v, m, s in (([1, 2, 3], 4, 0), ([3, 2, 1], 4, 1), ([1, 2, 3], 5, 2), ([1, 2, 3], 4, 3))]
    assert tasks[0]._encoded is tasks[3]._encoded
    assert tasks[0]._encoded is not tasks[1]._encoded and tasks[0]._encoded is not tasks[2]._encoded
    for task in tasks:
        for batch in task.val_batches():
            assert _batches_equal(batch, task.encode(task.decode(batch.tokens)))
        for step in range(10):
            batch = task.train_batch(step, 4)
            assert _batches_equal(batch, task.encode(task.decode(batch.tokens)))

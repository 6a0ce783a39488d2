"""Task data: formats, masks, splits, determinism, and known answers."""

import itertools
import random

import pytest
import torch

from phasewatch.tasks import Task, make_task, register_task, task_names
from phasewatch.errors import ConfigError
from phasewatch.tasks.digit_addition import EQUALS, PLUS


def test_registry_lists_every_task_and_refuses_duplicates():
    assert task_names() == ["digit_addition", "induction", "modular_addition", "rasp"]
    with pytest.raises(ValueError, match="already registered"):
        register_task("induction")(type("Other", (Task,), {}))
    with pytest.raises(ConfigError, match="unknown task 'nope'.*modular_addition"):
        make_task("nope")


# --- modular arithmetic ---------------------------------------------------------------

def test_modular_split_follows_the_papers_procedure():
    task = make_task("modular_addition", p=113, frac_train=0.3, seed=1)
    train, test = task.train_set(), task.val_batches()[0]
    assert (len(train), len(test)) == (3830, 12769 - 3830)  # docs/reference.md: 3,830 training pairs
    pairs = [(a, b) for a in range(113) for b in range(113)]
    random.seed(1)
    random.shuffle(pairs)
    assert train.tokens[:, :2].tolist() == [list(x) for x in pairs[:3830]]
    assert test.tokens[:, :2].tolist() == [list(x) for x in pairs[3830:]]


def test_modular_format_and_answers():
    task = make_task("modular_addition", p=7, frac_train=0.5)
    b = task.train_set()
    assert (b.tokens[:, 2] == 7).all() and task.d_vocab == 8 and task.n_ctx == 3
    assert b.loss_mask.tolist() == [[False, False, True]] * len(b)
    a_, b_ = b.tokens[:, 0], b.tokens[:, 1]
    assert torch.equal(b.targets[:, 2], (a_ + b_) % 7)
    assert task.loss_dtype == torch.float64 and task.full_batch
    # train and test together cover every pair exactly once
    both = torch.cat([b.tokens, task.val_batches()[0].tokens])[:, :2]
    assert sorted(map(tuple, both.tolist())) == [(a, c) for a in range(7) for c in range(7)]


@pytest.mark.parametrize("op,check", [
    ("-", lambda a, b, c, p: (a - b - c) % p == 0),
    ("*", lambda a, b, c, p: (a * b - c) % p == 0),
    ("/", lambda a, b, c, p: (c * b - a) % p == 0 and b != 0),
])
def test_modular_operations(op, check):
    p = 11
    task = make_task("modular_addition", p=p, op=op, frac_train=0.5)
    for batch in (task.train_set(), task.val_batches()[0]):
        for (a, b, _), c in zip(batch.tokens.tolist(), batch.targets[:, 2].tolist()):
            assert check(a, b, c, p)
    n = sum(len(x) for x in (task.train_set(), task.val_batches()[0]))
    assert n == (p * (p - 1) if op == "/" else p * p)


def test_modular_split_is_deterministic_per_seed():
    t1, t2, t3 = (make_task("modular_addition", p=23, seed=s) for s in (0, 0, 1))
    assert torch.equal(t1.train_set().tokens, t2.train_set().tokens)
    assert not torch.equal(t1.train_set().tokens, t3.train_set().tokens)


@pytest.mark.parametrize("kwargs,field", [
    (dict(p=1), "data.task.p"),
    (dict(p=12, op="/"), "data.task.p"),
    (dict(frac_train=0.0), "data.task.frac_train"),
    (dict(frac_train=1.5), "data.task.frac_train"),
    (dict(op="^"), "data.task.op"),
    (dict(p="113"), "data.task.p"),
])
def test_modular_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        make_task("modular_addition", **kwargs)
    assert err.value.field == field and err.value.fix


# --- digit addition -------------------------------------------------------------------

def test_digit_addition_answers_masks_and_carry_first():
    task = make_task("digit_addition", n_digits=5)
    b = task.train_batch(0, 256)
    seq = torch.cat([b.tokens, b.targets[:, -1:]], dim=1)  # the full sequence
    assert seq.shape[1] == 18 and task.n_ctx == 17
    for row in seq.tolist():
        a = int("".join(map(str, row[0:5])))
        c = int("".join(map(str, row[6:11])))
        assert row[5] == PLUS and row[11] == EQUALS
        assert int("".join(map(str, row[12:18]))) == a + c  # 6 answer digits, carry first
    assert task.answer_positions == [11, 12, 13, 14, 15, 16]
    assert b.loss_mask[:, task.answer_positions].all() and b.loss_mask.sum() == 6 * 256
    # the targets at answer positions are the answer digits, in order
    assert torch.equal(b.targets[:, task.answer_positions], seq[:, 12:18])


def test_digit_addition_infinite_data_is_a_function_of_seed_and_step():
    t = make_task("digit_addition", seed=3)
    assert torch.equal(t.train_batch(5, 32).tokens, make_task("digit_addition", seed=3).train_batch(5, 32).tokens)
    assert not torch.equal(t.train_batch(5, 32).tokens, t.train_batch(6, 32).tokens)
    finite = make_task("digit_addition", n_train=100)
    pool = {tuple(r) for r in finite.train_batch(0, 1000).tokens.tolist()}  # >= the set: all of it
    assert len(pool) == 100 and {tuple(r) for r in finite.train_batch(7, 10).tokens.tolist()} <= pool


@pytest.mark.parametrize("kwargs", [dict(n_digits=0), dict(n_train=0), dict(batch_size=-1)])
def test_digit_addition_bad_input(kwargs):
    with pytest.raises(ConfigError):
        make_task("digit_addition", **kwargs)


# --- induction ------------------------------------------------------------------------

def test_induction_sequences_repeat_with_varying_offset():
    task = make_task("induction", vocab_size=50, seq_len=33, min_len=4, max_len=16)
    b = task.train_batch(0, 200)
    seq = torch.cat([b.tokens, b.targets[:, -1:]], dim=1)
    assert (seq[:, 0] == task.bos).all() and task.d_vocab == 51 and task.n_ctx == 32
    lengths = b.extras["length"]
    assert len(set(lengths.tolist())) > 5  # the offset varies per sequence
    for row, L, second in zip(seq.tolist(), lengths.tolist(), b.extras["second_copy"]):
        assert row[1:1 + L] == row[1 + L:1 + 2 * L]
        # second_copy marks the positions whose next token is predictable by induction
        pos = second.nonzero().flatten().tolist()
        assert pos == list(range(L + 1, 2 * L))
        assert all(row[p + 1] == row[p + 1 - L] for p in pos)
    assert torch.equal(b.extras["first_copy"].sum(1), lengths - 1)


def test_induction_context_too_short_is_refused():
    with pytest.raises(ConfigError, match="seq_len") as err:
        make_task("induction", seq_len=20, max_len=16)
    assert "33" in err.value.fix


# --- rasp -----------------------------------------------------------------------------

@pytest.mark.parametrize("program", ["reverse", "sort", "hist", "length", "sort_freq", "frac_prevs"])
def test_rasp_targets_equal_tracrs_evaluator(program):
    task = make_task("rasp", program=program)
    inverse_out = {i: v for v, i in task.output_encoding.items()}
    for step in range(6):
        b = task.train_batch(step, 16)
        assert len(set(b.extras["length"].tolist())) == 1  # one length per batch
        assert (b.tokens[:, 0] == task.bos).all() and not b.loss_mask[:, 0].any()
        for xs, targets in zip(task.decode(b.tokens), b.targets.tolist()):
            assert [inverse_out[t] for t in targets[1:]] == task.program.evaluate(xs)


def test_rasp_a_training_batch_is_the_encoding_of_the_inputs_it_draws():
    """A batch is an index into its length's pool, encoded once: tensor for tensor what
    encoding the inputs drawn from the step's generator gives (lengths 1-5, some drawn again)."""
    from phasewatch.tasks.base import step_generator

    task = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5)
    for step in range(40):
        g = step_generator(task.seed, step)
        n = int(torch.randint(task.min_seq_len, task.train_max_seq_len + 1, (1,), generator=g))
        drawn, batch = task.encode(task.train_inputs(g, n, 8)), task.train_batch(step, 8)
        for field in ("tokens", "targets", "loss_mask"):
            assert torch.equal(getattr(batch, field), getattr(drawn, field)), (step, field)
        assert torch.equal(batch.extras["length"], drawn.extras["length"])


def test_rasp_tasks_of_one_program_share_its_outputs_whatever_their_data_seed():
    """The program's outputs (tracr's evaluator, the costly part) are worked out once per input
    for every task of one program, vocabulary and length: a population's members share them."""
    task, other_seed = (make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5, seed=s) for s in (0, 1))
    assert task._memo is other_seed._memo and len(task._memo) >= len(_inputs(task, task.val_batches()))
    longer = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=4)
    assert longer._memo is not task._memo
    assert make_task("rasp", program="reverse", vocab=[1, 2], max_seq_len=5, val_fraction=0.3)._memo is not task._memo
    assert other_seed.output_ids((3, 1, 2)) == [task.output_encoding[v] for v in (2, 1, 3)]


def test_rasp_reverse_values_and_intermediates():
    task = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5)
    assert task.program.evaluate((1, 2, 3, 3)) == [3, 3, 2, 1]
    inter = task.program.intermediates((1, 2, 3, 3))
    assert inter["length"] == [4, 4, 4, 4] and inter["opp_idx"] == [4, 3, 2, 1]
    assert inter["opp_idx-1"] == [3, 2, 1, 0] and inter["reverse"] == [3, 3, 2, 1]
    # validation holds out 20% of every length 1..5 (3**n inputs), one batch per length
    assert [len(b) for b in task.val_batches()] == [1, 2, 5, 16, 49]


def _inputs(task, batches):
    return {xs for b in batches for xs in task.decode(b.tokens)}


def test_rasp_validation_is_held_out_from_training():
    task = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5)
    held = _inputs(task, task.val_batches())
    trained = _inputs(task, [task.train_batch(step, 64) for step in range(400)])
    assert not held & trained
    for n in range(1, 6):  # the split is exact per length, and training reaches the rest of each length
        held_n = {xs for xs in held if len(xs) == n}
        assert len(held_n) == round(0.2 * 3**n)
        assert all(task.held_out(xs) for xs in held_n)
        if n <= 3:
            assert {xs for xs in trained if len(xs) == n} == set(task.all_inputs(n)) - held_n
    # held out: the inputs of smallest split_score
    from phasewatch.tasks.rasp import split_score

    by_score = sorted(itertools.product([1, 2, 3], repeat=4), key=lambda xs: split_score(0, xs))
    assert {xs for xs in held if len(xs) == 4} == set(by_score[:16])
    # deterministic: the same seed gives the same split (split once in the process), another seed another one
    again = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5)
    assert _inputs(task, again.val_batches()) == held and again._train_pool[4] is task._train_pool[4]
    assert _inputs(task, make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5,
                                   seed=1).val_batches()) != held


def test_rasp_a_length_too_small_to_split_is_trained_on_and_said_so():
    with pytest.warns(UserWarning, match=r"lengths \[1\] have too few inputs"):
        task = make_task("rasp", program="reverse", vocab=[1, 2], max_seq_len=4)
    assert task.unsplit_lengths == [1]
    assert [b.tokens.shape[1] - 1 for b in task.val_batches()] == [2, 3, 4]
    trained = _inputs(task, [task.train_batch(step, 16) for step in range(100)])
    assert {(1,), (2,)} <= trained
    with pytest.raises(ConfigError, match="val_fraction"):
        make_task("rasp", program="reverse", vocab=[1, 2], max_seq_len=1)
    with pytest.raises(ConfigError, match="val_fraction"):
        make_task("rasp", program="reverse", val_fraction=1.0)


def test_rasp_lengths_too_many_to_list_are_split_by_score():
    task = make_task("rasp", program="reverse", vocab=list(range(1, 11)), max_seq_len=6, min_seq_len=6,
                     n_val_per_length=64)  # 10**6 inputs: beyond MAX_ENUMERATED
    (val,) = task.val_batches()
    held = _inputs(task, [val])
    assert len(held) == 64 and all(task.held_out(xs) for xs in held)
    trained = [xs for step in range(50) for xs in task.decode(task.train_batch(step, 64).tokens)]
    assert not any(task.held_out(xs) for xs in trained)
    drawn = [xs for xs in task.sample_inputs(torch.Generator().manual_seed(0), 6, 4000)]
    assert abs(sum(map(task.held_out, drawn)) / len(drawn) - 0.2) < 0.03  # the score is uniform


def test_rasp_length_generalisation_trains_short_and_validates_longer():
    task = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=6, train_max_seq_len=4)
    assert task.n_ctx == 7
    lengths = {int(task.train_batch(step, 8).extras["length"][0]) for step in range(200)}
    assert lengths == {1, 2, 3, 4}
    assert [(b.tokens.shape[1] - 1, g) for b, g in zip(task.val_batches(), task.val_groups())] == [
        (1, "val"), (2, "val"), (3, "val"), (4, "val"), (5, "val_longer"), (6, "val_longer")]
    assert [len(b) for b in task.val_batches()[4:]] == [3**5, 3**6]  # every input of an unseen length
    with pytest.raises(ConfigError, match="train_max_seq_len"):
        make_task("rasp", program="reverse", max_seq_len=6, train_max_seq_len=7)


def test_rasp_bad_input():
    with pytest.raises(ConfigError, match="unknown tracr program 'revers'"):
        make_task("rasp", program="revers")
    with pytest.raises(ConfigError, match="reserved"):
        make_task("rasp", program="reverse", vocab=[1, "BOS"])
    with pytest.raises(ConfigError, match="numerically"):
        make_task("rasp", program="sort", vocab=["a", "b"])
    with pytest.raises(ConfigError, match="min_seq_len"):
        make_task("rasp", min_seq_len=7, max_seq_len=5)


def test_padded_joins_batches_of_different_lengths_with_a_mask_and_no_loss_on_the_padding():
    from phasewatch.tasks.base import Batch, padded

    short = Batch(torch.tensor([[5, 1]]), torch.tensor([[0, 2]]), torch.tensor([[False, True]]), {"length": torch.tensor([1])})
    long = Batch(torch.tensor([[5, 1, 2], [5, 2, 2]]), torch.tensor([[0, 3, 3], [0, 1, 1]]),
                 torch.tensor([[False, True, True]] * 2), {"length": torch.tensor([2, 2])})
    joined, mask = padded([short, long])
    assert joined.tokens.tolist() == [[5, 1, 0], [5, 1, 2], [5, 2, 2]]
    assert joined.loss_mask.tolist() == [[False, True, False], [False, True, True], [False, True, True]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]] and joined.extras["length"].tolist() == [1, 2, 2]
    same, none = padded([long, long])
    assert none is None and same.tokens.shape == (4, 3)

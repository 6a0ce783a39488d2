"""`models.factory.tree_copy` (a population's members' bridges copied from one, `one_build`):
the very copy `copy.deepcopy` makes, object for object, of bridges and of the kinds of objects
its fast paths and its fallbacks meet."""

from __future__ import annotations

import copy
import functools
import weakref
from collections import deque, OrderedDict, defaultdict

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.models.factory import tree_copy
from phasewatch.tasks import Induction

ATOMS = (type(None), int, float, bool, complex, str, bytes, type)


def same_copy(a, b, original, pairs: dict | None = None) -> None:
    """`a` and `b` (two copies of `original`) are the same graph: the same types, the same
    atomic values, equal tensors with the same dtype, requires_grad and layout, each copied
    object new where deepcopy's is new and `original`'s own where deepcopy kept it, and the
    same objects shared (a one-to-one map between the two copies' objects)."""
    pairs = {} if pairs is None else pairs
    if id(a) in pairs:
        assert pairs[id(a)] is b, "an object shared in one copy is not shared alike in the other"
        return
    pairs[id(a)] = b
    assert type(a) is type(b)
    assert (a is original) == (b is original), "one copy kept the original object, the other copied it"
    if isinstance(a, weakref.ref) and a is not original:  # made anew in each copy: to objects that correspond
        same_copy(a(), b(), None, pairs)
        return
    if isinstance(a, ATOMS) or callable(a) and not isinstance(a, torch.nn.Module) and not hasattr(a, "__dict__"):
        assert a is b or a == b
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        assert a.layout == b.layout and torch.equal(a, b)
        return
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            same_copy(a[k], b[k], original[k] if isinstance(original, dict) and k in original else None, pairs)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for k, (x, y) in enumerate(zip(a, b)):
            same_copy(x, y, original[k] if isinstance(original, (list, tuple)) and len(original) > k else None, pairs)
    elif isinstance(a, (set, frozenset)):
        assert a == b
    if hasattr(a, "__dict__") and not isinstance(a, type):
        same_copy(vars(a), vars(b), vars(original) if hasattr(original, "__dict__") else None, pairs)
    if hasattr(type(a), "__slots__"):
        for slot in type(a).__slots__:
            same_copy(getattr(a, slot, None), getattr(b, slot, None), getattr(original, slot, None), pairs)


@pytest.mark.parametrize("arch", [dict(), dict(attn_only=False, normalization="LN", act_fn="gelu", d_mlp=24),
                                  dict(attn_bias=False), dict(n_layers=1, attention="bidirectional")])
def test_a_bridge_tree_copied_is_its_deep_copy(arch):
    task = Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=0)
    cfg = ModelConfig(**{"n_layers": 2, "d_model": 16, "n_heads": 2, "d_head": 8, "attn_only": True,
                         "attention": "causal", **arch})
    torch.manual_seed(0)
    model = build_model(cfg, task)
    ours, theirs = tree_copy(model), copy.deepcopy(model)
    same_copy(theirs, ours, model)
    assert not any(p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
                   for p, q in zip(ours.parameters(), model.parameters()))
    tokens = task.train_batch(0, None).tokens
    logits, cache = ours.run_with_cache(tokens)
    ref_logits, ref_cache = theirs.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits)
    assert list(cache.keys()) == list(ref_cache.keys()) and all(torch.equal(cache[k], ref_cache[k]) for k in cache)
    with torch.no_grad():  # a copy's weights are its own
        next(ours.parameters()).add_(1.0)
    assert torch.equal(next(model.parameters()), next(theirs.parameters()))


class Slotted:
    __slots__ = ("x", "y")

    def __init__(self, x, y):
        self.x, self.y = x, y


class Plain:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def method(self):
        return self


class OwnCopy:
    def __init__(self, value):
        self.value, self.copies = value, 0

    def __deepcopy__(self, memo):
        out = OwnCopy(copy.deepcopy(self.value, memo))
        out.copies = self.copies + 1
        return out


class Items(dict):
    pass


class Pairs:
    """An object whose reduce hands its state over as dict items (copy's `dictiter`)."""

    def __init__(self, **items):
        self.items = dict(items)

    def __reduce__(self):
        return Pairs, (), None, None, iter(self.items.items())

    def __setitem__(self, key, value):
        self.items[key] = value


def test_objects_tree_copied_as_deepcopy_copies_them():
    shared = [1, 2]
    attributed = OrderedDict(a=shared)
    attributed.note = "kept"
    inner = Plain(z=shared)
    plain = Plain(a=shared, b=(shared, shared), c=(1, "x"), d={"k": shared, 3: (inner, inner)})
    plain.self = plain  # a cycle
    plain.bound = plain.method
    things = {
        "shared": shared, "tuple of atoms": (1, 2.5, "s", None), "tuple with lists": (shared, [shared]),
        "ordered": OrderedDict(x=shared, y=OrderedDict(z=(shared,))), "attributed ordered": attributed,
        "slotted": Slotted(shared, Slotted(1, shared)), "plain": plain, "own copy": OwnCopy(shared),
        "dict subclass": Items(a=shared), "default": defaultdict(list, a=shared), "set": {1, 2, "x"},
        "empty set": set(), "set of tuples": {(1, "a"), (2, "b")},
        "frozen": frozenset({1, 2}), "partial": functools.partial(max, shared), "function": tree_copy,
        "class": Plain, "tensor": torch.arange(3.0), "leaf": torch.zeros(2, requires_grad=True), "parameter": torch.nn.Parameter(torch.ones(2)),
        "module": torch.nn.Linear(2, 3), "device": torch.device("cpu"), "dtype": torch.float64,
        "method": inner.method, "deque": deque([shared, (shared,)], maxlen=5), "pairs": Pairs(a=shared, b=[shared]),
    }
    things["views"] = (things["tensor"], things["tensor"][1:])
    ours, theirs = tree_copy(things), copy.deepcopy(things)
    same_copy(theirs, ours, things)
    assert ours["plain"].self is ours["plain"] and ours["plain"].bound.__self__ is ours["plain"]
    assert ours["plain"].a is ours["shared"] and ours["plain"].d[3][0] is ours["plain"].d[3][1]
    assert ours["own copy"].copies == 1 and ours["attributed ordered"].note == "kept"
    assert ours["tuple of atoms"] is things["tuple of atoms"] and ours["function"] is tree_copy
    assert ours["deque"][0] is ours["shared"] and ours["deque"].maxlen == 5  # copy's listiter
    assert ours["pairs"].items["a"] is ours["shared"] and ours["pairs"].items["b"][0] is ours["shared"]  # dictiter
    assert ours["views"][1]._base is ours["views"][0] or ours["views"][1]._base is None

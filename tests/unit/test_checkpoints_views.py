"""`shared_views` (callbacks/checkpoints.py): a state dict's entries that view the same memory
alike become one object; every other entry, the keys and their order stay; saved and loaded,
every key holds the values it held."""

import io

import torch

from phasewatch.callbacks.checkpoints import shared_views
from phasewatch.models import ModelConfig, build_model
from phasewatch.tasks import make_task


def _saved_and_loaded(state: dict) -> tuple[dict, int]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    size = buffer.tell()
    buffer.seek(0)
    return torch.load(buffer, weights_only=True), size


def test_only_entries_viewing_the_same_memory_alike_become_one_object():
    base = torch.arange(12.0).reshape(3, 4)
    weight = torch.nn.Parameter(torch.ones(2, 2))
    state = {"a": base.detach(), "row": base[1].detach(), "a_again": base.detach(), "flat": base.view(12).detach(),
             "transposed": base.t().detach(), "row_again": base[1].detach(), "copy": base.clone(),
             "as_int": base.to(torch.int64), "param": weight, "param_detached": weight.detach(), "count": 3,
             "meta": torch.empty(3, 4, device="meta"), "meta_too": torch.empty(3, 4, device="meta"),
             "complex": torch.tensor([1 + 2j, 3 - 1j]), "conjugate": None}
    state["conjugate"] = state["complex"].conj()  # the same memory read with the conjugate bit: not the same values
    before = dict(state)
    assert shared_views(state) is state
    assert list(state) == list(before) and state["count"] == 3
    same = {key: next(k for k in state if state[k] is state[key]) for key in state if key != "count"}
    # the same memory in the same shape and strides: one object; any other view (a row, the
    # whole as a vector, transposed), a copy, another dtype, a parameter against its detached
    # view (requires_grad differs): each its own
    assert same == {"a": "a", "row": "row", "a_again": "a", "flat": "flat", "transposed": "transposed",
                    "row_again": "row", "copy": "copy", "as_int": "as_int", "param": "param",
                    "param_detached": "param_detached", "meta": "meta", "meta_too": "meta_too",
                    "complex": "complex", "conjugate": "conjugate"}
    for key, value in before.items():
        assert type(state[key]) is type(value)
        if key != "count" and not value.is_meta:
            assert torch.equal(state[key], value)


def test_a_bridges_state_dict_saves_smaller_and_loads_the_same_weights():
    """A TransformerBridge's state dict names each weight under several paths (its components
    and the wrapped modules): one object per weight, the file smaller, and loaded into a
    freshly built bridge the same weights under every key."""
    task = make_task("modular_addition", p=7)
    arch = ModelConfig(d_model=8, n_heads=1, d_head=8, d_mlp=16)
    model = build_model(arch, task)
    plain = model.state_dict(prefix="model.")
    shared = shared_views(model.state_dict(prefix="model."))
    weights = {v.data_ptr() for v in plain.values()}  # every entry of one weight views all of it
    assert len({id(v) for v in shared.values()}) == len(weights) < len(shared)
    loaded, size = _saved_and_loaded(shared)
    loaded_plain, size_plain = _saved_and_loaded(plain)
    assert size < size_plain
    assert list(loaded) == list(plain) == list(loaded_plain)
    for key, value in plain.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)
    other = build_model(ModelConfig(**{**arch.__dict__, "seed": 1}), task)
    assert not all(torch.equal(value, plain[key]) for key, value in other.state_dict(prefix="model.").items())
    torch.nn.Module.load_state_dict(other, {k[len("model."):]: v for k, v in loaded.items()})
    for key, value in other.state_dict(prefix="model.").items():
        assert torch.equal(value, plain[key])

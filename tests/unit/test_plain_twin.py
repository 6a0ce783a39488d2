"""`models.plain.plain_twin`: the bridge's native model built again without the bridge computes
what the bridge computes (to float rounding), is built without touching the global random
state, and is kept on the model."""

import copy

import torch

from phasewatch.models import ModelConfig, build_model, call_with, native_module
from phasewatch.models.plain import plain_twin
from phasewatch.tasks.induction import Induction


def test_the_plain_twin_computes_what_the_bridge_computes():
    task = Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=0)
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=8, d_mlp=32, normalization="LN"), task)
    native = native_module(model)
    state = torch.get_rng_state()
    twin, names = plain_twin(model)
    assert torch.equal(torch.get_rng_state(), state)  # built aside from the global random state
    assert plain_twin(model)[0] is twin and copy.deepcopy(model).__dict__  # kept on the model
    assert "_original_component" not in " ".join(names.values()) and len(names) == len(list(native.parameters()))
    assert not any(True for _ in model.modules() if _ is twin)  # not a submodule: no parameter of the model's
    batch = task.train_batch(0, None)
    params = {names[name]: p for name, p in native.named_parameters()}
    out = call_with(twin, params, (batch.tokens,))
    torch.testing.assert_close(out, native(batch.tokens), rtol=1e-5, atol=1e-6)
    out.square().sum().backward()  # every parameter's gradient reaches the bridge's own
    assert all(p.grad is not None for p in native.parameters() if p.requires_grad)
    # the twin holds no weights of its own that the pass reads: other weights, other outputs
    with torch.no_grad():
        for p in native.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(call_with(twin, params, (batch.tokens,)), native(batch.tokens), rtol=1e-5, atol=1e-6)

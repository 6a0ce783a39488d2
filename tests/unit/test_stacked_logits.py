"""The population's step written with the member dimension (`models.plain.stacked_logits`,
`training.population.stacked_outputs`) gives what vmap of the plain twin gives
(`vectorised_outputs`), bit for bit on the CPU: the losses, the counts and every gradient,
for the layouts it covers; None (vmap runs) for the others."""

from __future__ import annotations

import pytest
import torch

from phasewatch.models import ModelConfig, native_module
from phasewatch.models.plain import plain_twin, stacked_logits
from phasewatch.tasks.induction import Induction
from phasewatch.tasks.modular_addition import ModularAddition
from phasewatch.tasks.rasp import RaspTask
from phasewatch.training.module import TrainModule, padded, vectorised_outputs
from phasewatch.training.population import padded_members, stack_batches, stacked_outputs


def _twin(task, **arch):
    torch.manual_seed(0)
    module = TrainModule(task=task, arch=ModelConfig(**arch))
    return module, *plain_twin(module.model)


def _stack(module, names, n: int) -> dict[str, torch.Tensor]:
    """n members' parameters, each its own draw (the twin's names)."""
    gen = torch.Generator().manual_seed(n)
    return {names[name]: (torch.randn(n, *p.shape, generator=gen, dtype=p.dtype) * 0.5).requires_grad_(p.requires_grad)
            for name, p in native_module(module.model).named_parameters()}


def _both(twin, params, batch, shared, loss_dtype):
    """(outputs, gradients) of vmap's path and of the member dimension's, each from fresh leaves."""
    results = []
    for run in (vectorised_outputs, stacked_outputs):
        leaves = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in params.items()}
        out = run(twin, leaves, batch, shared, True, loss_dtype)
        assert out is not None
        out["loss"].sum().backward()
        results.append(({k: v.detach() for k, v in out.items()},
                        {k: v.grad for k, v in leaves.items() if v.requires_grad}))
    return results


def _assert_same(results):
    (out_v, grad_v), (out_s, grad_s) = results
    assert out_v.keys() == out_s.keys()
    for key in out_v:
        assert out_v[key].dtype == out_s[key].dtype and torch.equal(out_v[key], out_s[key]), key
    assert grad_v.keys() == grad_s.keys() and grad_v
    for key in grad_v:
        assert torch.equal(grad_v[key], grad_s[key]), key


CASES = {
    # induction_2l's layout (attention only, no normalization, causal), the real batch
    "induction": (lambda: Induction(batch_size=32, n_val=8), dict(n_layers=2, d_model=16, n_heads=4, d_head=4,
                                                                  attn_only=True, normalization="none")),
    # the quickstart's (an MLP, ReLU, no normalization; attention biases off)
    "modular": (lambda: ModularAddition(p=13, frac_train=0.5),
                dict(n_layers=1, d_model=16, n_heads=2, d_mlp=32, act_fn="relu", normalization="none",
                     attn_bias=False)),
    # reverse's (LayerNorm, MLP, bidirectional) with GELU
    "layernorm": (lambda: Induction(batch_size=8, n_val=8), dict(n_layers=2, d_model=16, n_heads=2, d_mlp=32,
                                                                 act_fn="gelu", normalization="LN")),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", [2, 3])
def test_stacked_outputs_are_vmaps_bit_for_bit(case, n):
    make, arch = CASES[case]
    task = make()
    module, twin, names = _twin(task, **arch)
    assert stacked_logits(twin, _stack(module, names, n), torch.zeros(n, 1, 2, dtype=torch.long)) is not None
    batch = stack_batches([task.train_batch(step, None) for step in range(n)])
    _assert_same(_both(twin, _stack(module, names, n), batch, False, module.loss_dtype))


def test_one_batch_for_every_member_is_left_to_vmap():
    """Members that share their batch (`population.vary_data` false): vmap runs it (its
    unbatched inputs round the key biases' gradients otherwise than the member dimension)."""
    make, arch = CASES["induction"]
    task = make()
    module, twin, names = _twin(task, **arch)
    batch = task.train_batch(0, None)
    assert stacked_outputs(twin, _stack(module, names, 2), batch, True, True, module.loss_dtype) is None


def test_padded_rasp_members_bit_for_bit():
    """Reverse's layout with its members' lengths padded to one pass (`padded_members`: the
    attention mask `attend`), and its validation batches unpadded."""
    task = RaspTask(program="reverse", vocab=[1, 2, 3], max_seq_len=5, min_seq_len=1, batch_size=8)
    module, twin, names = _twin(task, n_layers=2, d_model=16, n_heads=2, d_mlp=32, normalization="LN",
                                attention="bidirectional")
    members = [RaspTask(program="reverse", vocab=[1, 2, 3], max_seq_len=5, min_seq_len=1, batch_size=8, seed=s)
               for s in range(3)]
    step = next(s for s in range(50) if len({m.train_batch(s, None).tokens.shape for m in members}) > 1)
    batch = padded_members([m.train_batch(step, None) for m in members], task.n_ctx)
    assert "attend" in batch.extras and not batch.extras["attend"].all()
    _assert_same(_both(twin, _stack(module, names, 3), batch, False, module.loss_dtype))
    val = stack_batches([m.val_batches()[0] for m in members])
    _assert_same(_both(twin, _stack(module, names, 3), val, False, module.loss_dtype))


def test_float64_loss_bit_for_bit():
    """The grokking paper's loss in float64 (the task's `loss_dtype`)."""
    task = ModularAddition(p=13, frac_train=0.5)
    module, twin, names = _twin(task, n_layers=1, d_model=16, n_heads=2, d_mlp=32, act_fn="relu",
                                normalization="none", attn_bias=False)
    batch = stack_batches([task.train_batch(s, None) for s in range(2)])
    _assert_same(_both(twin, _stack(module, names, 2), batch, False, torch.float64))


@pytest.mark.parametrize("arch", [dict(normalization="RMS"), dict(act_fn="solu", attn_only=False), dict(normalization="LNPre")])
def test_other_layouts_left_to_vmap(arch):
    task = Induction(batch_size=4, n_val=8)
    module, twin, names = _twin(task, n_layers=1, d_model=16, n_heads=2, d_mlp=32, **arch)
    tokens = torch.zeros(2, 1, 3, dtype=torch.long)
    assert stacked_logits(twin, _stack(module, names, 2), tokens) is None
    batch = stack_batches([task.train_batch(s, None) for s in range(2)])
    assert stacked_outputs(twin, _stack(module, names, 2), batch, False, True, module.loss_dtype) is None


def test_a_stack_of_one_is_left_to_vmap():
    """A stack of one runs doubled (`vectorised_outputs`), which the member dimension leaves to vmap."""
    task = Induction(batch_size=4, n_val=8)
    module, twin, names = _twin(task, n_layers=1, d_model=16, n_heads=2, attn_only=True, normalization="none")
    assert stacked_logits(twin, _stack(module, names, 1), torch.zeros(1, 1, 3, dtype=torch.long)) is None

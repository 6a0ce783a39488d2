"""Known answers for the diff of two models (diff/model_diff.py): a model against itself,
a model with one head taken from another, patching every component, and direct logit
attribution on a hand-built model and on random ones with and without a final norm."""

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.diff.model_diff import (diff_components, direct_logit_attribution, model_diff, patched_logits)
from phasewatch.tasks import make_task
from phasewatch.errors import ConfigError


def _pair(task, seeds=(1, 2), **arch):
    cfg = dict(n_layers=2, d_model=32, n_heads=4, **arch)
    return build_model(ModelConfig(seed=seeds[0], **cfg), task), build_model(ModelConfig(seed=seeds[1], **cfg), task)


@pytest.fixture(scope="module")
def task():
    return make_task("modular_addition", p=17, frac_train=0.5)


def _numbers(row):
    return {k: v for k, v in row.items() if k not in ("component", "kind")}


def test_a_model_diffed_with_itself_is_zero_everywhere(task):
    a, _ = _pair(task)
    result = model_diff(a, a, task)
    assert result.loss_a == result.loss_b
    assert {r["kind"] for r in result.rows} == {"embed", "head", "attn", "mlp", "unembed", "resid", "bias"}
    for row in result.rows:
        for key, value in _numbers(row).items():
            if key in ("dla_a", "dla_b"):
                continue
            if key.startswith("patched_loss"):
                assert value == pytest.approx(result.loss_a, rel=1e-6), (row["component"], key)  # the same model
            elif key.startswith("patch"):
                assert value is None, (row["component"], key)  # no loss gap, nothing to recover
            else:
                assert value == 0, (row["component"], key, value)
        if "dla_a" in row:
            assert row["dla_a"] == row["dla_b"]


def test_one_head_taken_from_another_model_ranks_first_in_weights_and_patching(task):
    a, c = _pair(task, seeds=(3, 4))
    b, _ = _pair(task, seeds=(3, 4))  # b = a, then L1H2 from c
    d = a.cfg.d_head
    rows = slice(2 * d, 3 * d)
    with torch.no_grad():
        attn_b, attn_c = b.original_model.layers[1].attn, c.original_model.layers[1].attn
        for lin in ("q", "k", "v"):
            getattr(attn_b, lin).weight[rows] = getattr(attn_c, lin).weight[rows]
            getattr(attn_b, lin).bias[rows] = getattr(attn_c, lin).bias[rows]
        attn_b.o.weight[:, rows] = attn_c.o.weight[:, rows]
    result = model_diff(a, b, task)
    heads = [r for r in result.rows if r["kind"] == "head"]
    for key in ("weight_abs", "qk_abs", "ov_abs", "act_rms", "patch_b_into_a", "patch_a_into_b"):
        ranked = sorted(heads, key=lambda r: r[key], reverse=True)
        assert ranked[0]["component"] == "L1H2", key
    assert all(r["weight_abs"] == 0 for r in heads if r["component"] != "L1H2")
    for component in ("L1H2", "L1.attn"):  # everything else is the same: the patch is B
        assert result.row(component)["patch_b_into_a"] == pytest.approx(1, abs=1e-6)
        assert result.row(component)["patch_a_into_b"] == pytest.approx(1, abs=1e-6)
    for component in ("L0H2", "L1H0", "L0.mlp", "embed", "unembed"):
        assert result.row(component)["patch_b_into_a"] == pytest.approx(0, abs=1e-6)
    assert abs(result.loss_a - result.loss_b) > 1e-3  # the premise: the head matters to the loss


@pytest.mark.parametrize("task_name,arch", [("modular_addition", {}), ("rasp", {"normalization": "LN"}),
                                            ("induction", {"normalization": "RMS"})])
def test_patching_every_component_gives_b(task_name, arch):
    task = make_task(task_name)
    a, b = _pair(task, **arch)
    every = [c for c, kind in diff_components(a) if kind != "head"]
    tokens = task.val_batches()[-1].spread(16).tokens
    with torch.no_grad():
        assert torch.allclose(patched_logits(a, b, every, tokens), b(tokens), atol=1e-5)
        assert not torch.allclose(patched_logits(a, b, every[:-1], tokens), b(tokens), atol=1e-3)  # the unembed counts


@pytest.mark.parametrize("normalization", ["none", "LN", "LNPre", "RMS"])
def test_direct_logit_attribution_sums_to_the_logit(normalization):
    task = make_task("rasp")
    model = build_model(ModelConfig(n_layers=2, d_model=32, n_heads=4, seed=5, normalization=normalization), task)
    if normalization == "LN":
        with torch.no_grad():
            model.ln_final.b.normal_()  # a bias that is the norm's own, not any component's
    batch = task.val_batches()[-1].spread(32)
    parts = direct_logit_attribution(model, batch)
    with torch.no_grad():
        logits = model(batch.tokens)[batch.loss_mask].double()
    correct = logits.gather(1, batch.targets[batch.loss_mask][:, None])[:, 0]
    total = sum(parts.values())
    assert torch.allclose(total, correct, atol=1e-4)
    assert (parts["norm_bias"] != 0).any() == (normalization == "LN")


def test_direct_logit_attribution_of_a_hand_built_model():
    """One attention-only layer; the embedding is the identity, positions add nothing, and
    only head 0 writes: with zero queries and keys it averages the earlier tokens (causal),
    its OV circuit maps token i to 2 x direction i, and the unembedding reads direction t as
    logit t. So the head's DLA at position i is 2 x the share of the correct token among
    tokens 0..i, the embedding's is 1 when the token at i is the correct one."""
    task = make_task("induction", vocab_size=6, seq_len=9, min_len=2, max_len=4)
    d = task.d_vocab
    model = build_model(ModelConfig(n_layers=1, d_model=d, n_heads=2, d_head=d, attn_only=True,
                                    attention="causal", seed=0), task)
    native = model.original_model
    with torch.no_grad():
        for p in native.parameters():
            p.zero_()
        native.tok_embed.weight.copy_(torch.eye(d))
        native.layers[0].attn.v.weight[:d] = torch.eye(d)          # head 0: W_V = I
        native.layers[0].attn.o.weight[:, :d] = 2 * torch.eye(d)   # W_O = 2 I
        native.head.weight[:, :] = torch.eye(d)[: native.head.weight.shape[0]]
    batch = task.val_batches()[0].spread(8)
    parts = direct_logit_attribution(model, batch)
    tokens, targets, mask = batch.tokens, batch.targets, batch.loss_mask
    expected_head, expected_embed = [], []
    for row, col in mask.nonzero().tolist():
        t = int(targets[row, col])
        seen = tokens[row, : col + 1]
        expected_head.append(2 * float((seen == t).double().mean()))
        expected_embed.append(float(tokens[row, col] == t))
    assert torch.allclose(parts["L0H0"], torch.tensor(expected_head, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(parts["embed"], torch.tensor(expected_embed, dtype=torch.float64), atol=1e-6)
    assert torch.count_nonzero(parts["L0H1"]) == 0 and torch.count_nonzero(parts["pos_embed"]) == 0
    assert any(v > 0 for v in expected_head) and any(v == 0 for v in expected_head)  # the case is not trivial


def test_models_of_different_structure_are_refused(task):
    a = build_model(ModelConfig(n_layers=2, d_model=32, n_heads=4, seed=1), task)
    b = build_model(ModelConfig(n_layers=2, d_model=32, n_heads=2, seed=1), task)
    with pytest.raises(ConfigError, match="differ in n_heads: 4 against 2"):
        model_diff(a, b, task)

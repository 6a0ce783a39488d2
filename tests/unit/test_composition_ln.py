"""Composition scores in normalised models, on a known answer: a head that writes only
along the all-ones direction, which LayerNorm subtracts, composes with nothing in a
LayerNorm model (TransformerLens's own folded and centred weights say so), but fully with a
head reading that direction through RMSNorm or no norm at all."""

import copy

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.probes.composition import composition_matrix, composition_scores, random_baseline
from phasewatch.tasks import make_task


def all_ones_pair(normalization: str):
    """A 2-layer model whose L0H0 writes along the all-ones direction and whose L1H0 keys
    read along it, each plus a small random part (so the centred heads are random, not zero)."""
    model = build_model(ModelConfig(n_layers=2, normalization=normalization, seed=0), make_task("rasp"))
    d_model, d_head = model.cfg.d_model, model.cfg.d_head
    g = torch.Generator().manual_seed(1)
    ones = torch.ones(d_model)
    x, y = torch.randn(d_head, generator=g), torch.randn(d_head, generator=g)
    layers = model.original_model.layers
    with torch.no_grad():  # rows/columns :d_head of the projections are head 0
        layers[0].attn.o.weight[:, :d_head] = torch.outer(ones, x) + 0.01 * torch.randn(d_model, d_head, generator=g)
        layers[1].attn.k.weight[:d_head] = torch.outer(y, ones) + 0.01 * torch.randn(d_head, d_model, generator=g)
    return model


def raw_k_score(model) -> float:
    """K-composition of L0H0 -> L1H0 on the bridge's weights as they are (ln1 scales are 1)."""
    w_v, w_o = model.W_V[0, 0].detach().double(), model.W_O[0, 0].detach().double()
    w_q, w_k = model.W_Q[1, 0].detach().double(), model.W_K[1, 0].detach().double()
    return float(composition_matrix(w_v[None], w_o[None], w_k[None], w_q.T[None])[0, 0])


def transformer_lens_scores(model) -> dict[str, torch.Tensor]:
    """Composition scores that TransformerLens computes on its own processed copy of the
    weights (fold_ln, center_writing_weights: what HookedTransformer used to load)."""
    processed = copy.deepcopy(model)
    processed.process_weights(fold_ln=True, center_writing_weights=True)
    return {mode.lower(): processed.all_composition_scores(mode).scores.detach().double() for mode in "QKV"}


def assert_same_scores(ours, theirs):
    for kind in "qkv":
        valid = ~torch.isnan(ours[kind])
        assert valid.any() and torch.allclose(ours[kind][valid], theirs[kind][valid], atol=1e-5), kind


@pytest.mark.parametrize("normalization", ["LN", "LNPre"])
def test_layernorm_removes_the_all_ones_direction(normalization):
    model = all_ones_pair(normalization)
    assert raw_k_score(model) > 0.99  # what folding the scale alone reported
    ours = composition_scores(model)
    assert_same_scores(ours, transformer_lens_scores(model))
    baseline = random_baseline(model.cfg.d_model, model.cfg.d_head)
    assert float(ours["k"][0, 0, 1, 0]) < 1.6 * baseline  # random level: not composing


@pytest.mark.parametrize("normalization", ["RMS", "none"])
def test_rmsnorm_and_no_norm_keep_the_all_ones_direction(normalization):
    model = all_ones_pair(normalization)
    ours = composition_scores(model)
    assert float(ours["k"][0, 0, 1, 0]) == pytest.approx(raw_k_score(model), rel=1e-9)
    assert float(ours["k"][0, 0, 1, 0]) > 0.99
    assert_same_scores(ours, transformer_lens_scores(model))


@pytest.mark.parametrize("task,arch", [
    ("induction", ModelConfig(n_layers=3)),
    ("rasp", ModelConfig(n_layers=2, normalization="LN")),
    ("rasp", ModelConfig(n_layers=2, normalization="RMS")),
])
def test_scores_agree_with_transformer_lens_processed_weights(task, arch):
    model = build_model(arch, make_task(task))
    if arch.normalization is not None:  # uneven scales: folding must come before centring
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for block in model.original_model.layers:
                block.ln1.weight.copy_(0.5 + torch.rand(block.ln1.weight.shape, generator=g))
    ours = composition_scores(model)
    assert_same_scores(ours, transformer_lens_scores(model))
    assert (~torch.isnan(ours["k"])).sum() == (arch.n_layers * (arch.n_layers - 1) // 2) * 16


def test_a_head_writing_only_the_all_ones_direction_composes_with_nothing():
    model = all_ones_pair("LN")
    d_model, d_head = model.cfg.d_model, model.cfg.d_head
    with torch.no_grad():  # exactly along all-ones: LayerNorm's centring leaves a zero matrix
        model.original_model.layers[0].attn.o.weight[:, :d_head] = torch.ones(d_model, d_head)
    scores = composition_scores(model)
    assert all(float(scores[kind][0, 0, 1, 0]) == 0.0 for kind in "qkv")  # not NaN: 0/0 is no composition

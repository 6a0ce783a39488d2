"""Composition scores and head detectors on known answers."""

import math
import types

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.probes.composition import composition_matrix, composition_scores, random_baseline
from phasewatch.probes.heads import (
    classify, copying_scores, duplicate_token_score, induction_score, previous_token_score, repeated_tokens,
)
from phasewatch.tasks import make_task


def e(d, i):
    v = torch.zeros(d, 1, dtype=torch.float64)
    v[i] = 1
    return v


def score(a_u, a_v, b_u, b_v):
    return float(composition_matrix(a_u[None], a_v[None], b_u[None], b_v[None])[0, 0])


def test_composition_known_answers():
    d = 8
    # aligned rank-1 pair: A = e0 e1^T, B = e1 e2^T compose fully
    assert score(e(d, 0), e(d, 1).T, e(d, 1), e(d, 2).T) == pytest.approx(1.0)
    # orthogonal: A writes e1, B reads e3
    assert score(e(d, 0), e(d, 1).T, e(d, 3), e(d, 2).T) == pytest.approx(0.0, abs=1e-12)
    eye = torch.eye(d, dtype=torch.float64)
    assert score(eye, eye, eye, eye) == pytest.approx(1 / math.sqrt(d))
    r = 3
    proj_u = torch.eye(d, dtype=torch.float64)[:, :r]
    assert score(proj_u, proj_u.T, proj_u, proj_u.T) == pytest.approx(1 / math.sqrt(r))
    # scale-free
    assert score(3 * proj_u, proj_u.T, proj_u, 0.1 * proj_u.T) == pytest.approx(1 / math.sqrt(r))


def test_random_baseline_is_one_over_sqrt_d_model_whatever_d_head():
    for d_model, d_head in ((64, 16), (64, 4), (128, 32)):
        assert random_baseline(d_model, d_head) == pytest.approx(1 / math.sqrt(d_model), rel=0.05)


def test_random_baseline_scores_each_sample_pair_by_the_definition():
    """The baseline scores sample i's two matrices only (not every pair of samples): the mean of
    ||A_i B_i|| / (||A_i|| ||B_i||) from the dense d_model x d_model products, drawn alike."""
    d_model, d_head, samples = 12, 3, 16
    g = torch.Generator().manual_seed(5)
    u1, v1, u2, v2 = [torch.randn(samples, *shape, generator=g, dtype=torch.float64)
                      for shape in ((d_model, d_head), (d_head, d_model), (d_model, d_head), (d_head, d_model))]
    a, b = u1 @ v1, u2 @ v2
    plain = (torch.linalg.matrix_norm(a @ b) / (torch.linalg.matrix_norm(a) * torch.linalg.matrix_norm(b))).mean()
    assert random_baseline.__wrapped__(d_model, d_head, samples, seed=5) == pytest.approx(float(plain), rel=1e-12)


@pytest.mark.parametrize("normalization", ["LN", "RMS"])
def test_norm_scale_is_folded_into_the_reading_head(normalization):
    model = build_model(ModelConfig(n_layers=2, normalization=normalization), make_task("rasp"))
    before = composition_scores(model)["k"][0, 0, 1, 0]
    with torch.no_grad():
        scale = torch.ones(64)
        scale[:32] = 5.0  # reweights the directions layer 1 reads through
        model.original_model.layers[1].ln1.weight.copy_(scale)
    after = composition_scores(model)["k"][0, 0, 1, 0]

    def centred(w, axis):  # LayerNorm subtracts the mean over d_model; RMSNorm does not
        return w - w.mean(axis, keepdim=True) if normalization == "LN" else w

    w_q = centred(model.W_Q[1, 0].detach().double() * scale.double()[:, None], 0)  # fold, then centre
    w_k = centred(model.W_K[1, 0].detach().double() * scale.double()[:, None], 0)
    a_u, a_v = centred(model.W_V[0, 0].detach().double(), 0), centred(model.W_O[0, 0].detach().double(), 1)
    expected = score(a_u, a_v, w_k, w_q.T)  # K-composition reads W_K W_Q^T
    assert float(after) == pytest.approx(expected, rel=1e-9) and float(after) != pytest.approx(float(before))


def patterns_for(n, fn):
    p = torch.zeros(1, 1, n, n, dtype=torch.float64)
    for i in range(n):
        p[0, 0, i, fn(i)] = 1.0
    return p


def test_previous_token_scores():
    n = 21
    prev = patterns_for(n, lambda i: max(i - 1, 0))
    assert float(previous_token_score(prev)) == pytest.approx(1.0)
    uniform = torch.tril(torch.ones(n, n, dtype=torch.float64))
    uniform = (uniform / uniform.sum(-1, keepdim=True))[None, None]
    assert float(previous_token_score(uniform)) < 0.2


@pytest.mark.parametrize("L", [5, 10, 15])
def test_perfect_induction_pattern_scores_l_plus_1_over_l_plus_2(L):
    n = 2 * L + 1  # BOS + L + L
    # second copy (positions L+1..2L) attends to the token after the earlier occurrence;
    # everything else attends to BOS
    perfect = patterns_for(n, lambda i: i + 1 - L if i >= L + 1 else 0)
    assert float(induction_score(perfect, L)) == pytest.approx((L + 1) / (L + 2))
    assert float(induction_score(patterns_for(n, lambda i: max(i - 1, 0)), L)) < 0.1


def test_duplicate_token_score():
    L = 6
    tokens = repeated_tokens(vocab_size=1000, bos=1000, rep_len=L, batch=1)
    dup = patterns_for(2 * L + 1, lambda i: i - L if i >= L + 1 else 0)
    assert float(duplicate_token_score(dup, tokens)) == pytest.approx(1.0)
    assert float(duplicate_token_score(patterns_for(2 * L + 1, lambda i: i), tokens)) == 0.0


def test_copying_score_of_positive_and_negative_ov_circuits():
    g = torch.Generator().manual_seed(0)
    w_e = torch.randn(20, 8, generator=g)
    w_v = torch.randn(8, 4, generator=g)
    w_o = torch.linalg.pinv(w_v)  # W_V W_O projects onto a 4-d subspace
    fake = types.SimpleNamespace(W_E=w_e, W_U=w_e.T, W_V=torch.stack([w_v, w_v])[None],
                                 W_O=torch.stack([w_o, -w_o])[None])
    s = copying_scores(fake)
    assert s.shape == (1, 2) and float(s[0, 0]) == pytest.approx(1.0) and float(s[0, 1]) == pytest.approx(-1.0)


def test_classify_heads_by_threshold():
    scores = {"induction": torch.tensor([[0.1, 0.2], [0.9, 0.05]]), "prev_token": torch.tensor([[0.7, 0.0], [0.0, 0.0]]),
              "duplicate": torch.zeros(2, 2)}
    assert classify(scores) == {"prev_token": ["L0H0"], "duplicate": [], "induction": ["L1H0"]}
    assert classify(scores, {"induction": 0.15})["induction"] == ["L0H1", "L1H0"]

"""Pointer-arithmetic induction heads told from classic ones (probes/heads.py), on two
hand-built two-layer attention-only models that both complete repeated sequences:

- classic: head L0H0 attends the previous position and copies its token into a
  "previous token" subspace; head L1H0's query (the current token) meets keys that hold
  the previous token there (K-composition through token directions);
- pointer arithmetic: head L0H0 attends the earlier copy of the current token and writes
  that copy's position into a "where" subspace; head L1H0's query (that position) meets
  keys holding the next position (Q-composition through positional directions).

The residual stream is d_model = 2 x (d_vocab + n_ctx): the token, the position, and the
two subspaces the layer-0 heads write, one basis vector each. Where nothing matches, the
induction head attends BOS, as a perfect induction head does."""

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.probes.heads import head_probe_values, induction_mechanism_scores
from phasewatch.tasks import make_task

SHARP = 60.0  # attention logits (before the 1/sqrt(d_head) scale): one-hot patterns


def _hand_built(kind: str):
    task = make_task("induction", vocab_size=64, seq_len=17, min_len=2, max_len=8)
    v, n = task.d_vocab, task.n_ctx
    tok, pos = torch.arange(v), v + torch.arange(n)
    prev, where = 2 * v + n - v + torch.arange(v), 2 * v + n + torch.arange(n)  # prev: v+n .. 2v+n-1
    d = 2 * (v + n)
    model = build_model(ModelConfig(n_layers=2, d_model=d, n_heads=2, d_head=d, attn_only=True, attention="causal",
                                    normalization="none", seed=0), task)
    native = model.original_model
    scale = SHARP * d ** 0.5
    w_q = {(l, h): torch.zeros(d, d) for l in (0, 1) for h in (0, 1)}
    w_o = {(l, h): torch.zeros(d, d) for l in (0, 1) for h in (0, 1)}
    for t in range(v):  # with no match, the induction head rests on BOS (half a match)
        w_q[1, 0][tok[t], tok[task.bos]] = scale / 2
    if kind == "classic":
        for p in range(1, n):
            w_q[0, 0][pos[p], pos[p - 1]] = scale  # query at p looks for position p - 1
        for t in range(v):
            w_o[0, 0][tok[t], prev[t]] = 1  # and writes that position's token as "previous token"
            w_q[1, 0][tok[t], prev[t]] = scale  # the induction head looks for "previous token = mine"
    else:
        for t in range(v):
            w_q[0, 0][tok[t], tok[t]] = scale  # query with token t looks for token t ...
        for p in range(n):
            w_q[0, 0][pos[p], pos[p]] = -scale  # ... anywhere but here
            w_o[0, 0][pos[p], where[p]] = 1  # and writes where it found it
            if p + 1 < n:
                w_q[1, 0][where[p], pos[p + 1]] = scale  # the induction head looks one position further
    with torch.no_grad():
        for param in native.parameters():
            param.zero_()
        native.tok_embed.weight[:, tok] = torch.eye(v)
        native.pos.weight[:, pos] = torch.eye(n)
        for layer in (0, 1):
            attn = native.layers[layer].attn
            for head in (0, 1):
                rows = slice(head * d, (head + 1) * d)
                attn.q.weight[rows] = w_q[layer, head].T
                attn.k.weight[rows] = torch.eye(d)
                attn.v.weight[rows] = torch.eye(d)
                attn.o.weight[:, rows] = w_o[layer, head].T
    return model, task


@pytest.mark.parametrize("kind", ["classic", "pointer"])
def test_both_hand_built_models_have_an_induction_head_and_the_detector_tells_which(kind):
    model, task = _hand_built(kind)
    values = head_probe_values(model, task.vocab_size, task.bos, task.n_ctx)
    assert values["heads/induction/L1H0"] > 0.8  # both really are induction heads (at most 9/10 here) ...
    assert values["induction_heads"] == ["L1H0"]
    scores = induction_mechanism_scores(model)
    token_k, position_q = float(scores["token_k"][1, 0]), float(scores["position_q"][1, 0])
    if kind == "classic":  # ... built on a previous-token head, or on a duplicate-token head
        assert values["heads/prev_token/L0H0"] > 0.9
        assert token_k > 0.1 and position_q == 0
        assert values["pointer_heads"] == [] and values["heads/pointer/count"] == 0
    else:
        assert values["heads/duplicate/L0H0"] > 0.9
        assert position_q > 0.1 and token_k == 0
        assert values["pointer_heads"] == ["L1H0"] and values["heads/pointer/count"] == 1
    assert (scores["token_k"][0] == 0).all() and (scores["position_q"][0] == 0).all()  # nothing before layer 0


def test_random_weights_score_about_one_over_root_d_model():
    task = make_task("induction")
    model = build_model(ModelConfig(n_layers=2, d_model=64, n_heads=4, attn_only=True, seed=3), task)
    scores = induction_mechanism_scores(model)
    for kind in ("token_k", "position_q"):
        assert ((scores[kind][1] > 0.5 / 64 ** 0.5) & (scores[kind][1] < 3 / 64 ** 0.5)).all(), scores[kind]

"""Composition scores between attention heads (Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits", section "Virtual weights and composition").

score(A, B) = ||A B||_F / (||A||_F ||B||_F), A = W_V W_O of the earlier head, B = W_Q W_K^T of
the later head (Q), its transpose (K) or its W_V W_O (V); pairs with layer(l1) < layer(l2) only,
computed on the factored forms in d_head x d_head space. The weights are scored as the residual
stream sees them (the norm's scale folded in; centred over d_model in LayerNorm models, as
TransformerLens's fold_ln and center_writing_weights leave them): docs/reference.md. Random
matrices score about 1/sqrt(d_model) (the analytic baseline; the empirical one samples Gaussian
matrices of the model's shapes); the score is scale-free, so comparable across training.

Keys: `comp/<q,k,v>/L<l1>H<h1>-L<l2>H<h2>`, `comp/<q,k,v>/max`, `comp/<q,k,v>/count` (pairs
above `factor` x baseline), `comp/baseline`, `comp/baseline_analytic`; arrays `q`, `k`, `v`
([layer, head, layer, head], NaN where l1 >= l2) and `<q,k,v>_pairs`. Public: `composition_probe`,
`composition_scores`, `composition_matrix`, `factored_norm_sq`, `head_weights`, `random_baseline`.
"""

from __future__ import annotations

import functools
import math

import torch
from jaxtyping import Float
from torch import Tensor

from phasewatch.models import head_label
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe


def factored_norm_sq(u: Float[Tensor, "... d r"], v: Float[Tensor, "... r d"]) -> Tensor:
    """||u v||_F^2 via r x r Gram matrices: tr((u^T u)(v v^T))."""
    return torch.einsum("...ij,...ji->...", u.transpose(-2, -1) @ u, v @ v.transpose(-2, -1))


def composition_matrix(
    u1: Float[Tensor, "n1 d r"], v1: Float[Tensor, "n1 r d"], u2: Float[Tensor, "n2 d r"], v2: Float[Tensor, "n2 r d"]
) -> Float[Tensor, "n1 n2"]:
    """score(u1 v1, u2 v2) for every pair: ||u1 (v1 u2) v2|| / (||u1 v1|| ||u2 v2||); 0 where
    a matrix is zero (a head that writes or reads nothing composes with nothing, e.g. one
    writing only along the all-ones direction, which LayerNorm's centring removes)."""
    m = torch.einsum("ard,bds->abrs", v1, u2)  # (n1, n2, r, r)
    return _scores(u1, v1, u2, v2, m, pairs=False)


def _scores(u1: Tensor, v1: Tensor, u2: Tensor, v2: Tensor, m: Tensor, pairs: bool) -> Tensor:
    """`composition_matrix` given m = v1 u2: of every (first, second) matrix, m (n1, n2, r, r);
    or, `pairs`, of the first and the second of each pair i only, m (n, r, r)."""
    g1 = u1.transpose(-2, -1) @ u1  # (n1, r, r)
    g2 = v2 @ v2.transpose(-2, -1)  # (n2, r, r)
    # ||u1 m v2||^2 = tr(m^T g1 m g2) = sum of the entries of (g1 m) * (m g2), g1 being symmetric
    # (two batched products: a four-operand einsum searches its contraction path at every call)
    prod = ((g1 @ m) * (m @ g2)).sum((-2, -1)) if pairs else ((g1[:, None] @ m) * (m @ g2[None])).sum((-2, -1))
    n1 = factored_norm_sq(u1, v1).clamp_min(0).sqrt()
    n2 = factored_norm_sq(u2, v2).clamp_min(0).sqrt()
    denominator = n1 * n2 if pairs else n1[:, None] * n2[None, :]
    return torch.where(denominator > 0, prod.clamp_min(0).sqrt() / denominator.clamp_min(1e-300), 0.0)


def head_weights(model) -> dict[str, Tensor]:
    """W_Q, W_K, W_V [layer, head, d_model, d_head] and W_O [layer, head, d_head, d_model]
    in float64, as the residual stream sees them: each block's ln1 scale folded into the
    reading weights, then, in a LayerNorm model, every matrix centred over its d_model axis
    (the reading weights over their rows, W_O over its columns)."""
    w = {name: getattr(model, name).detach().double() for name in ("W_Q", "W_K", "W_V", "W_O")}
    for layer in range(w["W_Q"].shape[0]):
        scale = _ln1_scale(model, layer)
        if scale is not None:
            for name in ("W_Q", "W_K", "W_V"):
                w[name][layer] = scale[:, None] * w[name][layer]
    if _ln_centres(model):
        for name in ("W_Q", "W_K", "W_V"):
            w[name] = w[name] - w[name].mean(-2, keepdim=True)
        w["W_O"] = w["W_O"] - w["W_O"].mean(-1, keepdim=True)
    return w


def _ln_centres(model) -> bool:
    """Whether the norm in front of every reader subtracts the mean over d_model
    (LayerNorm, with or without weights; not RMSNorm, not none)."""
    return getattr(model.cfg, "normalization_type", None) in ("LN", "LNPre")


def _ln1_scale(model, layer: int) -> Tensor | None:
    try:
        scale = model.blocks[layer].ln1.w
    except AttributeError:  # no LayerNorm: nothing to fold
        return None
    return None if scale is None else scale.detach().double()


def composition_scores(model) -> dict[str, Float[Tensor, "layer head layer head"]]:
    """Q-, K- and V-composition for every head pair, NaN where layer(l1) >= layer(l2)."""
    return scores_of_weights(head_weights(model))


def scores_of_weights(w: dict[str, Tensor]) -> dict[str, Float[Tensor, "layer head layer head"]]:
    """`composition_scores` of the weights `head_weights` gives."""
    n_layers, n_heads = w["W_Q"].shape[:2]
    flat = {k: v.flatten(0, 1) for k, v in w.items()}  # (layer*head, ...)
    ov_u, ov_v = flat["W_V"], flat["W_O"]  # A = W_V W_O
    qk_u, qk_v = flat["W_Q"], flat["W_K"].transpose(-2, -1)  # B = W_Q W_K^T
    scores = {
        "q": composition_matrix(ov_u, ov_v, qk_u, qk_v),
        "k": composition_matrix(ov_u, ov_v, qk_v.transpose(-2, -1), qk_u.transpose(-2, -1)),  # B^T = W_K W_Q^T
        "v": composition_matrix(ov_u, ov_v, ov_u, ov_v),
    }
    layer = torch.arange(n_layers, device=w["W_Q"].device).repeat_interleave(n_heads)
    invalid = layer[:, None] >= layer[None, :]
    return {k: s.masked_fill(invalid, float("nan")).reshape(n_layers, n_heads, n_layers, n_heads)
            for k, s in scores.items()}


@functools.cache
def random_baseline(d_model: int, d_head: int, samples: int = 256, seed: int = 0) -> float:
    """Mean composition score of Gaussian matrices shaped like two heads' W_V W_O
    (computed once per shape)."""
    g = torch.Generator().manual_seed(seed)
    u1, v1, u2, v2 = [torch.randn(samples, *shape, generator=g, dtype=torch.float64)
                      for shape in ((d_model, d_head), (d_head, d_model), (d_model, d_head), (d_head, d_model))]
    # sample i's pair only (the diagonal of `composition_matrix`, not all samples^2 pairs)
    return float(_scores(u1, v1, u2, v2, v1 @ u2, pairs=True).mean())


#: a pair composes when its score is this many times the random baseline
COMPOSE_FACTOR = 1.6


def composition_probe_values(model, factor: float = COMPOSE_FACTOR, scores: dict[str, Tensor] | None = None,
                             shape: tuple[int, int] | None = None) -> dict:
    """Scalars and arrays of the composition probe (keys in the module docstring), and
    the pairs scoring above `factor` x the empirical baseline (`<kind>_pairs`,
    `comp/<kind>/count`). `scores`: the model's `composition_scores` when computed already;
    `shape`: its W_Q's (d_model, d_head) when read already (a bridge stacks W_Q at each read)."""
    scores = composition_scores(model) if scores is None else scores
    d_model, d_head = shape if shape is not None else model.W_Q.shape[-2:]
    baseline = random_baseline(d_model, d_head)
    out: dict = {"comp/baseline": baseline, "comp/baseline_analytic": 1 / math.sqrt(d_model)}
    for kind, s in scores.items():
        n_layers, n_heads = s.shape[:2]
        values = s.tolist()  # one conversion, not one per pair
        for l1 in range(n_layers):
            for h1 in range(n_heads):
                for l2 in range(l1 + 1, n_layers):
                    for h2 in range(n_heads):
                        out[f"comp/{kind}/{head_label(l1, h1)}-{head_label(l2, h2)}"] = values[l1][h1][l2][h2]
        if n_layers > 1:
            out[f"comp/{kind}/max"] = float(torch.nan_to_num(s, nan=-1.0).max())
        pairs = [f"{head_label(a, b)}-{head_label(c, d)}"
                 for a, b, c, d in (torch.nan_to_num(s, nan=0.0) > factor * baseline).nonzero().tolist()]
        out[f"comp/{kind}/count"] = float(len(pairs))
        out[f"{kind}_pairs"] = pairs
        out[kind] = s
    return out


KEYS = KeyFamilies(
    detail=r"^comp/[qkv]/L\d+H\d+",  # one pair of heads
    tracked=r"[qkv]_pairs",
    tracked_names={f"{kind}_pairs": f"{kind.upper()}-composing head pairs (earlier-later)" for kind in "qkv"},
    panels=(Panel("composition: maximum per kind and random baseline",
                  ("comp/k/max", "comp/q/max", "comp/v/max", "comp/baseline")),),
    hidden=("comp/",),
    headline=("comp/k/max",),
)


@register_probe("composition", applies_to=lambda task: True, cheap=True,
                default=lambda task: task.name in ("induction", "rasp"), keys=KEYS)
def composition_probe(model, task, factor: float = COMPOSE_FACTOR) -> dict:
    """`composition_probe_values`: every Q/K/V score, their maxima, the baselines and
    the composing pairs. Option `factor` (default 1.6): composing = above factor x baseline."""
    return composition_probe_values(model, factor)

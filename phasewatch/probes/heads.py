"""Head detectors that need no tokenizer (Olsson et al. 2022; Elhage et al. 2021), on
generated repeated random tokens: previous-token, duplicate-token, induction and copying
scores per head, the induction mechanism from the weights (token_k, position_q, pointer
heads) and the in-context-learning gap. Keys: `heads/<type>/L<l>H<h>`, `heads/<type>/max`,
`heads/<type>/count`, `icl/...`; arrays: the score matrices and the heads above threshold.
The definitions as implemented: docs/reference.md ("The heads probe, as implemented")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from phasewatch.models import head_label
from phasewatch.probes.composition import composition_matrix
from phasewatch.phases.stages import Signature
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.tasks.base import step_generator

#: a head is called a previous-token / duplicate / induction head above these scores
THRESHOLDS = {"prev_token": 0.4, "duplicate": 0.4, "induction": 0.4}


def repeated_tokens(vocab_size: int, bos: int, rep_len: int, batch: int, seed: int = 0) -> Int[Tensor, "batch pos"]:
    """BOS followed by `rep_len` random tokens from 0..vocab_size-1, twice."""
    g = step_generator(seed, 0, stream=7)
    half = torch.randint(0, vocab_size, (batch, rep_len), generator=g)
    return torch.cat([torch.full((batch, 1), bos), half, half], dim=1)


def previous_token_score(pattern: Float[Tensor, "batch head q k"]) -> Float[Tensor, "head"]:
    return pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, -1))


def induction_score(pattern: Float[Tensor, "batch head q k"], rep_len: int) -> Float[Tensor, "head"]:
    return pattern.diagonal(offset=1 - rep_len, dim1=-2, dim2=-1).mean(dim=(0, -1))


def duplicate_token_score(pattern: Float[Tensor, "batch head q k"], tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "head"]:
    n = tokens.shape[1]
    same = tokens[:, :, None] == tokens[:, None, :]
    earlier = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)
    dup = same & earlier  # (batch, q, k)
    has = dup.any(-1)  # queries with an earlier duplicate
    mass = (pattern * dup[:, None].to(pattern.dtype)).sum(-1)  # (batch, head, q)
    return (mass * has[:, None]).sum(dim=(0, 2)) / has.sum().clamp_min(1)


def copying_scores(model) -> Float[Tensor, "layer head"]:
    """Eigenvalue copying score of W_E W_V W_O W_U per head, from the d_head x d_head
    matrix W_O W_U W_E W_V, which has the same nonzero eigenvalues."""
    w_e, w_u = model.W_E.detach().double(), model.W_U.detach().double()
    w_v, w_o = model.W_V.detach().double(), model.W_O.detach().double()
    d_vocab = min(w_e.shape[0], w_u.shape[1])
    small = w_o @ w_u[:, :d_vocab] @ w_e[:d_vocab] @ w_v  # (layer, head, d_head, d_head)
    eig = torch.linalg.eigvals(small)
    return eig.real.sum(-1) / eig.abs().sum(-1).clamp_min(1e-30)


def induction_mechanism_scores(model) -> dict[str, Float[Tensor, "layer head"]]:
    """How each head of layer >= 1 could find "the token after the earlier copy", from
    the weights (0 for layer 0):

    - `token_k` (classic, K-composition with a previous-token head; Olsson et al. 2022):
      the largest over earlier heads E of ||W_QK^H (W_E W_OV^E)^T|| / (||W_QK^H|| ||W_E W_OV^E||),
      how much the head's keys read the token identities an earlier head moves;
    - `position_q` (pointer arithmetic: Q-composition through positional directions): the
      largest over earlier heads E of ||(W_pos W_OV^E) W_QK^H|| / (||W_pos W_OV^E|| ||W_QK^H||),
      how much its queries read the positions an earlier head moves (a duplicate-token head
      that writes where the earlier copy is, for the induction head to attend one further).

    W_QK = W_Q W_K^T and W_OV = W_V W_O (d_model x d_model). Of two random matrices both are
    about 1/sqrt(d_model), so they can be compared with each other. Both are composition
    scores (`composition_matrix`, from the factored matrices), of every head with every head
    in one call; each head keeps its largest over the heads of earlier layers."""
    w_q, w_k = model.W_Q.detach().double().flatten(0, 1), model.W_K.detach().double().flatten(0, 1)
    w_v, w_o = model.W_V.detach().double().flatten(0, 1), model.W_O.detach().double().flatten(0, 1)
    w_e = model.W_E.detach().double()
    w_pos = model.W_pos.detach().double() if getattr(model, "W_pos", None) is not None else None
    n_layers, n_heads = model.W_Q.shape[:2]
    zero = torch.zeros(n_heads, dtype=torch.float64, device=w_q.device)
    if n_layers < 2:
        return {"token_k": torch.stack([zero] * n_layers), "position_q": torch.stack([zero] * n_layers)}
    # W_QK^H (W_E W_OV^E)^T = (W_Q W_K^T)(W_O^T (W_E W_V)^T): [reading head, moving head]
    token_k = composition_matrix(w_q, w_k.transpose(-1, -2), w_o.transpose(-1, -2), (w_e @ w_v).transpose(-1, -2))
    # (W_pos W_OV^E) W_QK^H = ((W_pos W_V) W_O)(W_Q W_K^T): [moving head, reading head]
    position_q = None if w_pos is None else composition_matrix(w_pos @ w_v, w_o, w_q, w_k.transpose(-1, -2))
    # each layer's row stacked (no writes into a tensor: vmap-able, `weight_scores`)
    heads = [slice(layer * n_heads, (layer + 1) * n_heads) for layer in range(n_layers)]
    return {"token_k": torch.stack([zero] + [token_k[heads[layer], :layer * n_heads].amax(-1)
                                             for layer in range(1, n_layers)]),
            "position_q": torch.stack([zero] * n_layers if position_q is None else
                                      [zero] + [position_q[:layer * n_heads, heads[layer]].amax(0)
                                                for layer in range(1, n_layers)])}


def weight_scores(weights) -> dict[str, Float[Tensor, "layer head"]]:
    """The scores read from the weights alone (`copying_scores`, `induction_mechanism_scores`)
    of `weights` (a model, or `_Weights`): pure tensor work, so a population's members can
    be scored in one `torch.func.vmap` over their stacked `_Weights.tensors()`."""
    return {"copying": copying_scores(weights), **induction_mechanism_scores(weights)}


def pointer_heads(scores: dict[str, Tensor], induction_heads: list[str]) -> list[str]:
    """The induction heads whose queries read positions more than their keys read moved
    tokens (`position_q` > `token_k`): pointer arithmetic rather than the classic circuit."""
    return [label for label in induction_heads
            if float(scores["position_q"][_index(label)]) > float(scores["token_k"][_index(label)])]


def _index(label: str) -> tuple[int, int]:
    layer, head = label[1:].split("H")
    return int(layer), int(head)


def head_tokens(vocab_size: int, n_ctx: int, bos: int, rep_len: int | None = None,
                batch: int = 64) -> tuple[Int[Tensor, "batch pos"], int]:
    """The repeated random tokens that the scores are measured on, and their `rep_len`."""
    rep_len = rep_len or min(20, (n_ctx - 1) // 2)
    return repeated_tokens(vocab_size, bos, rep_len, batch), rep_len


def forward_scores(logits: Float[Tensor, "batch pos vocab"], patterns: list[Float[Tensor, "batch head q k"]],
                   tokens: Int[Tensor, "batch pos"], rep_len: int) -> dict[str, Tensor]:
    """The scores read from one forward pass on `head_tokens` (the logits and each layer's
    attention pattern): per head [layer, head] previous-token, duplicate and induction, and
    the mean loss on the first and the second copy (`first`, `second`, 0-d float64)."""
    patterns = [p.double() for p in patterns]
    # the positions that predict a token, sliced before the conversion (the same numbers; the
    # log-softmax then runs on a contiguous tensor, a quarter faster)
    logp = F.log_softmax(logits[:, :-1].double(), dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0]  # position i predicts token i+1
    # predicting tokens 2..L of each copy: positions 1..L-1 (first), L+1..2L-1 (second)
    return {"prev_token": torch.stack([previous_token_score(p) for p in patterns]),
            "duplicate": torch.stack([duplicate_token_score(p, tokens) for p in patterns]),
            "induction": torch.stack([induction_score(p, rep_len) for p in patterns]),
            "first": nll[:, 1:rep_len].mean(), "second": nll[:, rep_len + 1:2 * rep_len].mean()}


@torch.no_grad()
def head_scores(model, vocab_size: int, bos: int, n_ctx: int, rep_len: int | None = None, batch: int = 64,
                read: dict[str, Tensor] | None = None, weighed: dict[str, Tensor] | None = None) -> dict:
    """Every head score and the in-context-learning gap (see the module docstring). `read`:
    `forward_scores` of the model measured otherwise (over a population's stacked weights);
    `weighed`: its `weight_scores`, likewise."""
    tokens, rep_len = head_tokens(vocab_size, n_ctx, bos, rep_len, batch)
    if read is None:
        logits, cache = model.run_with_cache(tokens.to(next(model.parameters()).device),
                                             names_filter=lambda name: name.endswith("hook_pattern"))
        patterns = [cache[f"blocks.{layer}.attn.hook_pattern"].cpu() for layer in range(model.cfg.n_layers)]
        read = forward_scores(logits.cpu(), patterns, tokens, rep_len)
    weighed = weight_scores(_Weights(model)) if weighed is None else weighed
    scores = {**{k: read[k].cpu() for k in ("prev_token", "duplicate", "induction")},
              **{k: weighed[k].cpu() for k in ("copying", "token_k", "position_q")}}
    first, second = read["first"], read["second"]
    return {"scores": scores, "icl/loss_gap": float(second - first), "icl/first_copy_loss": float(first),
            "icl/second_copy_loss": float(second), "rep_len": rep_len}


class _Weights:
    """The weight matrices that the scores read, each taken from the model once (a bridge stacks
    every block's weights at each access); `_Weights(tensors=...)`: given (`tensors()`'s dict,
    e.g. one member's inside a vmap)."""

    NAMES = ("W_Q", "W_K", "W_V", "W_O", "W_E", "W_U")

    def __init__(self, model=None, tensors: dict[str, Tensor] | None = None):
        if tensors is None:
            tensors = {name: getattr(model, name).detach() for name in self.NAMES}
            w_pos = getattr(model, "W_pos", None)
            tensors["W_pos"] = None if w_pos is None else w_pos.detach()
        for name in self.NAMES:
            setattr(self, name, tensors[name])
        self.W_pos = tensors.get("W_pos")

    def tensors(self) -> dict[str, Tensor]:
        """The matrices by name (without W_pos when the model has none)."""
        return {name: getattr(self, name) for name in (*self.NAMES, "W_pos") if getattr(self, name) is not None}


def classify(scores: dict[str, Tensor], thresholds: dict[str, float] = THRESHOLDS) -> dict[str, list[str]]:
    """Labels (`L<l>H<h>`) of the heads whose score is above each kind's threshold."""
    return {kind: [head_label(int(l), int(h)) for l, h in (scores[kind] > thr).nonzero().tolist()]
            for kind, thr in thresholds.items()}


def head_probe_values(model, vocab_size: int, bos: int, n_ctx: int,
                      thresholds: dict[str, float] | None = None, read: dict[str, Tensor] | None = None,
                      weighed: dict[str, Tensor] | None = None) -> dict:
    """The probe's values (`head_scores`' scores as keys, the heads above `thresholds`)."""
    result = head_scores(model, vocab_size, bos, n_ctx, read=read, weighed=weighed)
    out: dict = {k: result[k] for k in ("icl/loss_gap", "icl/first_copy_loss", "icl/second_copy_loss")}
    for kind, s in result["scores"].items():
        values = s.tolist()  # one conversion, not one per head
        for layer in range(s.shape[0]):
            for head in range(s.shape[1]):
                out[f"heads/{kind}/{head_label(layer, head)}"] = values[layer][head]
        out[f"heads/{kind}/max"] = float(s.max())
        out[kind] = s
    for kind, labels in classify(result["scores"], {**THRESHOLDS, **(thresholds or {})}).items():
        out[f"heads/{kind}/count"] = float(len(labels))
        out[f"{kind}_heads"] = labels
    out["pointer_heads"] = pointer_heads(result["scores"], out["induction_heads"])
    out["heads/pointer/count"] = float(len(out["pointer_heads"]))
    return out


def _has_bos_vocab(task) -> bool:
    return hasattr(task, "bos") and hasattr(task, "vocab_size")


KEYS = KeyFamilies(
    detail=r"^heads/[^/]+/L\d+H\d+",  # one head
    tracked=r"\w+_heads",
    announced="induction_heads",
    panels=(Panel("loss on repeated random tokens", ("icl/first_copy_loss", "icl/second_copy_loss")),
            Panel("induction score per head", "heads/induction/L"),
            Panel("previous-token score per head", "heads/prev_token/L")),
    hidden=("heads/", "icl/loss_gap"),
    headline=("icl/loss_gap", "heads/induction/max", "heads/prev_token/max"),
    stages=(Signature("induction heads form",
                      moves=("heads/induction/count up | heads/induction/max up",
                             "icl/loss_gap down | icl/second_copy_loss down"),
                      crosses=(f"heads/induction/max >= {THRESHOLDS['induction']}",),
                      source="Olsson et al. 2022, sec. 3 (argument 1): induction heads form (heads pass the induction "
                             "score's threshold) as in-context learning improves, in one phase change"),),
)


@register_probe("heads", applies_to=_has_bos_vocab, cheap=True, default=lambda task: task.name == "induction",
                keys=KEYS)
def heads_probe(model, task, thresholds: dict[str, float] | None = None) -> dict:
    """`head_probe_values` on repeated random tokens from the task's vocabulary. Option
    `thresholds`: {"prev_token": 0.4, "duplicate": 0.4, "induction": 0.4} by default."""
    return head_probe_values(model, task.vocab_size, task.bos, task.n_ctx, thresholds)

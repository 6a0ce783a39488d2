"""A bridge's native model without the bridge: `plain_twin(model)` is TransformerLens's plain
`NativeModel` built again from the bridge's config (no hook points, no bridge components around
its modules), for passes that supply every parameter (`call_with`) and read no hook: the
vectorised step of a population and of a member re-run alone. Its parameter names are the
bridge's native module's without `._original_component` (`plain_twin`'s second value maps
them). It computes what the bridge computes, but rounds otherwise in places (reverse's key
biases' gradients, zero in exact arithmetic), so a pass to be repeated bit for bit must be
run through the twin both times. Any other model is its own twin.

`stacked_logits` is the twin's forward pass written with a leading member dimension (batched
matrix products over the members' stacked parameters): the same kernels on the same shapes as
`torch.func.vmap` of the twin runs, so the same logits and gradients bit for bit on the CPU
(tests/unit/test_stacked_logits.py), in about half the host calls. It covers the twin's
standard layouts (learned positions, no or LayerNorm normalization, plain MLPs, causal or
bidirectional attention, a padding mask); None for any other, which vmap then runs."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from phasewatch.models.factory import native_module

_KEPT = "_phasewatch_plain_twin"  # in the bridge's __dict__: kept, not registered as a submodule


def plain_twin(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, str]]:
    """(the twin, {the native module's parameter name: the twin's}), built once per model
    (without touching the global random state) and kept on it (a deep copy carries its own);
    (the native module, names unchanged) where the model is not a bridge around a
    `NativeModel` or the twin's names do not match."""
    native = native_module(model)
    kept = model.__dict__.get(_KEPT)
    if kept is None:
        kept = model.__dict__[_KEPT] = _build(native)
    twin, names = kept
    device = next(native.parameters()).device
    if next(twin.parameters()).device != device:  # the bridge moved since (buffers such as the causal mask)
        twin.to(device)
    return twin, names


def _build(native: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, str]]:
    from transformer_lens.model_bridge.sources.native import NativeModel

    same = (native, {name: name for name, _ in native.named_parameters()})
    if type(native) is not NativeModel:
        return same
    with torch.random.fork_rng(devices=[]):
        twin = NativeModel(copy.deepcopy(native.cfg))
    names = {name: name.replace("._original_component", "") for name, _ in native.named_parameters()}
    shapes = {name: p.shape for name, p in twin.named_parameters()}
    if sorted(names.values()) != sorted(shapes) or any(
            shapes[names[name]] != p.shape for name, p in native.named_parameters()):
        return same
    param = next(native.parameters())
    return twin.to(device=param.device, dtype=param.dtype), names


#: the twin's activations `stacked_logits` covers (elementwise, as the twin applies them)
_ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
         "swish": F.silu}


def stacked_logits(twin: torch.nn.Module, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   attend: torch.Tensor | None = None) -> torch.Tensor | None:
    """The logits of `twin` (`plain_twin`) for a stack of members: `params` every parameter of the
    twin with a leading member dimension N (named as `twin.named_parameters()`), `tokens` the
    members' inputs (N, batch, positions) and `attend` their padding mask (1: a real position) or
    None. What `vmap` of the twin's forward gives, bit for bit: each operation the one vmap's
    batching rules run (the token embedding as one table of N x rows, the positions as each
    member's rows, linear maps as batched products, LayerNorm's scale and shift after the
    normalisation, the attention mask as a selection). None where the twin is not one
    `_covered` (vmap then runs it) or the stack holds fewer than 2 members (a stack of one runs
    doubled: `vectorised_outputs`)."""
    n, batch, seq = tokens.shape
    if n < 2 or not _covered(twin):
        return None
    cfg = twin.cfg
    p = params
    offsets = torch.arange(n, device=tokens.device)[:, None, None]
    table = p["tok_embed.weight"]
    hidden = F.embedding(tokens + offsets * table.shape[1], table.flatten(0, 1)).flatten(1, 2)
    # the positions, the same for every member: their rows of each member's table (vmap's rule)
    positions = torch.arange(seq, device=tokens.device).expand(batch, seq).flatten()
    hidden = hidden + p["pos.weight"].index_select(1, positions)
    pad = None if attend is None else ~attend.bool()[:, :, None, None, :]
    for i, layer in enumerate(twin.layers):
        at = f"layers.{i}."
        attn = layer.attn
        x = _norm(layer.ln1, p, at + "ln1.", hidden)
        q, k, v = (_linear(x, p, f"{at}attn.{name}.").view(n * batch, seq, attn.n_heads, attn.d_head).transpose(1, 2)
                   for name in "qkv")
        scores = torch.matmul(q, k.transpose(-2, -1)) / attn.scale
        block = (attn.causal_mask[:seq, :seq] if attn.causal
                 else torch.zeros(seq, seq, dtype=torch.bool, device=scores.device))
        if pad is not None:
            block = block | pad
            scores = scores.view(n, batch, *scores.shape[1:])
        # (torch.where: the values of the twin's masked_fill, forward and backward, at about half its cost)
        pattern = torch.where(block, 0.0, F.softmax(torch.where(block, float("-inf"), scores), dim=-1))
        mixed = torch.matmul(pattern.view(n * batch, *pattern.shape[-3:]), v)
        hidden = hidden + _linear(mixed.transpose(1, 2).contiguous().view(n, batch * seq, -1), p, at + "attn.o.")
        if not cfg.attn_only:
            x = _norm(layer.ln2, p, at + "ln2.", hidden)
            mid = _ACTS[(cfg.act_fn or "gelu").lower()](_linear(x, p, at + "mlp.fc_in."))
            hidden = hidden + _linear(mid, p, at + "mlp.fc_out.")
    hidden = _norm(twin.ln_out, p, "ln_out.", hidden)
    return _linear(hidden, p, "head.").view(n, batch, seq, -1)


def _linear(x: torch.Tensor, params: dict[str, torch.Tensor], at: str) -> torch.Tensor:
    """`F.linear` of every member (x: N, rows, in) as vmap runs it: a batched product, then the bias."""
    out = torch.bmm(x, params[at + "weight"].transpose(1, 2))
    bias = params.get(at + "bias")
    return out if bias is None else out + bias.unsqueeze(1)


def _norm(module: torch.nn.Module, params: dict[str, torch.Tensor], at: str, x: torch.Tensor) -> torch.Tensor:
    """The block's normalization (`_covered`: none or LayerNorm) of every member, as vmap runs
    LayerNorm with batched weights: normalised without them, then scaled and shifted."""
    if isinstance(module, torch.nn.Identity):
        return x
    out = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    weight, bias = params.get(at + "weight"), params.get(at + "bias")
    if weight is not None:
        out = out * weight.unsqueeze(1)
    return out if bias is None else out + bias.unsqueeze(1)


def _covered(twin: torch.nn.Module) -> bool:
    """Whether `stacked_logits` computes `twin`'s forward: TransformerLens's plain NativeModel
    with learned positions, every head its own keys and values, no soft caps, LayerNorm or no
    normalization, and plain MLPs of an elementwise activation (checked once per twin)."""
    known = twin.__dict__.get("_phasewatch_stackable")
    if known is None:
        known = twin.__dict__["_phasewatch_stackable"] = _check(twin)
    return known


def _check(twin: torch.nn.Module) -> bool:
    from transformer_lens.model_bridge.sources.native.model import NativeAttention, NativeMLP, NativeModel
    from transformer_lens.utilities.activation_functions import softcap_enabled

    if type(twin) is not NativeModel or twin.pos is None or twin.rotary is not None:
        return False
    if any(type(e) is not torch.nn.Embedding or e.padding_idx is not None or e.max_norm is not None
           or e.scale_grad_by_freq or e.sparse for e in (twin.tok_embed, twin.pos)):
        return False
    cfg = twin.cfg
    if softcap_enabled(twin.output_logits_soft_cap):
        return False

    def norm_ok(module) -> bool:
        return isinstance(module, torch.nn.Identity) or (type(module) is torch.nn.LayerNorm
                                                         and module.elementwise_affine
                                                         and len(module.normalized_shape) == 1)

    if not norm_ok(twin.ln_out):
        return False
    for layer in twin.layers:
        attn = layer.attn
        if (type(attn) is not NativeAttention or attn.kv_repeats != 1 or attn.rotary is not None
                or softcap_enabled(attn.attn_scores_soft_cap) or not norm_ok(layer.ln1)):
            return False
        if not cfg.attn_only and (type(layer.mlp) is not NativeMLP or layer.mlp.ln is not None
                                  or (cfg.act_fn or "gelu").lower() not in _ACTS or not norm_ok(layer.ln2)):
            return False
    return True

"""Named model components (`L1H2`, `L0.attn`, `L0.mlp`, `embed`, `pos_embed`, `unembed`):
parsing, the parameters that hold each one's weights, and forward hooks on the plain
PyTorch module that replace each one's output (interventions).
"""

from __future__ import annotations

import torch

from phasewatch.errors import ConfigError


def head_label(layer: int, head: int) -> str:
    """The name of head `head` of layer `layer` in keys and labels: `L1H2` (what parse_component reads)."""
    return f"L{layer}H{head}"


def parse_component(component: str, n_layers: int, n_heads: int) -> tuple[str, int | None, int | None]:
    """`L1H2` -> ("head", 1, 2); `L0.attn` / `L0.mlp` -> ("attn"/"mlp", 0, None);
    `embed`, `pos_embed`, `unembed` -> (name, None, None). ConfigError otherwise."""
    import re

    match = re.fullmatch(r"L(\d+)(?:H(\d+)|\.(attn|mlp))", component)
    if component in ("embed", "pos_embed", "unembed"):
        return component, None, None
    if match is None:
        raise ConfigError("interventions.items", f"unknown component {component!r}",
                          "Name a head L<layer>H<head>, a layer's L<layer>.attn or L<layer>.mlp, embed, pos_embed "
                          "or unembed.")
    layer = int(match.group(1))
    head = None if match.group(2) is None else int(match.group(2))
    if layer >= n_layers or (head is not None and head >= n_heads):
        raise ConfigError("interventions.items", f"component {component!r} is not in a model with {n_layers} "
                          f"layer(s) of {n_heads} head(s)", "Count layers and heads from 0.")
    return ("head" if head is not None else match.group(3)), layer, head


def component_parameters(model, component: str) -> list[tuple[torch.nn.Parameter, tuple]]:
    """(parameter, index) pairs holding `component`'s weights: a head's rows of W_Q, W_K,
    W_V (and their biases) and its columns of W_O; a layer's whole attention or MLP; the
    embeddings or the unembedding. `index` selects the component's part of the tensor."""
    cfg = model.cfg
    kind, layer, head = parse_component(component, cfg.n_layers, cfg.n_heads)
    native = model.original_model
    if kind in ("embed", "pos_embed", "unembed"):
        module = {"embed": native.tok_embed, "pos_embed": native.pos, "unembed": native.head}[kind]
        return [(p, (slice(None),)) for p in module.parameters()]
    block = native.layers[layer]
    if kind == "mlp":
        if cfg.attn_only:
            raise ConfigError("interventions.items", f"{component}: the model is attention-only", "Pick a head or L<l>.attn.")
        return [(p, (slice(None),)) for p in block.mlp.parameters()]
    attn = block.attn
    if kind == "attn":
        return [(p, (slice(None),)) for lin in (attn.q, attn.k, attn.v, attn.o) for p in (lin.weight, lin.bias)]
    rows = slice(head * cfg.d_head, (head + 1) * cfg.d_head)
    out = [(p, (rows,)) for lin in (attn.q, attn.k, attn.v) for p in (lin.weight, lin.bias)]
    return out + [(attn.o.weight, (slice(None), rows))]


def register_component_hook(model, component: str, replace) -> torch.utils.hooks.RemovableHandle:
    """A forward hook on the plain PyTorch module (so it acts in training and through the
    bridge alike) that swaps `component`'s output for `replace(output)`: a head's slice of
    the input of W_O (its z), a layer's attention output, or its MLP output."""
    cfg = model.cfg
    kind, layer, head = parse_component(component, cfg.n_layers, cfg.n_heads)
    block = model.original_model.layers[layer] if layer is not None else None
    if kind == "head":
        rows = slice(head * cfg.d_head, (head + 1) * cfg.d_head)

        def pre_hook(module, args):
            z = args[0].clone()
            z[..., rows] = replace(z[..., rows])
            return (z, *args[1:])

        return block.attn.o.register_forward_pre_hook(pre_hook)
    if kind == "attn":
        return block.attn.register_forward_hook(lambda module, args, out: (replace(out[0]), *out[1:]))
    if kind == "mlp":
        return block.mlp.register_forward_hook(lambda module, args, out: replace(out))
    raise ConfigError("interventions.items", f"{component!r} cannot be ablated", "Ablate a head, L<l>.attn or L<l>.mlp.")

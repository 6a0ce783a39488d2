"""The model factory: the one module that knows TransformerLens internals.

Models are TransformerLens 4 bridges built with `TransformerBridge.boot_native` from a
`ModelConfig`, with the usual hooks (`blocks.L.attn.hook_pattern`, ...) and weight views
(`W_E`, `W_Q`, `W_U`, ...). Unset fields (None) take the task's default
(`Task.default_model()`), then the generic defaults below.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from phasewatch.tasks.base import ConfigError, Task, require, require_int

ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "solu")
NORMALIZATIONS = ("none", "LN", "LNPre", "RMS", "RMSPre")
ATTENTION = ("causal", "bidirectional")

GENERIC_DEFAULTS: dict[str, Any] = dict(
    n_layers=2, d_model=128, n_heads=4, d_head=None, d_mlp=None, attn_only=False, act_fn="relu",
    normalization="none", attention="causal", n_ctx=None, attn_bias=True, seed=None,
)


@dataclasses.dataclass
class ModelConfig:
    """Architecture of the trained transformer. None means "the task's default".

    Attributes:
        n_layers, d_model, n_heads: depth and width.
        d_head: per-head width (default d_model // n_heads).
        d_mlp: MLP width (default 4 * d_model); ignored when attn_only.
        attn_only: no MLP layers.
        act_fn: one of relu, gelu, gelu_new, silu, solu.
        normalization: none, LN, LNPre, RMS or RMSPre.
        attention: causal or bidirectional.
        n_ctx: context length (default: the task's longest input).
        attn_bias: learn biases in the attention (False keeps them at zero, as in
            Nanda et al. 2023, whose model has biases only in the MLP).
        seed: weight-initialisation seed (default: drawn from the global seed).
    """

    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    d_head: int | None = None
    d_mlp: int | None = None
    attn_only: bool | None = None
    act_fn: str | None = None
    normalization: str | None = None
    attention: str | None = None
    n_ctx: int | None = None
    attn_bias: bool | None = None
    seed: int | None = None

    def resolve(self, task: Task) -> "ModelConfig":
        """A copy with every unset field filled from the task and the generic defaults,
        checked against the task. Raises ConfigError naming the field and the fix."""
        values = {**GENERIC_DEFAULTS, **task.default_model()}
        values.update({k: v for k, v in dataclasses.asdict(self).items() if v is not None})
        for field in ("n_layers", "d_model", "n_heads"):
            require_int(values[field], f"model.arch.{field}", 1)
        if values["d_head"] is None:
            require(values["d_model"] % values["n_heads"] == 0, "model.arch.n_heads",
                    f"d_model {values['d_model']} is not divisible by n_heads {values['n_heads']}",
                    "Set d_head explicitly or choose n_heads dividing d_model.")
            values["d_head"] = values["d_model"] // values["n_heads"]
        require_int(values["d_head"], "model.arch.d_head", 1)
        if values["d_mlp"] is None:
            values["d_mlp"] = 4 * values["d_model"]
        require_int(values["d_mlp"], "model.arch.d_mlp", 1)
        require(values["act_fn"] in ACTIVATIONS, "model.arch.act_fn", f"unknown activation {values['act_fn']!r}",
                f"Use one of {', '.join(ACTIVATIONS)}.")
        require(values["normalization"] in NORMALIZATIONS, "model.arch.normalization",
                f"unknown normalization {values['normalization']!r}", f"Use one of {', '.join(NORMALIZATIONS)}.")
        require(values["attention"] in ATTENTION, "model.arch.attention",
                f"unknown attention direction {values['attention']!r}", f"Use one of {', '.join(ATTENTION)}.")
        if values["attention"] == "causal" and not task.causal:
            raise ConfigError(
                "model.arch.attention",
                f"the task ({task.name}) reads later positions, which causal attention cannot see",
                "Use attention: bidirectional (the default for this task).",
            )
        if values["n_ctx"] is None:
            values["n_ctx"] = task.n_ctx
        require_int(values["n_ctx"], "model.arch.n_ctx", 1)
        require(values["n_ctx"] >= task.n_ctx, "model.arch.n_ctx",
                f"context {values['n_ctx']} is shorter than the task's inputs ({task.n_ctx} tokens)",
                f"Set n_ctx >= {task.n_ctx} or leave it unset.")
        if values["seed"] is not None:
            require_int(values["seed"], "model.arch.seed", 0, "Use a seed >= 0, or leave it unset.")
        for flag in ("attn_only", "attn_bias"):
            require(isinstance(values[flag], bool), f"model.arch.{flag}", f"must be true or false, got {values[flag]!r}",
                    f"Set {flag}: true or false.")
        return ModelConfig(**values)


def build_model(cfg: ModelConfig, task: Task) -> torch.nn.Module:
    """A freshly initialised TransformerBridge for `task` (cfg is resolved first)."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)

    c = cfg.resolve(task)
    bridge_cfg = TransformerBridgeConfig(
        d_model=c.d_model, d_head=c.d_head, n_layers=c.n_layers, n_ctx=c.n_ctx, n_heads=c.n_heads,
        d_vocab=task.d_vocab, d_vocab_out=task.d_vocab_out, d_mlp=c.d_mlp, act_fn=c.act_fn,
        normalization_type=None if c.normalization == "none" else c.normalization, attn_only=c.attn_only,
        attention_dir=c.attention, seed=c.seed, tokenizer_prepends_bos=False,
    )
    model = TransformerBridge.boot_native(bridge_cfg)
    if not c.attn_bias:
        for block in model.original_model.layers:
            for proj in (block.attn.q, block.attn.k, block.attn.v, block.attn.o):
                torch.nn.init.zeros_(proj.bias)
                proj.bias.requires_grad_(False)
    return model


def native_module(model: torch.nn.Module) -> torch.nn.Module:
    """The plain PyTorch module inside a bridge (no hooks): use it where hooks are not
    needed and speed matters (the training step)."""
    return model.original_model


def undo_last_adamw_step(state_dict: dict, optimizer_state: dict) -> dict:
    """The weights before the optimizer step that produced `state_dict`, recovered from
    the AdamW state saved with them (torch's update: p <- p (1 - lr wd) - lr/bc1 * m /
    (sqrt(v)/sqrt(bc2) + eps), solved for the old p). Parameters are matched to the
    optimizer's indices in state-dict order, buffers (names ending in `mask`) skipped.

    Use it on the paper's checkpoints, whose stored losses were computed before their
    last step (their training loop records the loss, then steps, then stops)."""
    group = optimizer_state["param_groups"][0]
    lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
    names = [k for k in state_dict if not k.endswith("mask")]
    out = dict(state_dict)
    for i, name in enumerate(names):
        st = optimizer_state["state"][i]
        t = float(st["step"])
        denom = st["exp_avg_sq"].double().sqrt() / math.sqrt(1 - b2**t) + eps
        old = (state_dict[name].double() + (lr / (1 - b1**t)) * st["exp_avg"].double() / denom) / (1 - lr * wd)
        out[name] = old.to(state_dict[name].dtype)
    return out


def load_progress_measures_checkpoint(path: str, map_location: str = "cpu", before_last_step: bool = False):
    """Load a checkpoint of the progress-measures paper's code (Nanda et al. 2023,
    `torch.save` dict with `model` and `config`) into a phasewatch bridge.
    `before_last_step=True` loads the weights before the final optimizer step instead
    (`undo_last_adamw_step`), which are the ones its stored `train_loss`/`test_loss` describe.

    Returns `(model, task)`: the TransformerBridge with the paper's weights (their
    `W_E` (d_model, d_vocab) and `W_U` transposed into TransformerLens's layout, per-head
    `W_Q/W_K/W_V` (head, d_head, d_model) stacked) and the ModularAddition task with the
    paper's split for the stored `p`, `frac_train` and `seed`. Loaded with
    `weights_only=True`. Raises ValueError when the file is not such a checkpoint.
    """
    from phasewatch.tasks.modular_addition import ModularAddition

    ckpt = torch.load(path, map_location=map_location, weights_only=True)
    try:
        cfg, sd = ckpt["config"], ckpt["model"]
        if before_last_step:
            sd = undo_last_adamw_step(sd, ckpt["optimizer"])
        p, frac, seed = int(cfg["p"]), float(cfg["frac_train"]), int(cfg["seed"])
        n_heads, d_head, d_model = sd["blocks.0.attn.W_Q"].shape
        d_mlp = sd["blocks.0.mlp.W_in"].shape[0]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a progress-measures checkpoint (missing {err}); "
                         "expected a dict with 'model' and 'config' as saved by the paper's code") from err
    if cfg.get("fn_name", "add") != "add":
        raise ValueError(f"{path} trains {cfg['fn_name']!r}; only modular addition ('add') is supported")
    task = ModularAddition(p=p, op="+", frac_train=frac, seed=seed)
    model = build_model(ModelConfig(n_layers=1, d_model=d_model, n_heads=n_heads, d_head=d_head, d_mlp=d_mlp,
                                    act_fn="relu", normalization="none", attn_bias=False), task)
    native = model.original_model
    block = native.layers[0]
    with torch.no_grad():
        native.tok_embed.weight.copy_(sd["embed.W_E"].T)
        native.pos.weight.copy_(sd["pos_embed.W_pos"])
        for name, proj in (("W_Q", block.attn.q), ("W_K", block.attn.k), ("W_V", block.attn.v)):
            proj.weight.copy_(sd[f"blocks.0.attn.{name}"].reshape(n_heads * d_head, d_model))
        block.attn.o.weight.copy_(sd["blocks.0.attn.W_O"])
        block.mlp.fc_in.weight.copy_(sd["blocks.0.mlp.W_in"])
        block.mlp.fc_in.bias.copy_(sd["blocks.0.mlp.b_in"])
        block.mlp.fc_out.weight.copy_(sd["blocks.0.mlp.W_out"])
        block.mlp.fc_out.bias.copy_(sd["blocks.0.mlp.b_out"])
        native.head.weight.copy_(sd["unembed.W_U"].T)
    return model, task


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

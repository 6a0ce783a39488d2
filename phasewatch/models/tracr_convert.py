"""Importer for tracr's compiled transformers: TransformerLens's tracr converter
(`transformer_lens.utilities.tracr`), and a bridge rebuilt from a converted model's saved
config and weights.

Converting needs a compiled tracr model, so tracr and JAX are loaded already; rebuilding
from saved weights (`bridge_from_saved`) imports neither. The weights are the native
module's state dict; the bridge's own names for them (aliases of the same tensors) are
left to the bridge, so they load with `strict=False`.
"""

from __future__ import annotations

import torch

# The bridge-config fields that `bridge_from_saved` needs to rebuild a converted model.
SAVED_CONFIG_FIELDS = ("n_layers", "d_model", "d_head", "n_ctx", "d_vocab", "d_vocab_out", "d_mlp", "n_heads",
                       "act_fn", "attention_dir", "normalization_type")


def bridge_from_tracr(compiled, output_label: str) -> tuple[torch.nn.Module, object, dict]:
    """`(bridge, cfg, state_dict)` for a tracr-compiled model, converted with
    TransformerLens's tracr converter: the bridge with the converted weights loaded, the
    bridge config it was booted from, and the native module's state dict (not checked here
    against tracr's own outputs).

    `output_label` is tracr's label of the program's output SOp (`sop.label`, e.g.
    `shuffle_dyck_1`): the unembedding reads the residual dimensions `<output_label>:<value>`.
    The converter can guess it only when exactly one variable has the output's value set,
    which fails for boolean outputs (every boolean variable has the values {False, True})."""
    from transformer_lens.model_bridge import TransformerBridge
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)
    from transformer_lens.utilities import tracr as tl_tracr

    cfg = tl_tracr.make_tracr_transformer_bridge_config(compiled)
    bridge = TransformerBridge.boot_native(cfg)
    state = tl_tracr.make_tracr_transformer_bridge_state_dict(compiled, output_label)
    bridge.load_state_dict(state, strict=False)
    return bridge, cfg, state


def saved_config(cfg) -> dict:
    """The fields of a converted model's bridge config (`SAVED_CONFIG_FIELDS`) as a plain
    dict, to save beside its state dict."""
    return {k: getattr(cfg, k) for k in SAVED_CONFIG_FIELDS}


def bridge_from_saved(config: dict, state_dict: dict) -> torch.nn.Module:
    """A bridge booted from `saved_config`'s dict and loaded with the saved state dict
    (missing keys: the bridge's aliases of the same weights)."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)

    bridge = TransformerBridge.boot_native(TransformerBridgeConfig(**config))
    bridge.load_state_dict(state_dict, strict=False)
    return bridge


def layer_output_weights(state_dict: dict, layer: int) -> dict[str, torch.Tensor]:
    """`{"attn": W, "mlp": W}`: the output projections of `layer`'s attention and MLP in a
    native state dict, each (d_model, in), i.e. what each part writes to the residual stream."""
    return {"attn": state_dict[f"layers.{layer}.attn.o.weight"], "mlp": state_dict[f"layers.{layer}.mlp.fc_out.weight"]}

"""Importer for the checkpoints of the progress-measures paper's code (Nanda et al. 2023,
"Progress measures for grokking via mechanistic interpretability"): their weights in a
phasewatch bridge, optionally as they were before the last optimizer step.
"""

from __future__ import annotations

import math

import torch

from phasewatch.models.factory import ModelConfig, build_model


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

    try:  # tensors and plain data only: a crafted pickle is refused before it can run anything
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read it means the same to the user
        what = ("holds objects other than tensors and plain data, which phasewatch does not load"
                if "weights only" in str(err).lower() else f"cannot be read by torch.load ({type(err).__name__}: {err})")
        raise ValueError(f"{path} {what}; expected a checkpoint saved by the progress-measures paper's code") from None
    try:
        cfg, sd = ckpt["config"], ckpt["model"]
        if before_last_step:
            sd = undo_last_adamw_step(sd, ckpt["optimizer"])
        p, frac, seed = int(cfg["p"]), float(cfg["frac_train"]), int(cfg["seed"])
        n_heads, d_head, d_model = sd["blocks.0.attn.W_Q"].shape
        d_mlp = sd["blocks.0.mlp.W_in"].shape[0]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
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

"""The diff of two models of the same structure (`phasewatch diff`, cli/diff.py): for every
component (embed, pos_embed, each head, each layer's attention and MLP, unembed) and residual
site, on a sample of held-out data, `model_diff` measures the difference of the weights (and
of a head's QK and OV circuits), of the activations, direct logit attribution in each model,
and activation patching both ways with the share of the loss gap it recovers; also the
per-sequence losses and the sequences that changed most. Every quantity's definition:
docs/diff.md ("What model_diff measures")."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from phasewatch.models import component_parameters
from phasewatch.tasks.base import Batch, Task
from phasewatch.errors import ConfigError

STRUCTURE = ("n_layers", "n_heads", "d_model", "d_head", "d_mlp", "d_vocab", "d_vocab_out", "n_ctx", "attn_only",
             "normalization_type", "act_fn", "attention_dir")
SAME = 1e-6  # losses closer than this leave nothing to recover


@dataclasses.dataclass
class ModelDiff:
    """rows: one dict per component or site (keys `component`, `kind` and the measures of the
    module docstring; a measure that does not apply is absent); loss_a, loss_b: the held-out
    sample's losses; examples: the sequences whose loss changed most, most first
    (`tokens`, `loss_a`, `loss_b`)."""

    rows: list[dict[str, Any]]
    loss_a: float
    loss_b: float
    examples: list[dict[str, Any]]

    def row(self, component: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["component"] == component)


def check_same_structure(a, b) -> None:
    """ConfigError naming the first field in which the two models' architectures differ."""
    for field in STRUCTURE:
        va, vb = getattr(a.cfg, field, None), getattr(b.cfg, field, None)
        if va != vb:
            raise ConfigError("B", f"the models differ in {field}: {va!r} against {vb!r}",
                              "Diff checkpoints of models with the same architecture (the same run, two seeds of "
                              "one config, or runs that differ only in training settings).")


def diff_components(model) -> list[tuple[str, str]]:
    """(component, kind) in the order of the residual stream: embed, pos_embed (when the
    model has positional embeddings), per layer its heads, attention and MLP, then unembed."""
    cfg = model.cfg
    out = [("embed", "embed")] + ([("pos_embed", "embed")] if model.W_pos is not None else [])
    for layer in range(cfg.n_layers):
        out += [(f"L{layer}H{h}", "head") for h in range(cfg.n_heads)]
        out.append((f"L{layer}.attn", "attn"))
        if not cfg.attn_only:
            out.append((f"L{layer}.mlp", "mlp"))
    return out + [("unembed", "unembed")]


def _output_hooks(model) -> dict[str, str]:
    """component or site -> the bridge hook that holds its output (heads: hook_z, sliced)."""
    cfg = model.cfg
    hooks = {"embed": "hook_embed", "pos_embed": "hook_pos_embed", "resid_final": "ln_final.hook_in"}
    for layer in range(cfg.n_layers):
        hooks[f"resid_pre.L{layer}"] = f"blocks.{layer}.hook_resid_pre"
        hooks[f"L{layer}.z"] = f"blocks.{layer}.attn.hook_z"
        hooks[f"L{layer}.attn"] = f"blocks.{layer}.hook_attn_out"
        if not cfg.attn_only:
            hooks[f"L{layer}.mlp"] = f"blocks.{layer}.hook_mlp_out"
    return hooks


def _ln_final_scale_hook(model) -> str | None:
    return None if getattr(model.cfg, "normalization_type", None) is None else "ln_final.hook_scale"


def _run(model, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the outputs of every component and site, each head's output computed as
    z_h W_O^h (batch pos d_model)."""
    hooks = _output_hooks(model)
    names = set(hooks.values()) | {_ln_final_scale_hook(model)} - {None}
    logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    out = {label: cache[hook] for label, hook in hooks.items() if not label.endswith(".z")}
    for layer in range(model.cfg.n_layers):
        z = cache[hooks[f"L{layer}.z"]]
        for h in range(model.cfg.n_heads):
            out[f"L{layer}H{h}"] = z[:, :, h] @ model.W_O[layer, h]
        out[f"L{layer}.z"] = z
    if _ln_final_scale_hook(model):
        out["ln_final.scale"] = cache["ln_final.hook_scale"]
    return logits, out


def _through_final_norm(model, parts: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The final norm's linear part with its scale frozen (centre if LayerNorm, divide by
    `scale`, times its weight); `parts` (... d_model) with the positions' scale broadcast."""
    norm = getattr(model.cfg, "normalization_type", None)
    if norm is None:
        return parts
    if norm in ("LN", "LNPre"):
        parts = parts - parts.mean(-1, keepdim=True)
    parts = parts / scale
    weight = getattr(model.ln_final, "w", None)
    return parts if weight is None else parts * weight


@torch.no_grad()
def direct_logit_attribution(model, batch: Batch) -> dict[str, torch.Tensor]:
    """component -> its direct effect on the correct token's logit at every answer position
    (float64, one value per answer position of the batch): embed, pos_embed, each head,
    each layer's `L<l>.attn_bias` (b_O) and MLP, and `norm_bias` (the final LayerNorm's bias,
    0 without one). Together they sum to the logit."""
    return _logit_parts(model, _run(model, batch.tokens)[1], batch)


def _logit_parts(model, acts: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
    """`direct_logit_attribution` from the outputs of the model's run on the batch (`_run`)."""
    mask, targets = batch.loss_mask, batch.targets[batch.loss_mask]
    scale = acts["ln_final.scale"][mask].double() if "ln_final.scale" in acts else None
    unembed = model.W_U.double()[:, targets].T  # (answers, d_model)
    cfg = model.cfg
    out = {}
    for label in (c for c, kind in diff_components(model) if kind in ("embed", "head", "mlp")):
        out[label] = (_through_final_norm(model, acts[label][mask].double(), scale) * unembed).sum(-1)
    for layer in range(cfg.n_layers):
        bias = model.b_O[layer].double().expand(int(mask.sum()), -1)
        out[f"L{layer}.attn_bias"] = (_through_final_norm(model, bias, scale) * unembed).sum(-1)
    norm_bias = getattr(model.ln_final, "b", None) if getattr(cfg, "normalization_type", None) else None
    out["norm_bias"] = (unembed @ norm_bias.double()) if norm_bias is not None else torch.zeros(len(targets),
                                                                                                dtype=torch.float64)
    return out


def _loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Cross-entropy (float64) at every answer position: a (batch pos) tensor, 0 elsewhere."""
    per = F.cross_entropy(logits.double().transpose(1, 2), batch.targets, reduction="none")
    return per * batch.loss_mask


def _patched_logits(a, b, acts_b: dict[str, torch.Tensor], components: list[str], tokens: torch.Tensor):
    """A's logits with each of `components`' outputs replaced by B's (`acts_b`, from B's run
    on the same tokens); `unembed`: A's final residual read by B's final norm and unembedding."""
    hooks = _output_hooks(a)
    fwd = []
    heads: dict[int, list[int]] = {}
    for comp in components:
        if comp == "unembed":
            continue
        if comp in hooks:
            fwd.append((hooks[comp], lambda value, hook, new=acts_b[comp]: new))
        else:
            layer, head = (int(x) for x in comp[1:].split("H"))
            if f"L{layer}.attn" not in components:
                heads.setdefault(layer, []).append(head)
    for layer, chosen in heads.items():  # a head's output is z_h W_O^h: swapped in the layer's output
        z_now: dict[str, torch.Tensor] = {}

        def keep(value, hook, z_now=z_now):
            z_now["z"] = value

        def swap(value, hook, layer=layer, chosen=chosen, z_now=z_now):
            for h in chosen:
                value = value + acts_b[f"L{layer}H{h}"] - z_now["z"][:, :, h] @ a.W_O[layer, h]
            return value

        fwd += [(hooks[f"L{layer}.z"], keep), (hooks[f"L{layer}.attn"], swap)]
    if "unembed" not in components:
        return a.run_with_hooks(tokens, fwd_hooks=fwd)
    captured = {}
    fwd.append(("ln_final.hook_in", lambda value, hook: captured.setdefault("resid", value)))
    a.run_with_hooks(tokens, fwd_hooks=fwd)
    return _unembed(b, captured["resid"])


def _unembed(model, resid: torch.Tensor) -> torch.Tensor:
    """The model's logits from a final residual stream (its final norm, then W_U and b_U)."""
    return model.unembed(model.ln_final(resid))


def _weight_rows(a, b) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for comp, kind in diff_components(a):
        pa, pb = _parameters(a, comp), _parameters(b, comp)
        diff = sum(float(((x - y).double() ** 2).sum()) for x, y in zip(pa, pb)) ** 0.5
        size = sum(float((x.double() ** 2).sum()) for x in pa) ** 0.5
        out[comp] = {"weight_abs": diff, "weight_rel": _ratio(diff, size)}
        if kind == "head":
            layer, head = (int(x) for x in comp[1:].split("H"))
            for name, circuit in (("qk", _qk), ("ov", _ov)):
                ca, cb = circuit(a, layer, head), circuit(b, layer, head)
                d = float(torch.linalg.norm(cb - ca))
                out[comp] |= {f"{name}_abs": d, f"{name}_rel": _ratio(d, float(torch.linalg.norm(ca)))}
    return out


def _parameters(model, component: str) -> list[torch.Tensor]:
    """The component's weights (`component_parameters`), with the norm in front of it."""
    params = [p[index].detach() for p, index in component_parameters(model, component)]
    norm = None
    if component.endswith(".attn") or component.endswith(".mlp"):
        layer = int(component[1:].split(".")[0])
        norm = model.blocks[layer].ln1 if component.endswith(".attn") else model.blocks[layer].ln2
    elif component == "unembed":
        norm = model.ln_final
    return params + ([p.detach() for p in norm.parameters()] if norm is not None else [])


def _qk(model, layer: int, head: int) -> torch.Tensor:
    return model.W_Q[layer, head].double() @ model.W_K[layer, head].double().T


def _ov(model, layer: int, head: int) -> torch.Tensor:
    return model.W_V[layer, head].double() @ model.W_O[layer, head].double()


def _ratio(x: float, y: float) -> float | None:
    return x / y if y > 0 else None


@torch.no_grad()
def model_diff(a, b, task: Task, per_length: int | None = 256, top_examples: int = 10) -> ModelDiff:
    """The diff of models `a` and `b` (bridges of the same architecture: ConfigError
    otherwise) on `task`'s held-out data; see the module docstring."""
    check_same_structure(a, b)
    device = next(a.parameters()).device
    sums = _Sums.of(a)
    for batch in _held_out(task, per_length):
        sums.add(a, b, batch.to(device), top_examples)
    n = max(sums.n, 1)
    la, lb = sums.loss_a / n, sums.loss_b / n
    weights = _weight_rows(a, b)
    rows = [_component_row(comp, kind, weights.get(comp, {}), sums, la, lb, n) for comp, kind in sums.comps]
    rows += [{"component": site, "kind": "resid", **_act_measures(sums.sq[site])} for site in sums.sites]
    rows += [{"component": label, "kind": "bias", **_dla(label, sums, n)}
             for label in (f"L{layer}.attn_bias" for layer in range(a.cfg.n_layers))]
    examples = sorted(sums.examples, key=lambda e: abs(e["loss_b"] - e["loss_a"]), reverse=True)
    return ModelDiff(rows, la, lb, examples[:top_examples])


def _held_out(task: Task, per_length: int | None) -> list[Batch]:
    """The task's held-out batches (`val` group; all of them when none is), each cut to
    `per_length` sequences spread over it."""
    batches = [batch.spread(per_length) if per_length else batch
               for batch, group in zip(task.val_batches(), task.val_groups()) if group == "val"]
    return batches or list(task.val_batches())


@dataclasses.dataclass
class _Sums:
    """`model_diff`'s running sums over the held-out batches: per component or site
    [sum (B - A)^2, sum A^2, count] of its output (`sq`), each side's direct logit
    attribution (`dla`), each loss and the patched ones (`patched`, per component and way),
    the answer positions `n`, and each batch's most changed sequences."""

    comps: list[tuple[str, str]]
    sites: list[str]
    sq: dict[str, list]
    patched: dict[tuple[str, str], float]
    dla: dict[str, dict[str, float]] = dataclasses.field(default_factory=lambda: {"a": {}, "b": {}})
    loss_a: float = 0.0
    loss_b: float = 0.0
    n: int = 0
    examples: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, model) -> "_Sums":
        comps = diff_components(model)
        sites = [f"resid_pre.L{layer}" for layer in range(model.cfg.n_layers)] + ["resid_final"]
        sq = {name: [0.0, 0.0, 0] for name, _ in comps + [(s, "resid") for s in sites] if name != "unembed"}
        return cls(comps, sites, sq, {(comp, way): 0.0 for comp, _ in comps for way in ("b_into_a", "a_into_b")})

    def add(self, a, b, batch: Batch, top_examples: int) -> None:
        """One batch (on the models' device) of both models' runs."""
        logits_a, acts_a = _run(a, batch.tokens)
        logits_b, acts_b = _run(b, batch.tokens)
        for name, entry in self.sq.items():
            xa, xb = acts_a[name].double(), acts_b[name].double()
            entry[0] += float(((xb - xa) ** 2).sum())
            entry[1] += float((xa ** 2).sum())
            entry[2] += xa.numel()
        for side, model, acts in (("a", a, acts_a), ("b", b, acts_b)):
            for label, values in _logit_parts(model, acts, batch).items():
                self.dla[side][label] = self.dla[side].get(label, 0.0) + float(values.sum())
        loss_a, loss_b = _loss(logits_a, batch), _loss(logits_b, batch)
        self.loss_a += float(loss_a.sum())
        self.loss_b += float(loss_b.sum())
        self.n += int(batch.loss_mask.sum())
        for comp, _ in self.comps:
            self.patched[(comp, "b_into_a")] += float(_loss(_patched_logits(a, b, acts_b, [comp], batch.tokens),
                                                            batch).sum())
            self.patched[(comp, "a_into_b")] += float(_loss(_patched_logits(b, a, acts_a, [comp], batch.tokens),
                                                            batch).sum())
        counts = batch.loss_mask.sum(1).clamp_min(1)
        per_a, per_b = loss_a.sum(1) / counts, loss_b.sum(1) / counts
        for i in torch.argsort((per_b - per_a).abs(), descending=True)[:top_examples].tolist():
            self.examples.append({"tokens": batch.tokens[i].tolist(), "loss_a": float(per_a[i]),
                                  "loss_b": float(per_b[i])})


def _component_row(comp: str, kind: str, weights: dict[str, float], sums: _Sums, la: float, lb: float,
                   n: int) -> dict[str, Any]:
    """A component's row: its weights' difference, its output's, its direct logit
    attribution in each model, and patching each way (losses and the share of the gap)."""
    row: dict[str, Any] = {"component": comp, "kind": kind, **weights}
    if comp in sums.sq:
        row |= _act_measures(sums.sq[comp])
    if comp in sums.dla["a"]:
        row |= _dla(comp, sums, n)
    gap = la - lb
    row["patched_loss_a"] = sums.patched[(comp, "b_into_a")] / n
    row["patched_loss_b"] = sums.patched[(comp, "a_into_b")] / n
    row["patch_b_into_a"] = (la - sums.patched[(comp, "b_into_a")] / n) / gap if abs(gap) > SAME else None
    row["patch_a_into_b"] = (lb - sums.patched[(comp, "a_into_b")] / n) / -gap if abs(gap) > SAME else None
    return row


def _dla(label: str, sums: _Sums, n: int) -> dict[str, float]:
    """The direct logit attribution of `label` (a component, or a layer's b_O) in each model
    and its change, per answer position."""
    return {"dla_a": sums.dla["a"][label] / n, "dla_b": sums.dla["b"][label] / n,
            "dla_diff": (sums.dla["b"][label] - sums.dla["a"][label]) / n}


def _act_measures(entry: list) -> dict[str, float | None]:
    diff_sq, size_sq, count = entry
    return {"act_rms": (diff_sq / max(count, 1)) ** 0.5, "act_rel": _ratio(diff_sq ** 0.5, size_sq ** 0.5)}


def patched_logits(a, b, components: list[str], tokens: torch.Tensor) -> torch.Tensor:
    """A's logits on `tokens` with `components`' outputs patched in from B (for tests and
    notebooks: `model_diff` reports one component at a time)."""
    check_same_structure(a, b)
    with torch.no_grad():
        _, acts_b = _run(b, tokens)
        return _patched_logits(a, b, acts_b, components, tokens)

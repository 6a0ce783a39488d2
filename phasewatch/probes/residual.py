"""The residual stream and attention patterns of one forward pass of a model's native module.

`ResidualPass` runs the plain PyTorch module inside a TransformerLens bridge (no bridge hooks:
about half the time of `run_with_cache` on the small models here) with PyTorch hooks that keep,
per layer l, the tensors the bridge's hooks would have cached (TransformerLens names): `pre[l]`
(`blocks.l.hook_resid_pre`), `attn[l]` (the attention output as it enters the stream, after any
hook already on the attention module), `mid[l]` (`hook_resid_mid` = pre + attn), `pattern[l]`
([batch, head, query, key]), `z[l]` (`attn.hook_z` after any hook on W_O's input, flattened to
[batch, pos, head x d_head]), `post` (the last block's `hook_resid_post`), and with `outputs=True`
`attn_out[l]` and `mlp_out[l]` (as they leave the module, before any hook on it: what the ablation
probe replaces; `mlp_out` empty for an attention-only model); and the logits.

Hooks already on the model (an intervention's) act as in any forward pass. The same tensors as
the bridge's hooks (tests/integration/test_tracr_compare.py compares them).
"""

from __future__ import annotations

import torch


class ResidualPass:
    def __init__(self, native, tokens: torch.Tensor, mask: torch.Tensor | None = None, outputs: bool = False):
        self.native, self.mask = native, mask
        self.pre: list[torch.Tensor] = []
        self.attn: list[torch.Tensor] = []
        self.pattern: list[torch.Tensor] = []
        self.z: list[torch.Tensor] = []
        self.attn_out: list[torch.Tensor] = []
        self.mlp_out: list[torch.Tensor] = []
        self.post: torch.Tensor | None = None

        def keep_pre(module, args, out) -> None:
            self.pre.append(out)

        def keep_attn(module, args, out) -> None:
            self.attn.append(out[0])
            self.pattern.append(out[1])

        def keep_z(module, args) -> None:
            self.z.append(args[0])

        def keep_post(module, args, out) -> None:
            self.post = out[0]

        handles = []
        for block in native.layers:  # registered last: they see what earlier hooks made of the values
            # what the block reads: the output of its hook_in (hook_resid_pre), after any hook on it
            handles.append(block.hook_in.register_forward_hook(keep_pre))
            handles.append(block.attn.register_forward_hook(keep_attn))
            handles.append(block.attn.o.register_forward_pre_hook(keep_z))
        handles.append(native.layers[-1].register_forward_hook(keep_post))
        for block in native.layers if outputs else []:  # registered first: before any hook already there
            handles.append(block.attn.register_forward_hook(lambda module, args, out: self.attn_out.append(out[0]),
                                                            prepend=True))
            if getattr(block, "mlp", None) is not None:
                handles.append(block.mlp.register_forward_hook(lambda module, args, out: self.mlp_out.append(out),
                                                               prepend=True))
        try:
            self.logits = native(tokens, **({} if mask is None else {"attention_mask": mask}))
        finally:
            for handle in handles:
                handle.remove()
        self.mid = [pre + attn for pre, attn in zip(self.pre, self.attn)]

    def rows(self, index: torch.Tensor) -> "ResidualPass":
        """The same pass restricted to the sequences at `index` (the tensors indexed, nothing run)."""
        part = object.__new__(type(self))
        part.native = self.native
        part.mask = None if self.mask is None else self.mask[index]
        for name in ("pre", "attn", "mid", "pattern", "z", "attn_out", "mlp_out"):
            setattr(part, name, [t[index] for t in getattr(self, name)])
        part.post = None if self.post is None else self.post[index]
        part.logits = self.logits[index]
        return part

    def site(self, hook: str) -> torch.Tensor:
        """The value at a bridge hook name: `blocks.<l>.hook_resid_pre`, `hook_resid_mid`,
        `attn.hook_pattern`, or the last block's `hook_resid_post`."""
        parts = hook.split(".")
        layer, name = int(parts[1]), ".".join(parts[2:])
        if name == "hook_resid_post" and layer == len(self.pre) - 1:
            return self.post
        kept = {"hook_resid_pre": self.pre, "hook_resid_mid": self.mid, "attn.hook_pattern": self.pattern}
        if name not in kept:
            raise KeyError(f"{hook} is not kept by a ResidualPass")
        return kept[name][layer]

"""A plug-in probe: the entropy of each head's attention on the task's held-out inputs.

Keys: `attn_entropy/L<l>H<h>` (nats, averaged over queries and inputs; detail) and
`attn_entropy/mean`; drawn in a panel of its own.
"""

import torch

from phasewatch.probes import KeyFamilies, Panel, register_probe

KEYS = KeyFamilies(detail=r"^attn_entropy/L\d+H\d+$",
                   panels=(Panel("attention entropy (plug-in)", ("attn_entropy/mean",)),),
                   hidden=("attn_entropy/",), headline=("attn_entropy/mean",))


@register_probe("attention_entropy", applies_to=lambda task: True, cheap=True, default=False, keys=KEYS)
def attention_entropy(model, task) -> dict[str, float]:
    tokens = task.val_batches()[0].tokens[:64]
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    out = {}
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()  # batch head query key
        entropy = -(pattern * pattern.clamp_min(1e-12).log()).sum(-1).mean((0, 2))
        out.update({f"attn_entropy/L{layer}H{h}": float(e) for h, e in enumerate(entropy)})
    out["attn_entropy/mean"] = sum(out.values()) / len(out)
    return out

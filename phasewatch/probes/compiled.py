"""tracr's compiled transformer of a RASP program, as a TransformerLens 4 bridge.

The reference that the `tracr` comparison probe (probes/tracr_match.py) and `phasewatch
compile` measure against: compiled once, converted by TransformerLens's tracr converter
(phasewatch.models), checked against tracr's own outputs, cached on disk (a cache hit
imports neither tracr nor JAX).
"""

from __future__ import annotations

import os

import torch

from phasewatch.models import bridge_from_saved, bridge_from_tracr, layer_output_weights, saved_config
from phasewatch.tasks.base import ConfigError


def default_cache_dir() -> str:
    """Where compiled references are cached: $PHASEWATCH_TRACR_CACHE, else
    ~/.cache/phasewatch/tracr."""
    return os.environ.get("PHASEWATCH_TRACR_CACHE") or "~/.cache/phasewatch/tracr"


def compiled_reference(program, cache_dir: str | None = None, verify_limit: int = 2000):
    """The tracr-compiled model of `program` (a `tracr_programs.Program`) as a
    TransformerBridge, and a description of its layout.

    Cached on disk by program, vocabulary, maximum length and tracr version: a cache hit
    builds the bridge from the saved weights without importing tracr or JAX. On a miss the
    program is compiled, converted by TransformerLens's tracr converter, and checked
    against tracr's own outputs on every input up to length `max_seq_len` (at most
    `verify_limit` inputs per length, drawn evenly); a mismatch raises RuntimeError.
    Only categorical programs convert (TransformerLens's converter unembeds categories).
    """
    import hashlib
    import itertools
    from pathlib import Path

    from phasewatch.tasks import tracr_programs

    if not program.categorical:
        raise ConfigError("data.task.program", f"{program.name!r} has numerical outputs, which the TransformerLens "
                          "converter cannot unembed", "Compare with a categorical program (reverse, sort, hist, ...).")
    cache_dir = cache_dir or default_cache_dir()
    key = f"{program.name}|{list(program.vocab)}|{program.max_seq_len}|{tracr_programs.tracr_version()}"
    path = Path(cache_dir).expanduser() / f"{program.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        bridge = bridge_from_saved(saved["config"], saved["state_dict"])
        return bridge, saved["layout"]

    compiled = tracr_programs.compile_program(program)
    bridge, cfg, state = bridge_from_tracr(compiled)  # verified below against tracr itself
    encoding = program.input_encoding()
    decode = {i: v for v, i in program.output_encoding().items()}
    for n in range(1, program.max_seq_len + 1):
        inputs = list(itertools.product(program.vocab, repeat=n))
        inputs = inputs[:: max(1, len(inputs) // verify_limit)]
        ours = bridge(torch.tensor([[encoding[tracr_programs.COMPILER_BOS]] + [encoding[v] for v in xs]
                                    for xs in inputs]))[:, 1:].argmax(-1)
        theirs = tracr_programs.compiled_outputs(compiled, inputs)
        for xs, row, want in zip(inputs, ours.tolist(), theirs):
            if [decode[i] for i in row] != want:
                raise RuntimeError(f"the converted {program.name!r} model disagrees with tracr on {list(xs)}: "
                                   f"{[decode[i] for i in row]} != {want}")
    names = {sop.label: name for name, sop in program.variables.items()}
    layout = _compiled_layout(compiled, state, cfg, names)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = saved_config(cfg)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": fields, "state_dict": state, "layout": layout, "key": key}, tmp)
    tmp.replace(path)
    return bridge, layout


def _compiled_layout(compiled, state: dict, cfg, names: dict[str, str]) -> dict:
    """Per layer: whether attention and MLP do anything, and which residual variables
    they write, by their `.named()` name (tracr's labels `name_uid:value` carry a uid that
    depends on construction order; a `<name>:hidden` entry is a compiler-internal
    dimension of that variable, such as a selector width's attention output)."""

    def readable(label: str) -> str:
        if label in names:
            return names[label]
        for tracr_label, name in names.items():
            if label.startswith(tracr_label + "_"):
                return f"{name}:hidden"
        return label
    labels = list(compiled.residual_labels)
    layers = []
    for layer in range(cfg.n_layers):
        entry = {}
        for part, w in layer_output_weights(state, layer).items():  # w: (d_model, in)
            rows = (w.abs().sum(dim=1) > 1e-9).nonzero().flatten().tolist()
            written = sorted({readable(labels[r].rpartition(":")[0] or labels[r]) for r in rows})
            entry[part] = {"empty": not rows, "writes": written}
        layers.append(entry)
    return {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_model": cfg.d_model, "d_mlp": cfg.d_mlp,
            "layers": layers}

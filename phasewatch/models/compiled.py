"""tracr's compiled transformer of a RASP program, as a TransformerLens 4 bridge.

The reference that the `tracr` comparison probe (probes/tracr.py) and `phasewatch
compile` measure against: compiled once, converted by TransformerLens's tracr converter
(phasewatch.models), checked against tracr's own outputs, described (what each layer
writes; each RASP variable's residual dimensions and the values they encode), cached on
disk (a cache hit imports neither tracr nor JAX).
"""

from __future__ import annotations

import os

import torch

from phasewatch.models import bridge_from_saved, bridge_from_tracr, layer_output_weights, saved_config
from phasewatch.errors import ConfigError


def default_cache_dir() -> str:
    """Where compiled references are cached: $PHASEWATCH_TRACR_CACHE, else
    ~/.cache/phasewatch/tracr."""
    return os.environ.get("PHASEWATCH_TRACR_CACHE") or "~/.cache/phasewatch/tracr"


# Part of the cache key: bump it whenever what is saved changes, so that an older file is
# never read as the new format (2: the layout's `residual` table).
CACHE_FORMAT = 2


def compiled_reference(program, cache_dir: str | None = None, verify_limit: int = 2000):
    """The tracr-compiled model of `program` (a `tracr_programs.Program`) as a
    TransformerBridge, and a description of its layout (`compiled_layout`).

    Cached on disk by program, vocabulary, maximum length, tracr version and cache format:
    a cache hit builds the bridge from the saved weights without importing tracr or JAX.
    On a miss the program is compiled and handed to `reference_from_compiled` (convert,
    check against tracr on every input, describe). Only categorical programs convert: a
    numerical one, a program tracr or the converter refuses, or a conversion that
    disagrees with tracr is a ConfigError naming the program.
    """
    import hashlib
    from pathlib import Path

    from phasewatch.tasks import tracr_programs

    _require_categorical(program)
    cache_dir = cache_dir or default_cache_dir()
    key = (f"{program.name}|{list(program.vocab)}|{program.max_seq_len}|{tracr_programs.tracr_version()}"
           f"|format {CACHE_FORMAT}")
    path = Path(cache_dir).expanduser() / f"{program.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        bridge = bridge_from_saved(saved["config"], saved["state_dict"])
        return bridge, saved["layout"]

    bridge, layout, record = reference_from_compiled(program, tracr_programs.compile_program(program), verify_limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**record, "key": key}, tmp)
    tmp.replace(path)
    return bridge, layout


def _require_categorical(program) -> None:
    if not program.categorical:
        raise ConfigError("data.task.program", f"{program.name!r} has numerical outputs, which the TransformerLens "
                          "converter cannot unembed", "Compare with a categorical program (reverse, sort, hist, ...).")


def reference_from_compiled(program, compiled, verify_limit: int = 2000) -> tuple[torch.nn.Module, dict, dict]:
    """`(bridge, layout, record)` for `compiled`, tracr's model of `program`: converted by
    TransformerLens's tracr converter (told which residual variable is the output: it
    cannot guess that for boolean outputs), checked against tracr's own outputs on every
    input up to length `max_seq_len` (at most `verify_limit` inputs per length, drawn
    evenly), and described (`compiled_layout`); `record` is what the cache saves.
    ConfigError when the converter refuses the model or disagrees with tracr."""
    import itertools

    from phasewatch.tasks import tracr_programs

    _require_categorical(program)
    try:
        bridge, cfg, state = bridge_from_tracr(compiled, program.sop.label)
    except (ValueError, NotImplementedError) as err:
        raise ConfigError("data.task.program", f"TransformerLens cannot convert the compiled {program.name!r} "
                          f"({' '.join(str(err).split())})", "Choose another program (phasewatch tasks lists them).") from err
    encoding = program.input_encoding()
    decode = {i: v for v, i in program.output_encoding().items()}
    for n in range(1, program.max_seq_len + 1):
        inputs = list(itertools.product(program.vocab, repeat=n))
        inputs = inputs[:: max(1, len(inputs) // verify_limit)]
        with torch.no_grad():
            ours = bridge(torch.tensor([[encoding[tracr_programs.COMPILER_BOS]] + [encoding[v] for v in xs]
                                        for xs in inputs]))[:, 1:].argmax(-1)
        theirs = tracr_programs.compiled_outputs(compiled, inputs)
        for xs, row, want in zip(inputs, ours.tolist(), theirs):
            if [decode[i] for i in row] != want:
                raise ConfigError("data.task.program", f"the converted {program.name!r} model disagrees with tracr on "
                                  f"{list(xs)}: {[decode[i] for i in row]} != {want}",
                                  "Choose another program (phasewatch tasks lists them).")
    layout = compiled_layout(list(compiled.residual_labels), state, cfg, program)
    return bridge, layout, {"config": saved_config(cfg), "state_dict": state, "layout": layout}


SELECTOR_WIDTH_SUFFIX = "_selector_width_attn_output"  # tracr's extra dimension of a SelectorWidth


def residual_variable(label: str, names: dict[str, str], values: dict[str, dict[str, object]]) -> tuple[str, object]:
    """`(variable, value)` of one of tracr's residual labels: the variable by its
    `.named()` name (`names`: tracr label -> name), and for a categorical variable the
    value its dimension one-hot encodes (typed through `values`: name -> {str(v): v}),
    else None. tracr labels a categorical dimension `<label>:<value>`, a numerical one
    `<label>`; `<label>_selector_width_attn_output` is a compiler-internal dimension of a
    SelectorWidth, reported as `<name>:hidden`; `one` (the constant dimension) and
    anything unknown keep tracr's label."""
    if label in names:
        return names[label], None
    owners = [tracr_label for tracr_label in names if label.startswith(tracr_label + ":")]
    if owners:
        owner = max(owners, key=len)
        name, text = names[owner], label[len(owner) + 1:]
        return name, values.get(name, {}).get(text, text)
    if label.endswith(SELECTOR_WIDTH_SUFFIX) and label.removesuffix(SELECTOR_WIDTH_SUFFIX) in names:
        return f"{names[label.removesuffix(SELECTOR_WIDTH_SUFFIX)]}:hidden", None
    return label, None


def residual_table(labels: list[str], program) -> dict[str, dict]:
    """Each residual variable's dimensions in the compiled model, in residual order:
    `name -> {"dims": [index, ...], "values": [value per dim] or None}` (values for
    categorical variables, None for numerical ones and compiler-internal dimensions).
    `labels` is the compiled model's `residual_labels`."""
    from phasewatch.tasks import tracr_programs

    names = {"tokens": "tokens", "indices": "indices"}  # tracr embeds both, used or not
    names.update({sop.label: name for name, sop in program.variables.items()})
    value_sets = {**program.value_sets, "indices": set(range(program.max_seq_len + 1)),
                  "tokens": set(program.vocab) | {tracr_programs.COMPILER_BOS, tracr_programs.COMPILER_PAD}}
    values = {name: {str(v): v for v in vs} for name, vs in value_sets.items()}
    table: dict[str, dict] = {}
    for dim, label in enumerate(labels):
        name, value = residual_variable(label, names, values)
        entry = table.setdefault(name, {"dims": [], "values": []})
        entry["dims"].append(dim)
        entry["values"].append(value)
    for entry in table.values():
        if all(v is None for v in entry["values"]):
            entry["values"] = None
    return table


def compiled_layout(labels: list[str], state: dict, cfg, program) -> dict:
    """The compiled model's shape; per layer, whether attention and MLP do anything and
    which residual variables they write; and `residual`, each variable's residual
    dimensions (`residual_table`). Variables go by their `.named()` name (tracr's labels
    `name_uid:value` carry a uid that depends on construction order; a `<name>:hidden`
    entry is a compiler-internal dimension of that variable, such as a selector width's
    attention output)."""
    residual = residual_table(labels, program)
    owner = {dim: name for name, entry in residual.items() for dim in entry["dims"]}
    layers = []
    for layer in range(cfg.n_layers):
        entry = {}
        for part, w in layer_output_weights(state, layer).items():  # w: (d_model, in)
            rows = (w.abs().sum(dim=1) > 1e-9).nonzero().flatten().tolist()
            entry[part] = {"empty": not rows, "writes": sorted({owner[r] for r in rows})}
        layers.append(entry)
    return {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_model": cfg.d_model, "d_mlp": cfg.d_mlp,
            "layers": layers, "residual": residual}


def spans(items: list) -> str:
    """`[2, 3, 4, 7]` -> `2..4, 7`: runs of consecutive integers as ranges; anything else
    listed as is."""
    parts, i = [], 0
    while i < len(items):
        j = i
        while (j + 1 < len(items) and all(isinstance(v, int) and not isinstance(v, bool) for v in items[j:j + 2])
               and items[j + 1] == items[j] + 1):
            j += 1
        parts.append(f"{items[i]}..{items[j]}" if j > i else str(items[i]))
        i = j + 1
    return ", ".join(parts)


def describe_layout(layout: dict) -> list[str]:
    """The layout as readable lines: what each layer writes, then the residual table
    (variable, its dimensions, the values they one-hot encode, or `(a number)` for a
    dimension that holds a number: a numerical variable, `one`, a `:hidden` one)."""
    lines = [f"{layout['n_layers']} layers, {layout['n_heads']} head(s), d_model {layout['d_model']}, "
             f"d_mlp {layout['d_mlp']}"]
    for i, layer in enumerate(layout["layers"]):
        for part in ("attn", "mlp"):
            info = layer[part]
            lines.append(f"  layer {i} {part:4s}: " + ("empty" if info["empty"] else "writes " + ", ".join(info["writes"])))
    table = layout["residual"]
    width = max(len("variable"), *map(len, table))
    dim_width = max(len("dims"), *(len(spans(entry["dims"])) for entry in table.values()))
    lines.append(f"residual stream ({layout['d_model']} dimensions):")
    lines.append(f"  {'variable':{width}s}  {'dims':{dim_width}s}  values")
    for name, entry in table.items():
        values = "(a number)" if entry["values"] is None else spans(entry["values"])
        lines.append(f"  {name:{width}s}  {spans(entry['dims']):{dim_width}s}  {values}")
    return lines

"""Compiled tracr references: real compilation, conversion to a TransformerLens 4 bridge,
checked on every input; the disk cache loads without JAX."""

import itertools
import subprocess
import sys

import pytest
import torch

from phasewatch.errors import ConfigError
from phasewatch.tasks.tracr_programs import COMPILER_BOS, PROGRAMS, compile_program, load_program
from phasewatch.models.compiled import compiled_reference, reference_from_compiled


def outputs(program, bridge):
    enc, dec = program.input_encoding(), {i: v for v, i in program.output_encoding().items()}
    result = {}
    for n in range(1, program.max_seq_len + 1):
        inputs = list(itertools.product(program.vocab, repeat=n))
        with torch.no_grad():
            ids = bridge(torch.tensor([[enc[COMPILER_BOS]] + [enc[v] for v in xs] for xs in inputs]))[:, 1:].argmax(-1)
        result.update({xs: [dec[i] for i in row] for xs, row in zip(inputs, ids.tolist())})
    return result


def test_converted_reverse_reverses_all_363_inputs(reverse):
    program, bridge, _, _ = reverse
    got = outputs(program, bridge)
    assert len(got) == 363
    assert all(got[xs] == list(reversed(xs)) == program.evaluate(xs) for xs in got)


def test_layout_is_the_known_reverse_circuit(reverse):
    _, _, layout, _ = reverse
    assert (layout["n_layers"], layout["n_heads"], layout["d_model"], layout["d_mlp"]) == (4, 1, 41, 30)
    layers = layout["layers"]
    assert "length" in layers[0]["mlp"]["writes"] and not layers[0]["attn"]["empty"]
    assert layers[1]["attn"]["empty"] and layers[2]["attn"]["empty"] and layers[3]["mlp"]["empty"]
    assert layers[1]["mlp"]["writes"] == ["opp_idx"] and layers[2]["mlp"]["writes"] == ["opp_idx-1"]
    assert layers[3]["attn"]["writes"] == ["reverse"]


def test_cached_reference_loads_without_jax(reverse):
    program, bridge, _, cache = reverse
    code = (f"import sys, types, torch; from phasewatch.models.compiled import compiled_reference; "
            f"p = types.SimpleNamespace(name='reverse', vocab=(1, 2, 3), max_seq_len=5, categorical=True); "
            f"b, _ = compiled_reference(p, cache_dir={str(cache)!r}); "
            f"assert 'jax' not in sys.modules and 'tracr' not in sys.modules, 'imported JAX'; "
            f"print(b(torch.tensor([[3, 0, 1, 2]])).argmax(-1).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(bridge(torch.tensor([[3, 0, 1, 2]])).argmax(-1).tolist())


def test_a_cache_file_of_the_previous_format_is_not_read(reverse):
    """The residual table changed what the cache saves: a file under the old key (no
    format in it) would hold a layout without `residual`, and must not be read."""
    import hashlib

    from phasewatch.tasks.tracr_programs import tracr_version

    program, _, _, cache = reverse
    old_key = f"reverse|{list(program.vocab)}|{program.max_seq_len}|{tracr_version()}"
    old = cache / f"reverse-{hashlib.sha256(old_key.encode()).hexdigest()[:16]}.pt"
    old.write_bytes(b"a file of the previous format")
    try:
        _, layout = compiled_reference(program, cache_dir=str(cache))
    finally:
        old.unlink()
    assert "tokens" in layout["residual"]

def test_numerical_programs_are_refused_clearly():
    with pytest.raises(ConfigError, match="numerical outputs"):
        compiled_reference(load_program("frac_prevs"), cache_dir="/nonexistent")


def test_a_program_tracr_cannot_compile_is_refused_clearly(tmp_path, monkeypatch):
    from phasewatch.tasks import tracr_programs

    def numerical_sum(rasp, lib, n, vocab):  # tracr: non-linear SequenceMaps need categorical inputs
        a = rasp.numerical(rasp.Map(lambda x: x, rasp.tokens))
        b = rasp.numerical(rasp.Map(lambda x: 2 * x, rasp.tokens))
        return rasp.numerical(rasp.SequenceMap(lambda x, y: x + y, a, b)).named("sum")

    monkeypatch.setattr(tracr_programs, "PROGRAMS", dict(tracr_programs.PROGRAMS))
    tracr_programs.register_program("numerical_sum", tracr_programs.ProgramSpec(numerical_sum, (1, 2, 3), 3, False))
    with pytest.raises(ValueError, match="already registered"):
        tracr_programs.register_program("numerical_sum", tracr_programs.PROGRAMS["reverse"])
    with pytest.raises(ConfigError, match=r"data.task.program: tracr cannot compile 'numerical_sum' \(Unsupported RASP"):
        tracr_programs.compile_program(load_program("numerical_sum"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["sort", "hist"])
def test_other_programs_convert_and_match_tracr_on_every_input(name, tracr_cache):
    """compiled_reference checks every input of length 1-4 against tracr's own decoded
    output and raises on any disagreement; here it must pass, and agree with RASP."""
    program = load_program(name, [1, 2, 3], 4)
    bridge, layout = compiled_reference(program, cache_dir=str(tracr_cache))
    got = outputs(program, bridge)
    assert len(got) == 3 + 9 + 27 + 81
    assert all(got[xs] == program.evaluate(xs) for xs in got)
    assert any(not layer["attn"]["empty"] for layer in layout["layers"])


def test_layout_tables_each_variables_residual_dimensions(reverse):
    """Known answer for make_reverse on {1, 2, 3}, lengths 1-5 (tracr orders the residual by
    label, then value): each variable's dimensions and the values they encode, and the
    converted weights put them there: token v embeds at tokens' dimension for v (and at
    `one`, which every token sets), and output class v reads reverse's dimension for v."""
    program, bridge, layout, _ = reverse
    table = {name: (entry["dims"], entry["values"]) for name, entry in layout["residual"].items()}
    assert table == {
        "indices": ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]), "length": (list(range(5, 11)), [0, 1, 2, 3, 4, 5]),
        "length:hidden": ([11], None), "one": ([12], None), "opp_idx-1": (list(range(13, 23)), list(range(-5, 5))),
        "opp_idx": (list(range(23, 33)), list(range(-4, 6))), "reverse": ([33, 34, 35], [1, 2, 3]),
        "tokens": ([36, 37, 38, 39, 40], [1, 2, 3, "BOS", "PAD"])}
    embed, unembed = bridge.W_E.detach(), bridge.W_U.detach()
    for v, i in program.input_encoding().items():
        assert embed[i].nonzero().flatten().tolist() == [12, 36 + [1, 2, 3, "BOS", "PAD"].index(v)]
    for v, i in program.output_encoding().items():
        assert unembed[:, i].nonzero().flatten().tolist() == [33 + v - 1]


def test_compile_command_prints_the_residual_table(reverse, capsys):
    from phasewatch.cli.main import main

    _, _, _, cache = reverse
    assert main(["compile", "reverse", "--vocab", "[1, 2, 3]", "--max-seq-len", "5", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "residual stream (41 dimensions):" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.split("residual stream")[1].splitlines()[2:]}
    assert lines["tokens"] == ["36..40", "1..3,", "BOS,", "PAD"]
    assert lines["reverse"] == ["33..35", "1..3"] and lines["opp_idx-1"] == ["13..22", "-5..4"]
    assert lines["length:hidden"] == ["11", "(a", "number)"] and lines["one"] == ["12", "(a", "number)"]


def small_version(name):
    """A listed program at a size that compiles quickly: at most 4 tokens (the first 3 of a
    larger vocabulary), inputs up to length 4 (3 for sort_unique, whose tokens are distinct)."""
    spec = PROGRAMS[name]
    vocab = spec.vocab if len(spec.vocab) <= 4 else spec.vocab[:3]
    return load_program(name, vocab, min(4, len(vocab)) if spec.unique_tokens else 4)


# Every categorical program costs a tracr compile (20-60 s on two busy cores): the default
# suite keeps shuffle_dyck (a boolean output, which did not convert) and the numerical ones
# (refused without compiling); reverse, sort and hist are also compiled by the tests above.
DEFAULT_SUITE = {"shuffle_dyck", "frac_prevs", "pair_balance"}


@pytest.mark.parametrize("name", [n if n in DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(PROGRAMS)])
def test_every_listed_program_compiles_converts_and_verifies_or_is_refused(name):
    """Each program `phasewatch tasks` lists, at a small size: a categorical one compiles,
    converts, agrees with tracr on every input (reference_from_compiled checks each one
    and raises on a disagreement) and with RASP on every valid input, and its residual
    table is tracr's own labelling (`residual_labels`); a numerical one is refused with one
    line, and so is the tracr probe on its task, before any training."""
    from phasewatch.probes import get_probe
    from phasewatch.tasks.rasp import RaspTask

    program = small_version(name)
    if PROGRAMS[name].numerical_output:
        assert not program.categorical
        with pytest.raises(ConfigError, match=f"data.task.program: '{name}' has numerical outputs"):
            compiled_reference(program, cache_dir="/nonexistent")
        with pytest.raises(ConfigError, match="probe 'tracr' does not apply"):
            get_probe("tracr", RaspTask(name, list(program.vocab), program.max_seq_len))
        return
    compiled = compile_program(program)
    bridge, layout, _ = reference_from_compiled(program, compiled)
    got = outputs(program, bridge)
    valid = [xs for xs in got if not PROGRAMS[name].unique_tokens or len(set(xs)) == len(xs)]
    assert valid and all(got[xs] == program.evaluate(xs) for xs in valid)

    labels = list(compiled.residual_labels)
    assert sorted(d for entry in layout["residual"].values() for d in entry["dims"]) == list(range(len(labels)))
    for var, sop in program.variables.items():
        entry = layout["residual"][var]
        assert [labels[d] for d in entry["dims"]] == [l for l in labels if l == sop.label or l.startswith(sop.label + ":")]
        if program.is_categorical(var):
            assert [f"{sop.label}:{v}" for v in entry["values"]] == [labels[d] for d in entry["dims"]]
            assert set(entry["values"]) == program.value_sets[var] | ({"BOS", "PAD"} if var == "tokens" else set())
        else:
            assert entry["values"] is None and len(entry["dims"]) == 1

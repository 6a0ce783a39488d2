"""Compiled tracr references: real compilation, conversion to a TransformerLens 4 bridge,
checked on every input; the disk cache loads without JAX."""

import itertools
import subprocess
import sys

import pytest
import torch

from phasewatch.tasks import ConfigError
from phasewatch.tasks.tracr_programs import COMPILER_BOS, load_program
from phasewatch.probes.compiled import compiled_reference


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
    code = (f"import sys, types, torch; from phasewatch.probes.compiled import compiled_reference; "
            f"p = types.SimpleNamespace(name='reverse', vocab=(1, 2, 3), max_seq_len=5, categorical=True); "
            f"b, _ = compiled_reference(p, cache_dir={str(cache)!r}); "
            f"assert 'jax' not in sys.modules and 'tracr' not in sys.modules, 'imported JAX'; "
            f"print(b(torch.tensor([[3, 0, 1, 2]])).argmax(-1).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(bridge(torch.tensor([[3, 0, 1, 2]])).argmax(-1).tolist())


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

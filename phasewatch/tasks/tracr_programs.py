"""The one module that imports tracr (and through it JAX), always lazily.

It names the tracr library programs phasewatch trains on, evaluates them (the true
value of the output and of every intermediate variable), and gives the exact token
encoding tracr's compiler uses, so the same token ids feed a learned model and the
compiled one. Importing this module does not import tracr; the first call does.

Programs (vocabulary and causality defaults in `PROGRAMS`): reverse, length, hist,
sort, sort_unique, sort_freq, frac_prevs, pair_balance, shuffle_dyck. Inputs are
lists of vocabulary values (no BOS); the compiled model's inputs are
`[COMPILER_BOS, *xs]` and RASP index i is model position i + 1.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
from typing import Any, Callable, Sequence

from phasewatch.tasks.base import require_int
from phasewatch.errors import ConfigError

COMPILER_BOS = "BOS"
COMPILER_PAD = "PAD"

Value = Any  # int, float, str or bool: whatever the RASP program computes


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """How to build one library program, and what its inputs look like."""

    build: Callable[[Any, Any, int, tuple], Any]  # (rasp, lib, max_seq_len, vocab) -> SOp
    vocab: tuple
    max_seq_len: int
    causal: bool  # True when the program only reads earlier positions
    unique_tokens: bool = False  # inputs must not repeat a token (sort_unique)
    numeric_vocab: bool = False  # the program does arithmetic on token values
    summary: str = ""
    numerical_output: bool = False  # a number per position: trains, but has no compiled reference to compare


def _frac_prevs(rasp, lib, n, vocab):
    is_first = rasp.numerical(rasp.Map(lambda x: x == vocab[0], rasp.tokens)).named("is_first_token")
    return lib.make_frac_prevs(is_first)


PROGRAMS: dict[str, ProgramSpec] = {
    "reverse": ProgramSpec(lambda r, lib, n, v: lib.make_reverse(r.tokens), (1, 2, 3, 4, 5), 6, False,
                           summary="the input reversed"),
    "length": ProgramSpec(lambda r, lib, n, v: lib.make_length(), (1, 2, 3, 4, 5), 6, False,
                          summary="the sequence length at every position"),
    "hist": ProgramSpec(lambda r, lib, n, v: lib.make_hist(), (1, 2, 3, 4, 5), 6, False,
                        summary="how often each position's token occurs"),
    "sort": ProgramSpec(lambda r, lib, n, v: lib.make_sort(r.tokens, r.tokens, max_seq_len=n, min_key=1),
                        (1, 2, 3, 4, 5), 6, False, numeric_vocab=True, summary="tokens sorted ascending"),
    "sort_unique": ProgramSpec(lambda r, lib, n, v: lib.make_sort_unique(r.tokens, r.tokens), (1, 2, 3, 4, 5, 6),
                               6, False, unique_tokens=True, summary="distinct tokens sorted ascending"),
    "sort_freq": ProgramSpec(lambda r, lib, n, v: lib.make_sort_freq(n), (1, 2, 3, 4, 5), 6, False,
                             numeric_vocab=True, summary="tokens sorted by decreasing frequency"),
    "frac_prevs": ProgramSpec(_frac_prevs, (1, 2, 3), 6, True, numerical_output=True,
                              summary="fraction of tokens so far equal to the first vocabulary value"),
    "pair_balance": ProgramSpec(lambda r, lib, n, v: lib.make_pair_balance(r.tokens, "(", ")"), ("(", ")"), 6, True,
                                numerical_output=True, summary="fraction of '(' minus fraction of ')' so far"),
    "shuffle_dyck": ProgramSpec(lambda r, lib, n, v: lib.make_shuffle_dyck(["()", "{}"]), ("(", ")", "{", "}"),
                                6, False, summary="whether the sequence is a balanced shuffle of () and {}"),
}


def program_names() -> list[str]:
    return sorted(PROGRAMS)


def register_program(name: str, spec: ProgramSpec) -> None:
    """Add a RASP program (`spec.build(rasp, lib, max_seq_len, vocab)` returns its output
    SOp) under a new name, for `RaspTask(program=name)`, the tracr probe and `phasewatch
    compile`. Names are unique: an existing one is refused."""
    if name in PROGRAMS:
        raise ValueError(f"tracr program {name!r} is already registered")
    PROGRAMS[name] = spec


def spec(name: str) -> ProgramSpec:
    if name not in PROGRAMS:
        raise ConfigError(
            "data.task.program", f"unknown tracr program {name!r}", f"Choose one of: {', '.join(program_names())}."
        )
    return PROGRAMS[name]


@functools.cache
def _tracr():
    from tracr.compiler import basis_inference, lib, nodes, rasp_to_graph
    from tracr.craft import bases
    from tracr.rasp import rasp

    return types.SimpleNamespace(
        rasp=rasp, lib=lib, bases=bases, nodes=nodes, rasp_to_graph=rasp_to_graph, basis_inference=basis_inference
    )


@dataclasses.dataclass
class Program:
    """A built RASP program with its vocabulary and maximum length.

    Variables are keyed by their `.named()` name (`reverse`, `opp_idx`, `length`,
    `tokens`, `indices`, ...), never by tracr's `name_uid` label, whose uid depends on
    construction order. Attributes: `sop` (the output SOp), `variables` (name -> SOp for
    every sequence variable), `value_sets` (name -> the values it can take: tracr's own
    basis inference for categorical variables; for a numerical output, the values seen
    over every input up to `max_seq_len`, because tracr's inference under-counts them).
    """

    name: str
    vocab: tuple
    max_seq_len: int
    sop: Any
    value_sets: dict[str, set]
    variables: dict[str, Any]

    @property
    def output_name(self) -> str:
        return self.sop.name

    @property
    def categorical(self) -> bool:
        return _tracr().rasp.is_categorical(self.sop)

    def is_categorical(self, name: str) -> bool:
        """Whether variable `name` is categorical (one-hot in the compiled residual)."""
        return _tracr().rasp.is_categorical(self.variables[name])

    def evaluate(self, xs: Sequence[Value], sop: Any = None) -> list[Value]:
        """The true value of `sop` (default: the program's output) on input `xs`.
        Numerical outputs come back as floats (tracr mixes bools and floats)."""
        t = _tracr()
        sop = self.sop if sop is None else sop
        values = list(t.rasp.evaluate(sop, list(xs)))
        return values if t.rasp.is_categorical(sop) else [float(v) for v in values]

    def intermediates(self, xs: Sequence[Value]) -> dict[str, list[Value]]:
        """The true value of every sequence variable on input `xs`, keyed by name."""
        return {name: self.evaluate(xs, s) for name, s in self.variables.items()}

    def sorted_values(self, name: str) -> list[Value]:
        """A variable's possible values in the order tracr's compiler gives its basis."""
        t = _tracr()
        return [d.value for d in t.bases.VectorSpaceWithBasis.from_values(name, self.value_sets[name]).basis]

    def input_encoding(self) -> dict[Value, int]:
        """Token value -> id, identical to the compiled model's `input_encoder.encoding_map`
        (compiled with `compiler_bos=COMPILER_BOS, compiler_pad=COMPILER_PAD`)."""
        t = _tracr()
        values = set(self.vocab) | {COMPILER_BOS, COMPILER_PAD}
        space = t.bases.VectorSpaceWithBasis.from_values(t.rasp.tokens.label, values)
        return {d.value: i for i, d in enumerate(space.basis)}

    def output_encoding(self) -> dict[Value, int]:
        """Output value -> class id; for categorical programs identical to the compiled
        model's `output_encoder.encoding_map`, for numerical ones the sorted value set."""
        return {v: i for i, v in enumerate(self.sorted_values(self.output_name))}


def load_program(name: str, vocab: Sequence[Value] | None = None, max_seq_len: int | None = None) -> Program:
    """Build library program `name` for `vocab` and `max_seq_len` (defaults per program)."""
    s = spec(name)
    vocab = tuple(s.vocab if vocab is None else vocab)
    max_seq_len = s.max_seq_len if max_seq_len is None else max_seq_len
    require_int(max_seq_len, "data.task.max_seq_len", 1, "Use a maximum input length of at least 1.")
    for reserved in (COMPILER_BOS, COMPILER_PAD):
        if reserved in vocab:
            raise ConfigError(
                "data.task.vocab", f"the value {reserved!r} is reserved for tracr's {reserved} token",
                "Remove it from the vocabulary.",
            )
    if len(set(vocab)) != len(vocab) or not vocab:
        raise ConfigError("data.task.vocab", f"must be a non-empty list of distinct values, got {list(vocab)}",
                          "List each token value once.")
    if s.numeric_vocab and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vocab):
        raise ConfigError("data.task.vocab", f"program {name!r} compares token values numerically",
                          "Use numbers as vocabulary values.")
    if s.unique_tokens and max_seq_len > len(vocab):
        raise ConfigError("data.task.max_seq_len", f"{name!r} needs distinct tokens, so at most {len(vocab)} per input",
                          f"Set max_seq_len <= {len(vocab)} or enlarge the vocabulary.")
    t = _tracr()
    sop = s.build(t.rasp, t.lib, max_seq_len, vocab)
    extracted = t.rasp_to_graph.extract_rasp_graph(sop)
    t.basis_inference.infer_bases(extracted.graph, extracted.sink, set(vocab), max_seq_len)
    variables, value_sets = {}, {}
    for data in extracted.graph.nodes.values():
        expr = data[t.nodes.EXPR]
        if isinstance(expr, t.rasp.SOp):
            key, k = expr.name, 1
            while key in variables:  # two variables share a name: number the later ones
                k += 1
                key = f"{expr.name}@{k}"
            variables[key] = expr
            value_sets[key] = set(data.get(t.nodes.VALUE_SET, ()))
    program = Program(name, vocab, max_seq_len, sop, value_sets, variables)
    if not program.categorical:
        program.value_sets[sop.name] = _enumerate_outputs(program)
    return program


MAX_ENUMERATED_INPUTS = 200_000


def _enumerate_outputs(program: Program) -> set:
    """Every output value over all inputs of length 1..max_seq_len."""
    n_inputs = sum(len(program.vocab) ** k for k in range(1, program.max_seq_len + 1))
    if n_inputs > MAX_ENUMERATED_INPUTS:
        raise ConfigError(
            "data.task.max_seq_len",
            f"numerical program {program.name!r} has {n_inputs} inputs up to length {program.max_seq_len}, "
            f"too many to enumerate its output values (limit {MAX_ENUMERATED_INPUTS})",
            "Use a shorter max_seq_len or a smaller vocabulary.",
        )
    values: set = set()
    for k in range(1, program.max_seq_len + 1):
        for xs in itertools.product(program.vocab, repeat=k):
            values.update(float(v) for v in program.evaluate(xs))
    return values


def compile_program(program: Program):
    """tracr's compiled transformer for `program` (imports JAX; 15-30 s of XLA time for a
    new shape). Non-causal programs compile non-causally: tracr accepts causal=True for
    them without complaint and gives wrong outputs (docs/reference.md)."""
    from tracr.compiler import compiling

    try:
        return compiling.compile_rasp_to_model(
            program.sop, vocab=set(program.vocab), max_seq_len=program.max_seq_len,
            causal=spec(program.name).causal, compiler_bos=COMPILER_BOS, compiler_pad=COMPILER_PAD)
    except (NotImplementedError, ValueError, TypeError, KeyError, AssertionError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError("data.task.program", f"tracr cannot compile {program.name!r} ({reason})",
                          "Rewrite the program with operations tracr supports (categorical SequenceMaps, "
                          "numerical Aggregates of numerical values; see tracr's README), or choose "
                          "another one (phasewatch tasks lists them).") from err


def compiled_outputs(compiled, inputs: list[tuple], batch_size: int = 512) -> list[list[Value]]:
    """tracr's own decoded outputs (BOS position dropped) for each input: what
    `compiled.apply` gives, computed by the same forward pass and output decoder on
    batches of inputs of one length (`apply` runs one input at a time, ~100x slower)."""
    import jax.numpy as jnp

    out: list = [None] * len(inputs)
    by_length: dict[int, list[int]] = {}
    for i, xs in enumerate(inputs):
        by_length.setdefault(len(xs), []).append(i)
    for rows in by_length.values():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            tokens = jnp.array([compiled.input_encoder.encode([COMPILER_BOS, *inputs[i]]) for i in chunk])
            unembedded = compiled.forward(compiled.params, tokens).unembedded_output.tolist()
            for i, row in zip(chunk, unembedded):
                out[i] = list(compiled.output_encoder.decode(row[1:]) if compiled.output_encoder else row[1:])
    return out


def tracr_version() -> str:
    from importlib.metadata import version

    return version("tracr-pypi")

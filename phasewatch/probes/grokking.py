"""Grokking progress measures of Nanda et al. 2023 ("Progress measures for grokking via
mechanistic interpretability", sections 4-5), for modular addition: the Fourier basis, key
frequencies, restricted and excluded loss, Gini coefficients, the sum of squared weights.
All functions are pure (a model with TransformerLens weight views and a ModularAddition task
in, numbers out); p must be an odd prime (ConfigError otherwise). The definitions as
implemented: docs/reference.md ("The grokking probe, as implemented")."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Iterable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from phasewatch.models import native_module
from phasewatch.phases.stages import Signature
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.errors import ConfigError
from phasewatch.tasks.modular_addition import ModularAddition, is_prime

KEY_FACTOR = 2.0  # a key frequency carries > 2x the share it would have if all were equal
CHUNK = 4096  # inputs per forward pass when evaluating all p^2 inputs
FINAL = "final"  # key_freqs option: the key frequencies of a finished run's last checkpoint
KEY_FREQS_FIELD = "probes.options.grokking.key_freqs"


def check_modulus(p: int) -> None:
    """Raise ConfigError unless p is an odd prime."""
    if not (isinstance(p, int) and p > 2 and is_prime(p)):
        raise ConfigError("data.task.p", f"the Fourier progress measures need an odd prime modulus, got {p!r}",
                          "Use an odd prime such as 59, 97 or 113, or turn the grokking probes off.")


@functools.cache
def fourier_basis(p: int, dtype: torch.dtype = torch.float64) -> Float[Tensor, "p p"]:
    """The orthonormal Fourier basis over Z_p (rows are basis vectors; built once per p,
    do not modify it)."""
    check_modulus(p)
    x = torch.arange(p, dtype=dtype)
    rows = [torch.ones(p, dtype=dtype)]
    for k in range(1, (p - 1) // 2 + 1):
        rows += [torch.cos(2 * math.pi * k * x / p), torch.sin(2 * math.pi * k * x / p)]
    basis = torch.stack(rows)
    return basis / basis.norm(dim=1, keepdim=True)


def component_norms(matrix: Float[Tensor, "p d"]) -> Float[Tensor, "p"]:
    """Norm of `matrix` (indexed by residue along dim 0) along each Fourier basis vector."""
    return (fourier_basis(matrix.shape[0]).to(matrix.device) @ matrix.detach().double()).norm(dim=1).cpu()


def frequency_norms(matrix: Float[Tensor, "p d"]) -> Float[Tensor, "n_freq"]:
    """Squared norm of `matrix` (indexed by residue along dim 0) in each frequency
    k = 1..(p-1)/2 (cos and sin rows together); the constant component is left out."""
    return _pair_frequencies(component_norms(matrix))


def _pair_frequencies(norms: Float[Tensor, "p"]) -> Float[Tensor, "n_freq"]:
    sq = norms.pow(2)
    return sq[1::2] + sq[2::2]


def key_frequencies(spectrum: Float[Tensor, "n_freq"], factor: float = KEY_FACTOR) -> list[int]:
    """Frequencies (1-based) whose share of the spectrum exceeds `factor` times the
    uniform share, strongest first."""
    share = spectrum / spectrum.sum()
    threshold = factor / len(spectrum)
    order = torch.argsort(share, descending=True)
    return [int(k) + 1 for k in order if share[k] > threshold]


def model_key_frequencies(model, p: int) -> list[int]:
    """The key frequencies of the model's current W_L (`key_frequencies`), strongest first."""
    return key_frequencies(frequency_norms(neuron_logit_map(model, p)))


def check_key_freqs(key_freqs, p: int) -> list[int] | None:
    """The `key_freqs` option, checked against the modulus: None (each checkpoint's own key
    frequencies) or a list of distinct whole frequencies 1..(p-1)/2, returned as a list.
    ConfigError for anything else, "final" included: only an analysis of a finished run
    knows its last checkpoint (`final_options` turns "final" into that checkpoint's list)."""
    n = (p - 1) // 2
    if key_freqs is None:
        return None
    if key_freqs == FINAL:
        raise ConfigError(KEY_FREQS_FIELD, "'final' (the key frequencies of the run's last checkpoint) is not "
                                           "known while the run trains",
                          "Leave key_freqs unset during fit (each checkpoint's own), give a list such as [1, 2], or "
                          "measure with the final ones afterwards: phasewatch analyze RUN_DIR --probes grokking.")
    if not isinstance(key_freqs, (list, tuple)):
        raise ConfigError(KEY_FREQS_FIELD, f"expected 'final', a list of frequencies or null, got {key_freqs!r}",
                          f"Give e.g. [1, 2] (whole numbers 1..{n} for p = {p}), 'final' or null.")
    bad = [k for k in key_freqs if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n]
    if bad:
        raise ConfigError(KEY_FREQS_FIELD, f"{bad} {'is' if len(bad) == 1 else 'are'} not a frequency of p = {p}",
                          f"Give whole numbers 1..{n}.")
    repeated = sorted({k for k in key_freqs if list(key_freqs).count(k) > 1})
    if repeated:
        raise ConfigError(KEY_FREQS_FIELD, f"{repeated} given more than once in {list(key_freqs)}",
                          "Give each frequency once.")
    return list(key_freqs)


def hurley_rickard_gini(values: Tensor) -> float:
    """Gini coefficient, components sorted ascending: sum((2k - N - 1) c_k) / (N sum c).
    0 for a constant vector, (N-1)/N for a one-hot one."""
    c = torch.sort(values.double().flatten().abs()).values
    n = len(c)
    k = torch.arange(1, n + 1, dtype=torch.float64)
    total = c.sum()
    return float(((2 * k - n - 1) * c).sum() / (n * total)) if total > 0 else 0.0


def neuron_logit_map(model, p: int) -> Float[Tensor, "p d_mlp"]:
    """W_L = W_U^T W_out of a 1-layer model, restricted to the p answer classes."""
    w_u, w_out = model.W_U[:, :p], model.W_out[0]  # (d_model, p), (d_mlp, d_model)
    return (w_out @ w_u).T.detach()


def grid_inputs(task: ModularAddition) -> Int[Tensor, "p*p 3"]:
    """Every input (a, b, =) of the task, a-major (the rows of `grid_logits`)."""
    p = task.p
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    return torch.stack([a.flatten(), b.flatten(), torch.full((p * p,), task.equals_token)], dim=1)


def grid_logits(model, task: ModularAddition) -> Float[Tensor, "p p p"]:
    """Logits over the p answer classes for every input (a, b), as [a, b, c], float64,
    on the model's device, differentiable."""
    p = task.p
    tokens = grid_inputs(task).to(next(model.parameters()).device)
    return torch.cat([model(chunk)[:, -1, :p].double() for chunk in tokens.split(CHUNK)]).reshape(p, p, p)


@torch.no_grad()
def all_logits(model, task: ModularAddition) -> Float[Tensor, "p p p"]:
    """`grid_logits` without gradients, on the CPU."""
    return grid_logits(model, task).cpu()


def training_measure(model, task: ModularAddition, measure: str) -> Tensor:
    """A differentiable progress measure on the TRAINING pairs, for use as a loss term:
    "excluded_loss" (the loss with the current key frequencies removed from the logits)
    or "restricted_loss" (the loss of their key-frequency part alone; the probe's
    restricted loss uses the test pairs, which a loss term must not see). Key
    frequencies come from the current weights (not differentiated through)."""
    if measure not in ("excluded_loss", "restricted_loss"):
        raise ConfigError("interventions.items.measure", f"unknown measure {measure!r}",
                          "Use excluded_loss or restricted_loss.")
    p = task.p
    native = native_module(model)
    freqs = model_key_frequencies(model, p)
    logits = grid_logits(native, task)
    key = project(logits, key_directions(p, freqs).to(logits.device))
    pairs = task.train_set().tokens[:, :2].to(logits.device)
    kept = logits - key if measure == "excluded_loss" else key + logits.mean(dim=(0, 1), keepdim=True)
    return pair_loss(kept, p, pairs)


def key_directions(p: int, freqs: Iterable[int]) -> Float[Tensor, "n p p"]:
    """Orthonormal directions cos(w(a+b)), sin(w(a+b)) over the (a, b) grid, per frequency."""
    x = torch.arange(p, dtype=torch.float64)
    s = x[:, None] + x[None, :]
    dirs = []
    for k in freqs:
        for fn in (torch.cos, torch.sin):
            d = fn(2 * math.pi * k * s / p)
            dirs.append(d / d.norm())
    return torch.stack(dirs) if dirs else torch.zeros(0, p, p, dtype=torch.float64)


def project(logits: Float[Tensor, "p p p"], directions: Float[Tensor, "n p p"]) -> Float[Tensor, "p p p"]:
    """The part of each output class's logit map lying in the given (a, b) directions."""
    coef = torch.einsum("abc,nab->nc", logits, directions)
    return torch.einsum("nc,nab->abc", coef, directions)


def pair_loss(logits: Float[Tensor, "p p p"], p: int, pairs: Int[Tensor, "n 2"]) -> Tensor:
    """Cross-entropy of the grid logits at the pairs (a, b), against (a + b) mod p."""
    picked = logits[pairs[:, 0], pairs[:, 1]]
    return F.cross_entropy(picked, (pairs[:, 0] + pairs[:, 1]) % p)


def _ce(logits: Float[Tensor, "p p p"], task: ModularAddition, pairs: Tensor) -> float:
    return float(pair_loss(logits, task.p, pairs))


def progress_measures(model, task: ModularAddition, key_freqs: list[int] | None = None,
                      logits: Float[Tensor, "p p p"] | None = None) -> dict:
    """Every grokking progress measure at once, for a 1-layer model (`logits`: its
    `all_logits` when computed already, e.g. for a population's members at once).

    Keys returned (and logged by the probe callback):
    `grok/restricted_loss`, `grok/excluded_loss`, `grok/excluded_loss/<k>` (only
    frequency k removed), `grok/gini_embed`, `grok/gini_neuron_logit`, `grok/weight_norm`,
    `grok/key_logit_fraction` (share of the logits' non-constant variance in the key
    directions), `grok/n_key_freqs`, `grok/key_freq/<k>` (share of W_L's Fourier norm in
    key frequency k); and, not scalars: `key_freqs` (list), `spectrum` (W_L's norm per
    frequency). `key_freqs` defaults to those of the current W_L; given ones are used as
    they are (`check_key_freqs` checks an option before it gets here).
    """
    if task.op != "+":
        raise ConfigError("data.task.op", f"the progress measures describe modular addition, not {task.op!r}",
                          "Use op '+' or turn the grokking probes off.")
    check_modulus(task.p)
    p = task.p
    logit_map_norms = component_norms(neuron_logit_map(model, p))
    spectrum = _pair_frequencies(logit_map_norms)
    freqs = key_frequencies(spectrum) if key_freqs is None else list(key_freqs)
    share = spectrum / spectrum.sum()
    logits = all_logits(model, task) if logits is None else logits
    train_pairs, test_pairs = task.train_set().tokens[:, :2], task.val_batches()[0].tokens[:, :2]
    key = project(logits, key_directions(p, freqs))
    mean = logits.mean(dim=(0, 1), keepdim=True)
    centred = logits - mean
    out = {
        "grok/restricted_loss": _ce(key + mean, task, test_pairs),
        "grok/excluded_loss": _ce(logits - key, task, train_pairs),
        "grok/key_logit_fraction": float(key.pow(2).sum() / centred.pow(2).sum()),
        "grok/gini_embed": hurley_rickard_gini(component_norms(model.W_E[:p])),
        "grok/gini_neuron_logit": hurley_rickard_gini(logit_map_norms),
        "grok/weight_norm": float(sum(w.detach().double().pow(2).sum() for w in model.parameters())),
        "grok/n_key_freqs": float(len(freqs)),
    }
    for k in freqs:
        out[f"grok/key_freq/{k}"] = float(share[k - 1])
        out[f"grok/excluded_loss/{k}"] = _ce(logits - project(logits, key_directions(p, [k])), task, train_pairs)
    out["key_freqs"] = freqs
    out["spectrum"] = spectrum
    return out


def _applies(task) -> bool:
    return isinstance(task, ModularAddition) and task.op == "+" and task.p > 2 and is_prime(task.p)


_GROKKING_RUN = r"grok/restricted_loss"
_TRAIN, _TEST = "train/acc up | train/loss down", ("val/acc up", "val/loss down")
#: cleanup's own marks: the weights shrinking, their Fourier components sparsening (the restricted
#: loss falls in every phase: no mark of cleanup, docs/stages.md)
_CLEANING = "grok/weight_norm down | grok/gini_neuron_logit up | grok/gini_embed up"
_NANDA = "Nanda et al. 2023"
#: measured on each checkpoint's own key frequencies (`fit`), the restricted and excluded losses
#: jump when the set changes: only their changes at one set count (docs/stages.md, Names)
_STEADY = ((r"grok/(restricted|excluded)_loss", "grok/n_key_freqs"),)
#: memorisation is the training set fitted: the training accuracy, where logged, on at least half
#: of it when the stage ends (a rise from 4% to 14% is no memorisation; docs/stages.md, Names)
_MEMORISED = ("train/acc >= 0.5",)
#: the three phases of Nanda et al. 2023 (section 5.1), by what moves in them and in their order
#: (each at most once; docs/stages.md)
STAGES = (
    Signature("memorisation", moves=(_TRAIN,), absent=("val/loss down",), run_has=_GROKKING_RUN, sequence=_NANDA,
              reaches=_MEMORISED,
              source="Nanda et al. 2023, sec. 5.1: first, the model memorises the training data: the train loss "
                     "falls while the test loss does not (the test accuracy may leave chance: no veto), and the "
                     "training accuracy ends on at least half of the training set (docs/stages.md)"),
    Signature("circuit formation", moves=("grok/restricted_loss down | grok/excluded_loss up",),
              absent=("train/acc up",) + _TEST, run_has=_GROKKING_RUN, sequence=_NANDA,
              outpaces=(("grok/restricted_loss", "train/loss"),), steady=_STEADY,
              source="Nanda et al. 2023, sec. 5.1: after memorisation, the excluded loss rises and the restricted "
                     "loss falls (the weights shrinking smoothly) while the train and test loss stay: the "
                     "restricted loss falls faster than the train loss"),
    Signature("cleanup", moves=("val/loss down | val/acc up", _CLEANING),
              absent=("train/acc up",), run_has=_GROKKING_RUN, sequence=_NANDA, during=(_CLEANING,),
              source="Nanda et al. 2023, sec. 5.1: last, the test loss falls as the weight norm falls sharply "
                     "and the Gini coefficients rise"),
)

KEYS = KeyFamilies(
    detail=r"^grok/key_freq/|^grok/excluded_loss/\d",  # per frequency
    tracked="key_freqs",
    tracked_names={"key_freqs": "key frequencies (the Fourier frequencies the model computes with)"},
    announced="key_freqs",
    panels=(Panel("loss", ("grok/restricted_loss", "grok/excluded_loss"), log_y=True),
            Panel("Gini coefficient of Fourier norms", ("grok/gini_embed", "grok/gini_neuron_logit")),
            Panel("sum of squared weights", ("grok/weight_norm",)),
            Panel("share of W_L in each key frequency", "grok/key_freq/")),
    hidden=("grok/n_key_freqs", "grok/key_logit_fraction", "grok/excluded_loss/"),
    headline=("grok/restricted_loss", "grok/excluded_loss", "grok/weight_norm"),
    stages=STAGES,
)


def final_options(model, task: ModularAddition, options: dict) -> dict:
    """The probe's options for measuring a finished run (`phasewatch analyze`), given the
    model with its last checkpoint's weights: `key_freqs` "final", the default there,
    becomes that checkpoint's key frequencies, used at every checkpoint as Nanda et al.
    2023 do (the final model's key frequencies, fixed over training); a list is checked;
    null keeps each checkpoint's own. ConfigError for a bad list; a warning when the last
    checkpoint has no key frequency (the run has not formed the Fourier circuit)."""
    check_modulus(task.p)
    key_freqs = options.get("key_freqs", FINAL)
    if key_freqs == FINAL:
        key_freqs = model_key_frequencies(model, task.p)
        if not key_freqs:
            warnings.warn("grokking: the last checkpoint has no key frequency (none carries over "
                          f"{KEY_FACTOR:g}x the uniform share of W_L), so the restricted loss measures constant "
                          "logits and the excluded loss the full ones; the run has not formed the Fourier circuit. "
                          'Give key frequencies with --options \'{"grokking": {"key_freqs": [...]}}\' or null '
                          "for each checkpoint's own.", stacklevel=2)
    return {**options, "key_freqs": check_key_freqs(key_freqs, task.p)}


@register_probe("grokking", applies_to=_applies, keys=KEYS, final_options=final_options)
def grokking_probe(model, task: ModularAddition, key_freqs: str | list[int] | None = None) -> dict:
    """The progress measures of `progress_measures` (keys listed there); 1-layer models.

    Option `key_freqs` (`--probes.options '{"grokking": {"key_freqs": ...}}'`, or
    `analyze --options`): null, each checkpoint's own key frequencies (the default during
    `fit`: the live curves); a list, those frequencies at every checkpoint (`key_freqs` and
    `grok/key_freq/<k>` then report that list); "final", the key frequencies of the run's
    last checkpoint at every checkpoint, the default of `phasewatch analyze RUN_DIR`
    (`final_options`) and refused during `fit`, where the last checkpoint does not exist
    yet. A bad list is refused (ConfigError naming the field).
    """
    return progress_measures(model, task, check_key_freqs(key_freqs, task.p))

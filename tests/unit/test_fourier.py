"""Grokking progress measures on known answers: hand-built logits and weights."""

import math

import pytest
import torch

from phasewatch.probes import get_probe
from phasewatch.probes.grokking import (
    _ce, all_logits, check_key_freqs, check_modulus, final_options, fourier_basis, frequency_norms,
    hurley_rickard_gini, key_directions, key_frequencies, model_key_frequencies, progress_measures, project,
)
from phasewatch.phases.detector import detect_transitions
from phasewatch.tasks import make_task
from phasewatch.errors import ConfigError


class FourierLogitModel(torch.nn.Module):
    """A stand-in 'model' whose logits at the last position are
    sum_k amp_k cos(2 pi k (a + b - c) / p): the algorithm Nanda et al. found."""

    def __init__(self, p, freqs_amps):
        super().__init__()
        self.p, self.freqs_amps = p, freqs_amps
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens):
        a, b = tokens[:, 0, None].double(), tokens[:, 1, None].double()
        c = torch.arange(self.p + 1, dtype=torch.float64)[None, :]
        logits = sum(amp * torch.cos(2 * math.pi * k * (a + b - c) / self.p) for k, amp in self.freqs_amps)
        out = torch.zeros(tokens.shape[0], tokens.shape[1], self.p + 1, dtype=torch.float64)
        out[:, -1] = logits
        return out


def test_fourier_basis_is_orthonormal_and_refuses_bad_p():
    b = fourier_basis(13)
    assert torch.allclose(b @ b.T, torch.eye(13, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(b[0], torch.full((13,), 1 / math.sqrt(13), dtype=torch.float64))
    for bad in (2, 9, 12, 1):
        with pytest.raises(ConfigError, match="odd prime"):
            check_modulus(bad)


def test_frequency_norms_and_key_frequencies_of_known_signals():
    p = 31
    x = torch.arange(p, dtype=torch.float64)
    signal = torch.stack([3 * torch.cos(2 * math.pi * 4 * x / p), 2.5 * torch.sin(2 * math.pi * 11 * x / p),
                          2 * torch.cos(2 * math.pi * 7 * x / p + 0.3),
                          0.3 * torch.cos(2 * math.pi * 2 * x / p)], dim=1)  # a weak one, below 2x uniform
    spectrum = frequency_norms(signal)
    assert spectrum.shape == (15,)
    assert set(key_frequencies(spectrum)) == {4, 11, 7} and key_frequencies(spectrum)[0] == 4
    assert spectrum[[3, 10, 6, 1]].sum() / spectrum.sum() == pytest.approx(1.0, abs=1e-12)
    assert key_frequencies(torch.ones(15)) == []  # nothing stands out in a flat spectrum


def test_gini_of_one_hot_and_constant_vectors():
    for n in (2, 7, 56):
        one_hot = torch.zeros(n)
        one_hot[3 % n] = 1.0
        assert hurley_rickard_gini(one_hot) == pytest.approx((n - 1) / n)
        assert hurley_rickard_gini(torch.full((n,), 2.5)) == pytest.approx(0.0, abs=1e-12)


def test_restricted_and_excluded_loss_of_fourier_logits():
    p, freqs = 23, [(3, 24.0), (7, 18.0), (10, 15.0)]
    task = make_task("modular_addition", p=p, frac_train=0.3)
    model = FourierLogitModel(p, freqs)
    logits = all_logits(model, task)
    test_pairs, train_pairs = task.val_batches()[0].tokens[:, :2], task.train_set().tokens[:, :2]
    full_test_loss = _ce(logits, task, test_pairs)
    key = [3, 7, 10]
    restricted = _ce(project(logits, key_directions(p, key)) + logits.mean(dim=(0, 1), keepdim=True), task, test_pairs)
    excluded = _ce(logits - project(logits, key_directions(p, key)), task, train_pairs)
    assert restricted == pytest.approx(full_test_loss, rel=1e-9)  # nothing outside the key frequencies
    assert excluded == pytest.approx(math.log(p), rel=1e-9)  # nothing left: uniform over p classes
    assert full_test_loss < 0.01


def test_progress_measures_on_a_trained_like_model_finds_its_frequencies():
    """Key frequencies come from W_L; build a 1-layer bridge whose W_L is pure Fourier."""
    from phasewatch.models import ModelConfig, build_model

    p = 29
    task = make_task("modular_addition", p=p, frac_train=0.4)
    model = build_model(ModelConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32), task)
    c = torch.arange(p, dtype=torch.float64)
    with torch.no_grad():
        w_u = torch.zeros(16, p + 1)
        w_u[0, :p] = torch.cos(2 * math.pi * 5 * c / p)
        w_u[1, :p] = torch.sin(2 * math.pi * 5 * c / p)
        w_u[2, :p] = torch.cos(2 * math.pi * 12 * c / p)
        model.original_model.head.weight.copy_(w_u.T)
    out = progress_measures(model, task)
    assert sorted(out["key_freqs"]) == [5, 12]
    assert out["grok/key_freq/5"] + out["grok/key_freq/12"] == pytest.approx(1.0, abs=1e-9)
    assert set(out) >= {"grok/restricted_loss", "grok/excluded_loss", "grok/gini_embed", "grok/gini_neuron_logit",
                        "grok/weight_norm", "grok/excluded_loss/5", "grok/excluded_loss/12"}
    expected_norm = sum(float(w.double().pow(2).sum()) for w in model.parameters())
    assert out["grok/weight_norm"] == pytest.approx(expected_norm)


def test_progress_measures_refuse_non_prime_or_other_operations():
    from phasewatch.models import ModelConfig, build_model

    for kwargs in (dict(p=21), dict(p=23, op="*")):
        task = make_task("modular_addition", frac_train=0.5, **kwargs)
        model = build_model(ModelConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32), task)
        with pytest.raises(ConfigError):
            progress_measures(model, task)


class SwitchingModel(FourierLogitModel):
    """Fourier logits 12 cos(w_k (a + b - c)) in frequencies 3 and 7 (the same at every
    "checkpoint"), and weight views whose W_L = W_U^T W_out holds frequency 3 with norm 1 and
    frequency 7 with norm `s`: frequency 7 is key (share s^2 / (1 + s^2) above twice the
    uniform 1/11 at p = 23) exactly when s^2 > 2/9, i.e. s > 0.471."""

    def __init__(self, p, s):
        super().__init__(p, [(3, 12.0), (7, 12.0)])
        c = torch.arange(p + 1, dtype=torch.float64)
        rows = [fn(2 * math.pi * k * c / p) * amp for k, amp in ((3, 1.0), (7, s)) for fn in (torch.cos, torch.sin)]
        w_out = torch.stack(rows)
        w_out[:, p] = 0.0  # the '=' token is not an answer class
        self.W_out = w_out[None]  # (n_layers, d_mlp = 4, d_model = p + 1)
        self.W_U = torch.eye(p + 1, dtype=torch.float64)  # d_model = vocabulary: W_L = W_out[0, :, :p]^T
        self.W_E = torch.eye(p + 1, dtype=torch.float64)


def test_fixed_key_frequencies_take_away_the_jump_where_the_set_changes():
    """Checkpoints whose logits stay the same while W_L's set of key frequencies changes
    from {3} to {3, 7} between steps 9 and 10: with each checkpoint's own key frequencies
    the restricted and excluded losses jump there (and the transition detector reports the
    jump), with the final checkpoint's they are the same at every step."""
    p = 23
    task = make_task("modular_addition", p=p, frac_train=0.4)
    probe = get_probe("grokking", task)
    checkpoints = [SwitchingModel(p, s) for s in torch.linspace(0, 1, 21).tolist()]  # s = 0.45 at 9, 0.5 at 10
    assert [sorted(model_key_frequencies(m, p)) for m in checkpoints] == [[3]] * 10 + [[3, 7]] * 11

    fixed = final_options(checkpoints[-1], task, {})  # analyze's default: the last checkpoint's
    assert sorted(fixed["key_freqs"]) == [3, 7]
    live = [probe(m, task) for m in checkpoints]
    final = [probe(m, task, **fixed) for m in checkpoints]
    steps = list(range(len(checkpoints)))

    logits = all_logits(checkpoints[0], task)
    test_pairs, train_pairs = task.val_batches()[0].tokens[:, :2], task.train_set().tokens[:, :2]
    only_3 = project(logits, key_directions(p, [3]))
    for key, before, after in (
            ("grok/restricted_loss", _ce(only_3 + logits.mean(dim=(0, 1), keepdim=True), task, test_pairs),
             _ce(logits, task, test_pairs)),  # everything is in the key frequencies
            ("grok/excluded_loss", _ce(logits - only_3, task, train_pairs), math.log(p))):  # nothing is left
        series = [r[key] for r in live]
        assert series == pytest.approx([before] * 10 + [after] * 11, rel=1e-9), key
        assert abs(after - before) > 0.5, key  # a jump, all of it between steps 9 and 10
        (event,) = detect_transitions(steps, series, key)
        assert 9 <= event["midpoint"] <= 10 and event["direction"] == ("down" if after < before else "up")

        assert [r[key] for r in final] == pytest.approx([after] * 21, rel=1e-12), key
        assert detect_transitions(steps, [r[key] for r in final], key) == []
    assert all(r["key_freqs"] == fixed["key_freqs"] for r in final)  # the arrays say which were used
    assert all(r["grok/n_key_freqs"] == 2 for r in final) and live[0]["grok/n_key_freqs"] == 1


def test_key_freqs_option_given_as_a_list_or_final():
    p = 23
    task = make_task("modular_addition", p=p, frac_train=0.4)
    probe, model = get_probe("grokking", task), SwitchingModel(p, 0.0)
    assert probe(model, task, key_freqs=[7, 3])["key_freqs"] == [7, 3]  # a list is used as it is
    assert final_options(model, task, {"key_freqs": [7]}) == {"key_freqs": [7]}
    assert final_options(model, task, {"key_freqs": None}) == {"key_freqs": None}  # each checkpoint's own
    assert final_options(model, task, {"key_freqs": "final"}) == {"key_freqs": [3]}
    with pytest.raises(ConfigError, match="'final'.*not known while the run trains.*phasewatch analyze"):
        probe(model, task, key_freqs="final")  # what fit would pass: no last checkpoint yet
    with pytest.raises(ConfigError, match="does not take"):
        probe(model, task, key_frequencies=[3])


@pytest.mark.parametrize("given, says", [
    ([0], r"\[0\] is not a frequency of p = 23.*1\.\.11"), ([12], "not a frequency"), ([3, 2.0], r"\[2\.0\]"),
    ([True], "not a frequency"), ([3, 7, 3], r"\[3\] given more than once"), ("3", "expected 'final', a list"),
    (3, "expected 'final', a list")])
def test_bad_key_freqs_are_refused_in_one_line(given, says):
    with pytest.raises(ConfigError, match=says) as err:
        check_key_freqs(given, 23)
    assert str(err.value).startswith("probes.options.grokking.key_freqs: ") and "\n" not in str(err.value)
    task = make_task("modular_addition", p=23, frac_train=0.4)
    with pytest.raises(ConfigError, match=says):
        final_options(SwitchingModel(23, 0.0), task, {"key_freqs": given})


def test_final_key_frequencies_of_a_run_without_any_warn():
    """A last checkpoint whose W_L spreads evenly over every frequency has no key frequency:
    the fixed set is empty, and analyze says so instead of measuring silently with it."""
    p = 23
    task = make_task("modular_addition", p=p, frac_train=0.4)
    model = SwitchingModel(p, 0.0)
    c = torch.arange(p + 1, dtype=torch.float64)
    model.W_out = torch.stack([fn(2 * math.pi * k * c / p) for k in range(1, 12) for fn in (torch.cos, torch.sin)])[None]
    model.W_out[0, :, p] = 0.0
    assert model_key_frequencies(model, p) == []
    with pytest.warns(UserWarning, match="last checkpoint has no key frequency"):
        assert final_options(model, task, {}) == {"key_freqs": []}

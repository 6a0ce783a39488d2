"""Grokking progress measures on known answers: hand-built logits and weights."""

import math

import pytest
import torch

from phasewatch.probes.fourier import (
    _ce, all_logits, check_modulus, fourier_basis, frequency_norms, hurley_rickard_gini, key_directions,
    key_frequencies, progress_measures, project,
)
from phasewatch.tasks import ConfigError, make_task


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

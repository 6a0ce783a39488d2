"""The variable probes' classifiers on known answers: a class in the middle of a scalar
encoding is decodable by LDA and logistic probes and not by a least-squares one."""

import pytest
import torch

from phasewatch.probes.tracr import CLASSIFIERS, _standardised, lda_probe_accuracy, logistic_probe_accuracy, probe_accuracy


def _length_from_bos_share(n_max: int = 6, repeats: int = 40):
    """`length` as a model sees it after uniform attention over BOS and the input: the
    share 1 / (n + 1) on BOS, one scalar per row (two columns: the share and noise-free 1)."""
    n = torch.arange(1, n_max + 1).repeat(repeats)
    x = torch.stack([1.0 / (n + 1), torch.zeros(len(n))], 1)
    return x, n - 1


def test_a_middle_class_of_a_scalar_code_is_read_by_lda_and_logistic_probes_only():
    x, y = _length_from_bos_share()
    half = len(y) // 2  # every length in both halves
    assert logistic_probe_accuracy(x[:half], y[:half], x[half:], y[half:]) == 1.0
    assert lda_probe_accuracy(x[:half], y[:half], x[half:], y[half:]) == 1.0
    lstsq = probe_accuracy(x[:half], y[:half], x[half:], y[half:])
    assert lstsq < 0.7  # a linear fit of one-hot targets picks only the extreme classes of one direction


@pytest.mark.parametrize("classifier", [lda_probe_accuracy, logistic_probe_accuracy, probe_accuracy])
def test_one_hot_codes_are_read_exactly_and_noise_at_chance(classifier):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (400,), generator=g)
    one_hot = torch.nn.functional.one_hot(y, 4).double() + 0.01 * torch.randn(400, 4, generator=g, dtype=torch.float64)
    assert classifier(one_hot[:200], y[:200], one_hot[200:], y[200:]) == 1.0
    noise = torch.randn(400, 8, generator=g, dtype=torch.float64)
    assert abs(classifier(noise[:200], y[:200], noise[200:], y[200:]) - 0.25) < 0.12


def test_a_signal_along_one_direction_among_noise_is_read_better_without_masking():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 6, (1200,), generator=g)
    x = torch.randn(1200, 32, generator=g, dtype=torch.float64) + 2.0 * y[:, None] * torch.randn(
        1, 32, generator=g, dtype=torch.float64)
    args = x[:600], y[:600], x[600:], y[600:]
    assert lda_probe_accuracy(*args) > 0.9 and logistic_probe_accuracy(*args) > 0.9
    assert probe_accuracy(*args) < 0.7


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_the_probe_classifiers_on_standardised_features_are_the_public_ones(name):
    """variable_probes standardises every site and fits every variable on each with CLASSIFIERS,
    all sites at once: each site's accuracies are the public classifier's on that site alone."""
    public = {"lda": lda_probe_accuracy, "logistic": logistic_probe_accuracy, "lstsq": probe_accuracy}[name]
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 3, (300,), generator=g)
    x = torch.randn(300, 6, generator=g, dtype=torch.float64) + y[:, None] * torch.randn(1, 6, generator=g, dtype=torch.float64)
    noise = torch.randint(0, 5, (300,), generator=g)  # a second variable fitted beside it, at chance
    sites = torch.stack([x, torch.randn(300, 6, generator=g, dtype=torch.float64)])  # a second site: noise
    got = CLASSIFIERS[name](*_standardised(sites[:, :150], sites[:, 150:]), [y[:150], noise[:150]], [y[150:], noise[150:]])
    for site, per_site in zip(sites, got):
        for i, target in enumerate((y, noise)):
            assert per_site[i] == pytest.approx(public(site[:150], target[:150], site[150:], target[150:]), abs=1e-12)
    assert got[0][0] > 0.5 and got[0][1] < 0.4 and got[1][0] < 0.5


def test_lda_never_names_a_class_that_training_did_not_have():
    """A label seen only in the held-out half (4) has no class mean to score with: LDA picks
    among the trained classes, even for inputs far from all of them (where a zero mean and
    its prior would win), and calls only the untrained label's row wrong."""
    g = torch.Generator().manual_seed(3)
    y = torch.arange(4).repeat(50)
    x = torch.nn.functional.one_hot(y, 4).double() + 0.05 * torch.randn(200, 4, generator=g, dtype=torch.float64)
    far = torch.tensor([[0.0, -10.0, -10.0, -10.0]]).repeat(9, 1)  # nearest to class 0 by far, and far from all
    x_test, y_test = torch.cat([far, torch.zeros(1, 4, dtype=torch.float64)]), torch.tensor([0] * 9 + [4])
    assert lda_probe_accuracy(x, y, x_test, y_test) == 0.9
    sites = torch.stack([x, x])  # and batched with a second variable beside it
    a, test = _standardised(sites, torch.stack([x_test, x_test]))
    got = CLASSIFIERS["lda"](a, test, [y, y % 2], [y_test, y_test % 2])
    assert [row[0] for row in got] == [0.9, 0.9]

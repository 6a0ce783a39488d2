"""Local learning coefficient by SGLD on potentials with known learning coefficients."""

import math

import pytest
import torch

from phasewatch.probes.llc import estimate_llc, model_llc
from phasewatch.tasks import make_task
from phasewatch.trainers.model import ModelConfig, build_model

D = 64  # independent copies of the 1-D potential, estimated together: lambda = D / k


@pytest.mark.parametrize("power,expected,step", [(2, 1 / 2, 2e-4), (4, 1 / 4, 1e-3), (6, 1 / 6, 1e-3)])
def test_one_dimensional_potentials(power, expected, step):
    out = estimate_llc(lambda ws: ws[0].pow(power).sum(), [torch.zeros(D, dtype=torch.float64)], n=1000,
                       chains=2, draws=3000, burn_in=1000, step_size=step, gamma=1.0)
    assert out["llc/converged"] == 1.0
    assert out["llc"] / D == pytest.approx(expected, rel=0.08)
    assert out["trace"].shape == (2, 3000)


def test_d_dimensional_quadratic_has_d_over_two():
    d = 10
    out = estimate_llc(lambda ws: (ws[0] ** 2).sum() + 0 * ws[1].sum(), [torch.zeros(d, dtype=torch.float64),
                       torch.zeros(3, 3, dtype=torch.float64)], n=1000, chains=4, draws=3000, burn_in=1000,
                       step_size=2e-4, gamma=1.0)
    # the 9 parameters the loss ignores are held only by the localisation term: they add nothing
    assert out["llc"] == pytest.approx(d / 2, rel=0.1)


def test_divergence_is_reported_instead_of_a_number():
    out = estimate_llc(lambda ws: ws[0].pow(4).sum(), [torch.ones(4, dtype=torch.float64)], n=1000,
                       chains=2, draws=100, burn_in=10, step_size=1.0)
    assert out["llc/converged"] == 0.0 and out["llc"] is None


def test_llc_of_a_trained_small_model_is_finite_and_positive():
    """At (near) a minimum of the training loss, as the LLC assumes."""
    torch.manual_seed(0)
    task = make_task("modular_addition", p=13, frac_train=0.5)
    model = build_model(ModelConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32), task)
    batch = task.train_set()
    opt = torch.optim.Adam(model.original_model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(model.original_model(batch.tokens)[:, -1], batch.targets[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = model_llc(model, task, chains=2, draws=50, burn_in=20, step_size=1e-6, gamma=100.0)
    assert out["llc/converged"] == 1.0 and math.isfinite(out["llc/estimate"]) and out["llc/estimate"] > 0

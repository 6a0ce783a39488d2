"""Local learning coefficient by SGLD on potentials with known learning coefficients, and
the probe on a real model (its parameters come back exactly)."""

import math
import warnings

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.probes import get_probe
from phasewatch.probes.llc import calibrate_llc, estimate_llc, model_llc, recommend_step_size, training_loss_llc
from phasewatch.tasks import make_task

D = 64  # independent copies of the 1-D potential, estimated together: lambda = D / k


@pytest.mark.parametrize("power,expected,step", [(2, 1 / 2, 2e-4), (4, 1 / 4, 1e-3), (6, 1 / 6, 1e-3)])
def test_one_dimensional_potentials(power, expected, step):
    w = torch.zeros(D, dtype=torch.float64)
    out = estimate_llc(lambda t: w.pow(power).sum(), [w], n=1000,
                       chains=2, draws=3000, burn_in=1000, step_size=step, gamma=1.0)
    assert out["llc/converged"] == 1.0
    assert out["llc"] / D == pytest.approx(expected, rel=0.08)
    assert out["trace"].shape == (2, 4000)
    assert out["llc/drift"] < 0.1
    assert torch.equal(w, torch.zeros(D, dtype=torch.float64))  # sampled in place, then put back


def test_d_dimensional_quadratic_has_d_over_two():
    d = 10
    w, unused = torch.zeros(d, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)
    out = estimate_llc(lambda t: (w ** 2).sum() + 0 * unused.sum(), [w, unused], n=1000, chains=4, draws=1500,
                       burn_in=500, step_size=2e-4, gamma=1.0)
    # the 9 parameters the loss ignores are held only by the localisation term: they add nothing
    # (SGLD seeds 0-7 at these draws: within 5% of d/2; 3000 draws: 3%)
    assert out["llc"] == pytest.approx(d / 2, rel=0.1)


def test_minibatch_losses_estimate_the_same_coefficient():
    """A regular model, least squares with d = 5 weights on n = 2,000 samples (lambda = d/2),
    sampled with minibatch gradients of 200 samples: an unbiased loss estimate per step."""
    g = torch.Generator().manual_seed(0)
    n, d = 2000, 5
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, d + 1, dtype=torch.float64) + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].clone()
    pick = torch.Generator().manual_seed(1)

    def loss(t):
        idx = slice(None) if t < 0 else torch.randperm(n, generator=pick)[:200]
        return ((x[idx] @ w - y[idx]) ** 2).mean() / 2

    out = estimate_llc(loss, [w], n=n, chains=4, draws=3000, burn_in=750, step_size=1e-4, gamma=1.0)
    assert out["llc"] == pytest.approx(d / 2, rel=0.15)  # (seeds 0-7 of SGLD and minibatches: within 9%)


def test_divergence_is_reported_instead_of_a_number():
    w = torch.ones(4, dtype=torch.float64)
    out = estimate_llc(lambda t: w.pow(4).sum(), [w], n=1000, chains=2, draws=100, burn_in=10, step_size=1.0)
    assert out["llc/converged"] == 0.0 and out["llc"] is None
    assert torch.equal(w, torch.ones(4, dtype=torch.float64))


def test_parameters_are_restored_when_the_loss_fails_mid_chain():
    w = torch.full((3,), 0.5, dtype=torch.float64)

    def loss(t):
        if t == 7:
            raise RuntimeError("boom")
        return (w ** 2).sum()

    with pytest.raises(RuntimeError, match="boom"):
        estimate_llc(loss, [w], n=100, chains=1, draws=20, burn_in=0, step_size=1e-2)
    assert torch.equal(w, torch.full((3,), 0.5, dtype=torch.float64)) and not w.requires_grad


def test_bad_settings_are_refused():
    w = torch.zeros(2)
    with pytest.raises(ValueError, match="step_size"):
        estimate_llc(lambda t: (w ** 2).sum(), [w], n=10, step_size=-1.0)
    with pytest.raises(ValueError, match="n >= 2"):
        estimate_llc(lambda t: (w ** 2).sum(), [w], n=1)


def test_llc_of_a_trained_small_model_is_positive_and_leaves_the_model_exactly_as_it_was(trained_small_model):
    """At (near) a minimum of the training loss, as the LLC assumes. The bridge reaches
    each weight under several names; the estimate must not leave a sampled copy behind."""
    model, task = trained_small_model
    before = {k: v.clone() for k, v in model.original_model.state_dict().items()}
    flags = [p.requires_grad for p in model.original_model.parameters()]
    logits = model.original_model(task.train_set().tokens)
    out = model_llc(model, task, chains=2, draws=50, burn_in=20, step_size=1e-4, gamma=300.0)
    assert out["llc/converged"] == 1.0 and math.isfinite(out["llc/estimate"]) and out["llc/estimate"] > 0
    after = model.original_model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model.original_model(task.train_set().tokens), logits)
    assert [p.requires_grad for p in model.original_model.parameters()] == flags


def test_calibration_finds_the_plateau_between_too_small_and_too_large_steps(trained_small_model):
    """The estimate is flat for step sizes 3e-5..1e-4, then the discretisation inflates it
    (1e-3: ~4x) and a step of 0.1 leaves the basin: the recommendation is the plateau's top."""
    model, task = trained_small_model
    rows = calibrate_llc(model, task, (3e-5, 1e-4, 1e-3, 1e-1), chains=2, draws=400, burn_in=200, gamma=300.0)
    assert [r["step_size"] for r in rows] == [3e-5, 1e-4, 1e-3, 1e-1]
    assert not rows[-1]["converged"] and rows[-1]["llc"] is None
    assert rows[2]["llc"] > 2 * rows[1]["llc"]
    assert recommend_step_size(rows) == 1e-4
    assert abs(rows[1]["llc"] - rows[0]["llc"]) <= 0.25 * rows[0]["llc"]


def test_recommendation_needs_agreeing_settled_neighbours():
    rows = [{"step_size": 1e-5, "converged": True, "llc": 10.0, "drift": 0.05},
            {"step_size": 3e-5, "converged": True, "llc": 11.0, "drift": 0.05},
            {"step_size": 1e-4, "converged": True, "llc": 30.0, "drift": 0.05},   # disagrees with 3e-5
            {"step_size": 3e-4, "converged": False, "llc": None, "drift": None}]
    assert recommend_step_size(rows) == 3e-5
    rows[1]["drift"] = 0.5  # not settled
    assert recommend_step_size(rows) is None


def test_the_probe_warns_when_it_runs_on_the_uncalibrated_default_step_size(trained_small_model):
    """The default step size is calibrated on two configs; elsewhere it may inflate the LLC
    (2x on the paper's grokking config), so a run that does not set it is told how to check."""
    model, task = trained_small_model
    probe, cheap = get_probe("llc", task), {"chains": 1, "draws": 5, "burn_in": 2}
    with pytest.warns(UserWarning, match="bench/llc_calibration.py"):
        probe(model, task, **cheap)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe(model, task, step_size=1e-4, **cheap)["llc/converged"] == 1.0


@pytest.mark.parametrize("case", ["minibatches", "full batch", "streaming pool"])
def test_chains_side_by_side_follow_the_same_paths_as_one_after_the_other(trained_small_model, case):
    """The vectorised chains (torch.func.vmap, the default) against the sequential ones, with
    the same minibatches and noise streams: the same loss at every SGLD step, to float accuracy."""
    model, task = trained_small_model
    options = dict(chains=3, draws=20, burn_in=10, step_size=1e-4, gamma=300.0)
    if case == "minibatches":
        options["batch_size"] = 16  # random minibatches of the 84 training pairs
    elif case == "streaming pool":
        task = make_task("induction", vocab_size=16, seq_len=17, min_len=2, max_len=8, batch_size=8)
        model = build_model(ModelConfig(n_layers=2, d_model=16, n_heads=2, attn_only=True, seed=2), task)
        options["pool"] = 3
    together = training_loss_llc(model, task, side_by_side=True, **options)
    apart = training_loss_llc(model, task, side_by_side=False, **options)
    assert together["llc/converged"] == apart["llc/converged"] == 1.0
    assert torch.allclose(together["trace"], apart["trace"], rtol=1e-5, atol=1e-7)
    assert together["llc"] == pytest.approx(apart["llc"], rel=1e-3)
    assert len({tuple(row[:5].tolist()) for row in together["trace"]}) == 3  # the chains are not copies of each other


def test_the_training_loss_llc_of_a_full_batch_task_is_the_estimate_of_its_training_sets_loss(trained_small_model):
    """With minibatches as large as the training set, chain after chain, the probe's LLC is
    `estimate_llc` of the hand-written loss on every training pair (the answer's position):
    the same chains, step by step, with n the number of pairs and its noise from the same seed."""
    from phasewatch.models import native_module

    model, task = trained_small_model
    full = task.train_set()
    module = native_module(model)
    params = [p for p in module.parameters() if p.requires_grad]
    settings = dict(chains=2, draws=15, burn_in=5, step_size=1e-4, gamma=300.0, seed=4)

    def loss(t: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(module(full.tokens)[:, -1].double(), full.targets[:, -1])

    expected = estimate_llc(loss, params, n=len(full), **settings)
    out = training_loss_llc(model, task, side_by_side=False, batch_size=10 ** 6, **settings)
    assert out["loss_star"] == pytest.approx(expected["loss_star"], rel=1e-12)
    assert torch.allclose(out["trace"], expected["trace"], rtol=1e-9, atol=0)
    assert out["llc"] == pytest.approx(expected["llc"], rel=1e-6)


def test_a_streaming_tasks_llc_is_measured_on_its_first_pool_batches():
    """L_n(w*) of a streaming task: the mean loss over every prediction of its training
    batches 0..pool-1 (8 by default), computed here by hand."""
    task = make_task("induction", vocab_size=16, seq_len=17, min_len=2, max_len=8, batch_size=8)
    model = build_model(ModelConfig(n_layers=2, d_model=16, n_heads=2, attn_only=True, seed=2), task)

    def pool_loss(pool: int) -> float:
        losses = []
        with torch.no_grad():
            for i in range(pool):
                batch = task.train_batch(i, None)
                logits = model(batch.tokens)
                per = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
                losses.append(per[batch.loss_mask.flatten()])
        return float(torch.cat(losses).double().mean())

    cheap = dict(chains=1, draws=3, burn_in=1, step_size=1e-4)
    assert training_loss_llc(model, task, pool=3, **cheap)["loss_star"] == pytest.approx(pool_loss(3), rel=1e-5)
    assert training_loss_llc(model, task, **cheap)["loss_star"] == pytest.approx(pool_loss(8), rel=1e-5)

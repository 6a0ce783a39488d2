"""phasewatch's LLC against devinterp's with the settings mapped as docs/llc.md says ("Against
devinterp"): nbeta = n / log n, lr = step_size, localization = gamma, init_loss = L_n(w*), the
same batches, only the trainable parameters sampled. Runs when devinterp (1.3.x) is installed."""

import math

import pytest
import torch

devinterp_sampler = pytest.importorskip("devinterp.slt.sampler")
from devinterp.optim.sgld import SGLD  # noqa: E402

from phasewatch.models import ModelConfig, build_model  # noqa: E402
from phasewatch.probes.llc import estimate_llc, model_llc  # noqa: E402
from phasewatch.tasks import make_task  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def devinterp_llc(model, batch, evaluate, n, loss_star, trainable=None, **settings):
    """devinterp's estimate on one full batch (the same loss at every step as phasewatch's
    deterministic one), with phasewatch's settings translated."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch), batch_size=len(batch[0]))
    mask = None if trainable is None else {
        name: torch.full_like(p, bool(trainable(p)), dtype=torch.bool) for name, p in model.named_parameters()}
    return devinterp_sampler.estimate_learning_coeff(
        model, loader, evaluate=evaluate, sampling_method=SGLD,
        optimizer_kwargs={"lr": settings["step_size"], "localization": settings["gamma"], "nbeta": n / math.log(n)},
        num_chains=settings["chains"], num_draws=settings["draws"], num_burnin_steps=settings["burn_in"],
        init_loss=loss_star, seed=list(range(settings["chains"])), verbose=False,
        optimize_over_per_model_param=mask)


def test_both_give_d_over_two_on_least_squares():
    """A regular model at its minimum: least squares with d = 5 weights on n = 2,000 samples."""
    g = torch.Generator().manual_seed(0)
    n, d = 2000, 5
    x = torch.randn(n, d, generator=g)
    y = x @ torch.arange(1.0, d + 1) + 0.5 * torch.randn(n, generator=g)
    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(x, y[:, None]).solution.T)

    def loss_of(m, data):
        xs, ys = data
        return ((m(xs)[:, 0] - ys) ** 2).mean() / 2

    settings = {"chains": 4, "draws": 2000, "burn_in": 500, "step_size": 1e-4, "gamma": 1.0}
    with torch.no_grad():
        loss_star = float(loss_of(model, (x, y)))
    ours = estimate_llc(lambda t: loss_of(model, (x, y)), list(model.parameters()), n, loss_star=loss_star, **settings)
    theirs = devinterp_llc(model, (x, y), lambda m, data: loss_of(m, data), n, loss_star, **settings)
    assert ours["llc"] == pytest.approx(d / 2, rel=0.15)
    assert theirs == pytest.approx(d / 2, rel=0.15)


class Rebuilt(torch.nn.Module):
    """A model whose deep copies are built afresh and loaded with its weights. devinterp deep-copies
    the model once per chain, and a deep copy of a TransformerLens bridge model shares the
    bridge's capture hooks with the original (they hold a weak proxy of the original's attention),
    so a copy's forward pass leaves a tensor with a graph on the original and the next copy fails."""

    def __init__(self, build, state=None):
        super().__init__()
        self.build = build
        self.net = build()
        if state is not None:
            self.net.load_state_dict(state)

    def forward(self, tokens):
        return self.net(tokens)

    def __deepcopy__(self, memo):
        return Rebuilt(self.build, {k: v.detach().clone() for k, v in self.net.state_dict().items()})


def test_both_agree_on_a_trained_transformer():
    """A checkpoint of a training run: the quickstart's 1-layer model, small, trained on
    (a + b) mod 13 for 300 full-batch steps; full-batch SGLD in both."""
    torch.manual_seed(0)
    task = make_task("modular_addition", p=13, frac_train=0.5)
    config = ModelConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32)
    model = build_model(config, task)
    net = model.original_model
    batch = task.train_set()
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(net(batch.tokens)[:, -1], batch.targets[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()

    settings = {"chains": 4, "draws": 300, "burn_in": 200, "step_size": 1e-4, "gamma": 300.0}
    ours = model_llc(model, task, batch_size=len(batch), **settings)
    assert ours["llc/converged"] == 1.0
    n = int(batch.loss_mask.sum())

    def evaluate(m, data):
        tokens, targets = data
        return torch.nn.functional.cross_entropy(m(tokens)[:, -1].double(), targets[:, -1])

    rebuilt = Rebuilt(lambda: build_model(config, task).original_model, net.state_dict())
    theirs = devinterp_llc(rebuilt, (batch.tokens, batch.targets), evaluate, n, ours["llc/loss_star"],
                           trainable=lambda p: p.requires_grad, **settings)
    assert theirs == pytest.approx(ours["llc/estimate"], rel=0.25), (ours["llc/estimate"], theirs)

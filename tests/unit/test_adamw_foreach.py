"""AdamW as `training.module.adamw_with_warmup` builds it on the CPU (`foreach=True`: one call
per operation over all tensors) updates the weights bit for bit as PyTorch's for-loop AdamW
(`foreach=False`), on each shipped config's model (shrunk) and on a population's stacked
weights."""

import copy
from pathlib import Path

import pytest
import torch
import yaml

from phasewatch.tasks.base import masked_loss
from phasewatch.training.lightning_cli import instantiate_config
from phasewatch.training.module import adamw_with_warmup

#: by default one model of each kind (with an MLP; attention-only with a frozen layer; a RASP
#: task's), the other shipped configs' with --runslow
FAST = {"quickstart_tiny", "induction_2l_freeze_l0", "reverse"}
CONFIGS = [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
           for name in sorted(p.stem for p in Path("configs").glob("*.yaml"))]
#: the models shrunk (the optimizer's arithmetic is the same at any size)
SMALL = {"d_model": 16, "n_heads": 2, "d_head": 8, "d_mlp": 32}
STEPS = 6


def for_loop(params, hp):
    """The reference: PyTorch's for-loop AdamW and the same warm-up."""
    opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"], betas=tuple(hp["betas"]),
                            foreach=False)
    warmup = hp["warmup_steps"]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup) if warmup else 1.0)


def trained(params, optimizer, sched, loss_of) -> list[bytes]:
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(step).backward()
        optimizer.step()
        sched.step()
    return [p.detach().numpy().tobytes() for p in params]


def test_the_cpu_adamw_is_foreach():
    """What the other tests compare is what fit runs (not PyTorch's default for-loop)."""
    opt = adamw_with_warmup([torch.zeros(2, requires_grad=True)], {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.98),
                                                                   "warmup_steps": 2}, fused=False)["optimizer"]
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


@pytest.mark.parametrize("name", CONFIGS)
def test_foreach_adamw_trains_a_configs_model_as_the_for_loop(name):
    path = f"configs/{name}.yaml"
    cfg = yaml.safe_load(Path(path).read_text())
    arch = cfg["model"].setdefault("arch", {})
    arch.update({k: v for k, v in SMALL.items() if k != "d_mlp" or not arch.get("attn_only")})
    module = instantiate_config(cfg, path).model
    task, hp = module.task, dict(module.hparams)
    hp["warmup_steps"] = min(hp["warmup_steps"], 3)  # the warm-up's lr and the full lr, both within STEPS
    twin = copy.deepcopy(module.model)
    size = cfg["data"].get("batch_size")

    def loss_of(model):
        def loss(step):
            batch = task.train_batch(step, size)
            return masked_loss(model(batch.tokens), batch, module.loss_dtype)
        return loss

    ours = [p for p in module.model.parameters() if p.requires_grad]
    theirs = [p for p in twin.parameters() if p.requires_grad]
    got = adamw_with_warmup(ours, hp, fused=False)
    want = trained(theirs, *for_loop(theirs, hp), loss_of(twin))
    assert trained(ours, got["optimizer"], got["lr_scheduler"]["scheduler"], loss_of(module.model)) == want
    assert any(p.detach().abs().sum() > 0 for p in ours)  # weights, trained


def test_foreach_adamw_steps_a_populations_stacked_weights_as_the_for_loop():
    """Stacked weights ([members, ...], as training/population.py steps them), with the
    members' gradients of different sizes and one weight without a gradient (frozen)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 16, 8), (4, 8), (4, 2, 16, 8), (4, 1)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * torch.logspace(-4, 1, 4).view(-1, *[1] * (len(s) - 1)) for s in shapes]
             for _ in range(STEPS)]
    hp = {"lr": 3e-3, "weight_decay": 1.0, "betas": (0.9, 0.98), "warmup_steps": 3}

    def run(make):
        params = [w.clone().requires_grad_() for w in init]
        opt, sched = make(params)
        for step in range(STEPS):
            opt.zero_grad()
            for p, g in zip(params[:-1], grads[step]):
                p.grad = g.clone()
            opt.step()
            sched.step()
        return [p.detach().numpy().tobytes() for p in params]

    def ours(params):
        made = adamw_with_warmup(params, hp, fused=False)
        return made["optimizer"], made["lr_scheduler"]["scheduler"]

    assert run(ours) == run(lambda params: for_loop(params, hp))
    assert run(ours) != run(lambda params: for_loop(params, {**hp, "lr": 3.001e-3}))  # a bit apart is told apart

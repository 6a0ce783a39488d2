"""`call_with` (models/factory.py): functional_call's tied weights put in once per entry, the
module's walk kept between calls; its results and the module's entries after it as
`torch.func.functional_call`'s (tie_weights) with `parameters_kept`."""

import torch
from torch.func import functional_call, vmap

from phasewatch.models import call_with, parameters_kept


class Tied(torch.nn.Module):
    """A submodule reached under two paths (`inner`, `alias`), and a weight two modules share."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.alias = self.inner
        self.embed = torch.nn.Linear(3, 3, bias=False)
        self.unembed = torch.nn.Linear(3, 3, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, x):
        return self.unembed(torch.relu(self.alias(self.embed(x))))


def _entries(module):
    return [(id(sub), name, param) for _, sub in module.named_modules(remove_duplicate=False)
            for name, param in sub.named_parameters(recurse=False)]


def test_call_with_is_functional_call_with_tied_weights_under_vmap_and_keeps_the_entries():
    torch.manual_seed(0)
    module = Tied()
    before = _entries(module)
    stacked = {name: torch.randn(4, *p.shape, requires_grad=True) for name, p in module.named_parameters()}
    assert set(stacked) == {"inner.weight", "inner.bias", "embed.weight"}  # unembed.weight, alias.* tied
    x = torch.randn(4, 5, 3)
    outs = []
    for call in (lambda p, x: functional_call(module, p, (x,)), lambda p, x: call_with(module, p, (x,))):
        with parameters_kept(module):
            y = vmap(call)(stacked, x)
        y.square().sum().backward()
        outs.append((y.detach(), {k: v.grad.clone() for k, v in stacked.items()}))
        for v in stacked.values():
            v.grad = None
        assert [(i, n, p) for i, n, p in _entries(module)] == before  # the same parameters back in place
    (y0, g0), (y1, g1) = outs
    assert torch.equal(y0, y1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    # the shared weight reached unembed too: not module's own weight
    assert not torch.allclose(y1[0], module(x[0]))
    # a parameter replaced after a call is seen at the next
    module.inner.weight = torch.nn.Parameter(torch.zeros(3, 3))
    one = {name: p[0] for name, p in stacked.items()}
    assert torch.equal(call_with(module, one, (x[0],)), functional_call(module, one, (x[0],)))
    # names other than `named_parameters`' go through functional_call's own untying
    aliased = {"alias.weight": one["inner.weight"], "alias.bias": one["inner.bias"], "embed.weight": one["embed.weight"]}
    assert torch.equal(call_with(module, aliased, (x[0],)), functional_call(module, one, (x[0],)))

"""Probes over a population's stacked weights (phasewatch/probes/stacked.py) give each member
the values the probe gives it alone, and a population measures them once per step."""

import copy
import math

import pytest
import torch

from phasewatch.callbacks.probes import StackedProbes
from phasewatch.models import ModelConfig, build_model, native_module
from phasewatch.probes import stacked
from phasewatch.probes.composition import composition_probe
from phasewatch.probes.grokking import grokking_probe
from phasewatch.probes.heads import heads_probe
from phasewatch.tasks import make_task


def _members(task, n):
    models = []
    for seed in range(n):
        torch.manual_seed(seed)
        models.append(build_model(ModelConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32), task))
    return (*_stacked(models), models)


def _stacked(models):
    """(template, params): a copy of the members' native module, their parameters stacked."""
    template = copy.deepcopy(native_module(models[0]))
    params = {name: torch.stack([dict(native_module(m).named_parameters())[name].detach() for m in models])
              for name, _ in template.named_parameters()}
    return template, params


def _induction_members(normalization="none", n_layers=2):
    """The induction task and three members of a small model (seeds 0-2): attention only without a norm."""
    task = make_task("induction", vocab_size=12, seq_len=11, max_len=5)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build_model(ModelConfig(n_layers=n_layers, d_model=16, n_heads=2, d_head=8,
                                              attn_only=normalization == "none", normalization=normalization), task))
    return task, models


def _each_own(together, alone, rel_tol):
    """Every member's values over stacked weights are its own: floats to `rel_tol`, lists equal."""
    for values, own in zip(together, alone):
        assert set(values) == set(own)
        for key, value in own.items():
            if isinstance(value, float):
                assert math.isclose(values[key], value, rel_tol=rel_tol, abs_tol=rel_tol * 1e-3), key
            elif isinstance(value, list):
                assert values[key] == value, key
            else:
                torch.testing.assert_close(values[key], value, equal_nan=True)


def test_the_grokking_probe_over_stacked_weights_is_each_members_own(monkeypatch):
    task = make_task("modular_addition", p=13, frac_train=0.4)
    template, params, models = _members(task, 3)
    monkeypatch.setattr(stacked, "MEMBERS_PER_PASS", 2)  # two passes: members 0-1, then 2
    together = stacked.grokking_stacked(template, params, models, task)
    assert together[0]["grok/excluded_loss"] != together[1]["grok/excluded_loss"]  # the members differ
    for model, values in zip(models, together):
        alone = grokking_probe(model, task)
        assert set(values) == set(alone) and values["key_freqs"] == alone["key_freqs"]
        for key, value in alone.items():
            if isinstance(value, float):
                assert math.isclose(values[key], value, rel_tol=1e-6, abs_tol=1e-9), key
        torch.testing.assert_close(values["spectrum"], alone["spectrum"])
    fixed = stacked.grokking_stacked(template, params, models, task, key_freqs=[1, 4])
    assert fixed[2]["key_freqs"] == [1, 4] == grokking_probe(models[2], task, key_freqs=[1, 4])["key_freqs"]


@pytest.mark.parametrize("normalization", ["none", "LN"])
def test_the_composition_probe_over_stacked_weights_is_each_members_own(normalization):
    """Three 2-layer members (and a stack of one): every score, maximum, count and composing pair."""
    task = make_task("induction", vocab_size=8, seq_len=11, max_len=5)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build_model(ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=8, attn_only=True,
                                              normalization=normalization), task))
    together = stacked.composition_stacked(None, {}, models, task)
    assert together[0]["comp/k/max"] != together[1]["comp/k/max"]  # the members differ
    assert stacked.composition_stacked(None, {}, models[2:], task, factor=1.2)[0]["k_pairs"] == \
        composition_probe(models[2], task, factor=1.2)["k_pairs"]
    _each_own(together, [composition_probe(model, task) for model in models], rel_tol=1e-12)


@pytest.mark.parametrize("normalization", ["none", "LN"])
def test_the_composition_weights_are_read_once_over_the_stacked_parameters_without_a_scale_to_fold(
        monkeypatch, normalization):
    """Given the members' stacked parameters, the composition probe reads the weights of a model
    without a LayerNorm scale once for all members (`stacked_reads`: `head_weights` runs under
    one vmap and for the witness read alone, not for each member), and each member's values are
    those it gets over its own weights, bit for bit (every score, maximum and pair, with the
    population's own weights as with none given); with a scale to fold (LN), member by member."""
    task, models = _induction_members(normalization)
    if normalization == "LN":  # a LayerNorm scale of each member's own
        with torch.no_grad():
            for model in models:
                model.blocks[0].ln1.w.mul_(torch.rand_like(model.blocks[0].ln1.w) + 0.5)
    template, params = _stacked(models)
    alone = stacked.composition_stacked(template, {}, models, task)  # (every member's own weights)
    calls = []
    read = stacked.head_weights
    monkeypatch.setattr(stacked, "head_weights", lambda model: calls.append(model) or read(model))
    together = stacked.composition_stacked(template, params, models, task)
    assert len(calls) == (len(models) if normalization == "LN" else 2)  # (under vmap once, the witness alone)
    for values, own in zip(together, alone):
        assert values.keys() == own.keys()
        for key, value in own.items():
            if torch.is_tensor(value):
                assert torch.equal(values[key].nan_to_num(-1.0), value.nan_to_num(-1.0)), key
                assert torch.equal(values[key].isnan(), value.isnan()), key
            else:
                assert values[key] == value, key


@pytest.mark.parametrize("normalization", ["none", "LN"])
def test_the_heads_probe_over_stacked_weights_is_each_members_own(monkeypatch, normalization):
    """Three 2-layer members in passes of two (members 0-1, then 2 alone): every score, copy
    loss, count and head list, with the thresholds option; a model whose attention patterns
    cannot be read over stacked weights is left to run member by member (None)."""
    task, models = _induction_members(normalization)
    template, params = _stacked(models)
    monkeypatch.setattr(stacked, "MEMBERS_PER_PASS", 2)
    thresholds = {"prev_token": 0.3, "induction": 0.2}
    together = stacked.heads_stacked(template, params, models, task, thresholds=thresholds)
    assert together[0]["icl/loss_gap"] != together[1]["icl/loss_gap"]  # the members differ
    _each_own(together, [heads_probe(model, task, thresholds=thresholds) for model in models], rel_tol=1e-6)
    assert stacked.heads_stacked(torch.nn.Linear(2, 2), {"weight": torch.zeros(3, 2, 2)}, models, task) is None


def test_a_population_measures_a_stacked_probe_once_per_step_for_the_members_that_ask(monkeypatch):
    """The first member to ask at a step gets the probe measured for every member expected to
    ask; the others are handed theirs; one not expected is measured when it asks; a new step
    measures again; a probe without a stacked form is left to the member (None)."""
    task = make_task("modular_addition", p=7, frac_train=0.5)
    template, params, models = _members(task, 3)
    calls = []

    def counted(template, params, models, task, **options):
        calls.append(next(iter(params.values())).shape[0])
        return [{"member": id(m), **options} for m in models]

    monkeypatch.setitem(stacked.STACKED, "grokking", counted)
    probes = StackedProbes(template, lambda: params, models, task)
    probes.expect([0, 2])
    assert probes.values(2, "grokking", {}, 5) == {"member": id(models[2])} and calls == [2]
    assert probes.values(0, "grokking", {}, 5) == {"member": id(models[0])} and calls == [2]
    assert probes.values(1, "grokking", {}, 5) == {"member": id(models[1])} and calls == [2, 1]
    assert probes.values(0, "grokking", {"key_freqs": [1]}, 5)["key_freqs"] == [1] and calls == [2, 1, 2]
    assert probes.values(0, "grokking", {}, 6) == {"member": id(models[0])} and calls == [2, 1, 2, 2]
    assert probes.values(0, "llc", {}, 6) is None  # (no stacked form)


def test_a_stacked_probe_is_measured_only_for_the_members_that_will_run_it_at_the_hook(monkeypatch):
    """A member acting at a step (e.g. every member at a look of the watchers' grid) whose
    runner plans no run of the probe at the hook now running is left out of the pass; a
    member without a plan counts as wanting it; a member that asks unplanned is measured then."""
    task = make_task("modular_addition", p=7, frac_train=0.5)
    template, params, models = _members(task, 4)
    calls = []

    def counted(template, params, models, task, **options):
        calls.append(next(iter(params.values())).shape[0])
        return [{"member": id(m)} for m in models]

    monkeypatch.setitem(stacked.STACKED, "grokking", counted)
    probes = StackedProbes(template, lambda: params, models, task)
    views = [probes.values_of(k) for k in range(4)]
    views[1].plan(lambda at, name: False)  # runs nothing now
    views[2].plan(lambda at, name: at == "validation")  # runs it at validations only
    views[3].plan(lambda at, name: name == "grokking")
    assert views[0]("grokking", {}, 5) == {"member": id(models[0])} and calls == [2]  # members 0 and 3
    assert views[3]("grokking", {}, 5) == {"member": id(models[3])} and calls == [2]
    assert views[1]("grokking", {}, 5) == {"member": id(models[1])} and calls == [2, 1]  # asked unplanned
    assert views[2]("grokking", {}, 6, "validation") == {"member": id(models[2])} and calls == [2, 1, 3]  # 0, 2, 3


def test_measure_switches_to_eval_only_for_a_probe_that_runs_on_the_model():
    """A probe given over stacked weights leaves the model's mode alone (switching a bridge
    costs ~6 ms); one that runs on the model sees every module in eval mode, each set once;
    each module's own mode is put back (a submodule in eval mode stays so)."""
    from phasewatch.callbacks.probes import measure

    switches = []

    class Counted(torch.nn.Linear):
        def __setattr__(self, name, value):
            if name == "training":
                switches.append(value)
            super().__setattr__(name, value)

    class Probe:
        initial = False

        def __init__(self, name):
            self.name, self.modes = name, []

        def __call__(self, model, task, **options):
            self.modes.append([m.training for m in model.modules()])
            return {f"{self.name}/x": 1.0}

    model = torch.nn.Sequential(Counted(2, 2), torch.nn.Linear(2, 2))
    model[1].eval()
    switches.clear()
    given, own = Probe("given"), Probe("own")
    out = measure(model, None, [given], {}, given=lambda name, options: {"given/x": 2.0})
    assert out == {"given": {"given/x": 2.0}} and switches == [] and model.training and given.modes == []
    out = measure(model, None, [given, own], {}, given=lambda name, options: {"given/x": 2.0} if name == "given" else None)
    assert out == {"given": {"given/x": 2.0}, "own": {"own/x": 1.0}} and own.modes == [[False, False, False]]
    assert [m.training for m in model.modules()] == [True, True, False] and switches == [False, True]


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_the_heads_weight_scores_vmapped_over_members_are_each_members_own_bit_for_bit(n_layers):
    """The scores read from the weights (copying, token_k, position_q), vmapped over stacked
    members as `heads_stacked` computes them, equal each member's own computation exactly (not
    to a tolerance: a population's values stay those of its members measured one by one), in
    stacks of 3, 2 and 1 (doubled, as `_one_as_two`) and without W_pos (position_q all 0); and
    `heads_stacked` hands each member those same numbers."""
    from torch.func import vmap

    from phasewatch.probes.heads import _Weights, weight_scores

    task, models = _induction_members(n_layers=n_layers)
    own = [weight_scores(_Weights(model)) for model in models]
    assert not torch.equal(own[0]["copying"], own[1]["copying"])  # the members differ
    weights = [_Weights(model).tensors() for model in models]
    for drop in ((), ("W_pos",)):
        for members in ([0, 1, 2], [1, 2], [2, 2]):
            stacked_weights = {name: torch.stack([weights[k][name] for k in members])
                               for name in weights[0] if name not in drop}
            together = vmap(lambda w: weight_scores(_Weights(tensors=w)))(stacked_weights)
            for i, k in enumerate(members):
                alone = own[k] if not drop else weight_scores(_Weights(tensors={
                    name: w for name, w in weights[k].items() if name not in drop}))
                for kind in ("copying", "token_k", "position_q"):
                    assert torch.equal(together[kind][i], alone[kind]), (kind, members, drop)
                if drop:
                    assert not alone["position_q"].any()
    if n_layers == 1:
        assert not own[0]["token_k"].any() and not own[0]["position_q"].any()
    template, params = _stacked(models)
    for values, alone in zip(stacked.heads_stacked(template, params, models, task), own):
        for kind in ("copying", "token_k", "position_q"):
            assert torch.equal(values[kind], alone[kind]), kind


def test_the_copy_losses_read_from_the_logits_are_those_of_the_log_softmax_over_every_position():
    """`forward_scores` slices the logits before converting them to float64: the copy losses
    are bit for bit those of the log-softmax over the whole float64 logits, then sliced."""
    import torch.nn.functional as F

    from phasewatch.probes.heads import forward_scores, head_tokens

    tokens, rep_len = head_tokens(12, 11, 12, batch=16)
    torch.manual_seed(0)
    logits = torch.randn(16, tokens.shape[1], 13) * 4
    patterns = [torch.softmax(torch.randn(16, 2, tokens.shape[1], tokens.shape[1]), -1)]
    got = forward_scores(logits, patterns, tokens, rep_len)
    nll = -F.log_softmax(logits.double(), dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    assert torch.equal(got["first"], nll[:, 1:rep_len].mean())
    assert torch.equal(got["second"], nll[:, rep_len + 1:2 * rep_len].mean())


@pytest.mark.parametrize("normalization", ["none", "LN"])
def test_the_members_weights_read_once_over_stacked_parameters_are_each_members_own(normalization):
    """`stacked_reads` reads the weight matrices of every member through one model with each
    member's parameters: bit for bit what each member's own model shows (`_Weights`), for
    stacks of 3 and 1, and member by member (the same) where the parameters are not given.
    The composition probe's `head_weights` reads a LayerNorm scale through an accessor that
    does not see the swapped parameters (it shows the first member's): the check on a member
    whose every parameter differs from the first's finds it, and each member is read alone,
    also where the last member is the first one's twin (members 0, 1, 0)."""
    from phasewatch.probes.composition import head_weights
    from phasewatch.probes.heads import _Weights

    task, models = _induction_members(normalization)
    if normalization == "LN":  # a LayerNorm scale of each member's own, folded into its weights
        with torch.no_grad():
            for model in models:
                model.blocks[0].ln1.w.mul_(torch.rand_like(model.blocks[0].ln1.w) + 0.5)
    template, params = _stacked(models)
    for read in (lambda model: _Weights(model).tensors(), head_weights):
        own = [read(model) for model in models]
        assert not torch.equal(own[0]["W_Q"], own[1]["W_Q"])
        for members in ([0, 1, 2], [0, 1, 0], [1]):  # [0, 1, 0]: the last member is the first's twin
            for given in ({name: p[members] for name, p in params.items()}, {}):
                together = stacked.stacked_reads([models[k] for k in members], given, read)
                assert set(together) == set(own[0])
                for i, k in enumerate(members):
                    for name, w in own[k].items():
                        assert torch.equal(together[name][i], w), (name, members, bool(given))


def test_the_members_read_alone_cover_every_parameter_any_member_has_of_its_own():
    """`_witnesses`: the members whose reads alone show whether a read sees each member's
    parameters, together differing from the first member wherever any member does."""
    first_only = torch.zeros(4, 3)
    first_only[3, 1] = 1.0  # member 3 differs here
    scalar = torch.zeros(4)
    scalar[1] = 2.0  # member 1 differs here (a stack of scalars)
    same = torch.ones(4, 2)  # no member differs: nothing to learn from it
    assert stacked._witnesses([first_only, scalar, same]) == [3, 1]
    assert stacked._witnesses([same]) == []
    assert stacked._witnesses([torch.arange(12.0).reshape(4, 3), scalar]) == [3, 1]
    everywhere = torch.arange(8.0).reshape(4, 2)
    assert stacked._witnesses([everywhere, everywhere + 1]) == [3]  # the last member covers all

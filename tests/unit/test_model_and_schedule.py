"""The model factory (TransformerLens 4 bridges) and the checkpoint schedule."""

import pytest
import torch

from phasewatch.callbacks.schedule import Schedule
from phasewatch.models import ModelConfig, build_model, fresh_like, native_module
from phasewatch.tasks import make_task
from phasewatch.errors import ConfigError


def test_task_defaults_fill_unset_fields_and_explicit_values_win():
    task = make_task("modular_addition", p=23)
    cfg = ModelConfig().resolve(task)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_mlp) == (1, 128, 4, 32, 512)
    assert cfg.normalization == "none" and cfg.attn_bias is False and cfg.n_ctx == 3
    cfg = ModelConfig(d_model=64, n_heads=2).resolve(task)
    assert (cfg.d_model, cfg.n_heads, cfg.d_head) == (64, 2, 32)  # task's d_head 32 kept


def test_bridge_has_hooks_weight_views_and_frozen_zero_attention_biases():
    task = make_task("modular_addition", p=23)
    model = build_model(ModelConfig(d_model=32, n_heads=2, d_head=16, d_mlp=64), task)
    assert model.W_Q.shape == (1, 2, 32, 16) and model.W_E.shape == (24, 32) and model.W_U.shape == (32, 24)
    logits, cache = model.run_with_cache(task.train_set().tokens[:5])
    assert logits.shape == (5, 3, 24)
    assert cache["blocks.0.attn.hook_pattern"].shape == (5, 2, 3, 3)
    attn = model.original_model.layers[0].attn
    for proj in (attn.q, attn.k, attn.v, attn.o):
        assert not proj.bias.requires_grad and torch.count_nonzero(proj.bias) == 0
    # causal: no attention to later positions
    assert torch.all(cache["blocks.0.attn.hook_pattern"][:, :, 0, 1:] == 0)


def test_native_module_unwraps_a_bridge_and_passes_other_modules_through():
    task = make_task("modular_addition", p=23)
    model = build_model(ModelConfig(d_model=32, n_heads=2, d_head=16, d_mlp=64), task)
    tokens = task.train_set().tokens[:5]
    native = native_module(model)
    assert native is model.original_model and torch.equal(native(tokens), model(tokens))
    plain = torch.nn.Linear(2, 2)
    assert native_module(plain) is plain


def test_fresh_like_is_seeded_by_its_argument_and_leaves_the_global_rng_alone():
    task = make_task("modular_addition", p=23)
    model = build_model(ModelConfig(d_model=32, n_heads=2, d_head=16, d_mlp=64, seed=0), task)
    state = torch.random.get_rng_state()
    a, b, c = fresh_like(model, 7), fresh_like(model, 7), fresh_like(model, 8)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model.cfg.seed == 0  # the model's own config is untouched
    assert torch.equal(a.W_E, b.W_E) and not torch.equal(a.W_E, c.W_E) and not torch.equal(a.W_E, model.W_E)


def test_rasp_reverse_gets_a_bidirectional_model_with_its_own_output_vocabulary():
    task = make_task("rasp", program="reverse", vocab=[1, 2, 3], max_seq_len=5)
    model = build_model(ModelConfig(d_model=32, n_heads=2), task)
    tokens = task.val_batches()[-1].tokens  # the held-out fifth of the 3^5 inputs of length 5
    out = model(tokens)
    assert tokens.shape == (49, 6) and out.shape == (49, 6, 3)  # output classes = the three values
    pattern = model.run_with_cache(task.val_batches()[-1].tokens[:2])[1]["blocks.0.attn.hook_pattern"]
    assert torch.all(pattern[:, :, 0, 1:] > 0)  # BOS position sees later positions


@pytest.mark.parametrize("cfg,field", [
    (ModelConfig(n_ctx=2), "model.arch.n_ctx"),
    (ModelConfig(d_head=0), "model.arch.d_head"),
    (ModelConfig(act_fn="tanh"), "model.arch.act_fn"),
    (ModelConfig(normalization="BN"), "model.arch.normalization"),
    (ModelConfig(n_layers=0), "model.arch.n_layers"),
])
def test_bad_architecture_names_the_field(cfg, field):
    with pytest.raises(ConfigError) as err:
        cfg.resolve(make_task("modular_addition", p=23))
    assert err.value.field == field


def test_causal_model_for_a_non_causal_program_is_refused():
    with pytest.raises(ConfigError, match="bidirectional"):
        ModelConfig(attention="causal").resolve(make_task("rasp", program="reverse"))


def test_schedules():
    log = Schedule(kind="log", count=10).resolve(1000)
    assert log[0] == 0 and log[-1] == 1000 and log == sorted(set(log))
    gaps = [b - a for a, b in zip(log[1:], log[2:])]
    assert gaps[-1] > gaps[0]  # dense early, sparse late
    assert Schedule(kind="linear", every=300).resolve(1000) == [0, 300, 600, 900, 1000]
    assert Schedule(kind="list", steps=[5, 50, 5000]).resolve(1000) == [0, 5, 50]
    with pytest.raises(ConfigError, match="checkpoints.schedule.every"):
        Schedule(kind="linear").validate()
    with pytest.raises(ConfigError, match="max_steps"):
        Schedule().resolve(-1)


def test_the_probe_budget_admits_an_extra_run_only_while_the_probes_stay_within_their_share(monkeypatch):
    """ProbeClock on a hand-set clock: a probe's first run is setup; an extra run is allowed
    while the probe seconds so far plus its last cost stay within budget x the other seconds."""
    import phasewatch.callbacks.probes as probes

    now = [100.0]
    monkeypatch.setattr(probes.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(probes.ProbeClock, "_probe_seconds", 0.0)
    monkeypatch.setattr(probes.ProbeClock, "_setup_seconds", 0.0)
    clock = probes.ProbeClock()
    assert clock.allows("a", 0.1)  # not started: nothing to compare with
    clock.start()
    clock.record("a", 1.0)  # the first run: setup, counted in neither
    assert clock.allows("a", 0.1) and clock.spent() == (0.0, 0.0)  # its cost is not known yet
    clock.record("a", 0.5)
    now[0] = 110.0  # 10 s: 1 s setup, 0.5 s probe, 8.5 s the rest
    assert clock.spent() == (0.5, 8.5)
    assert not clock.allows("a", 0.1)  # 0.5 + 0.5 > 0.85
    assert clock.allows("a", 0.2) and clock.allows("a", None) and clock.allows("b", 0.1)
    now[0] = 120.0
    assert clock.allows("a", 0.1)  # 1.0 <= 1.85
    assert clock.refused == {"a": 1} and clock.share() == pytest.approx(0.5 / 18.5)
    assert clock.extra == 6  # the allowed ones above, the unbudgeted and unstarted ones included
    # a second clock of the process (a population's next member) sees the first's probe time
    other = probes.ProbeClock()
    other.start()
    clock.record("a", 2.0)
    now[0] = 124.0  # 4 s since the second clock started, 2 of them in a probe of the first
    assert other.spent() == (2.0, 2.0)


@pytest.mark.parametrize("budget", [-0.1, "much"])
def test_a_bad_probe_budget_names_the_field(budget):
    from phasewatch.callbacks.probes import ProbeRunner

    with pytest.raises(ConfigError, match="probes.budget"):
        ProbeRunner(budget=budget)

"""Population training's pieces with known answers: one AdamW over stacked parameters is N
independent AdamWs, the vectorised step gives each member its own loss and gradient, and
the seeds and member configs are what the docs say."""

import copy

import pytest
import torch

from phasewatch.models import ModelConfig, native_module
from phasewatch.tasks.base import masked_loss
from phasewatch.errors import ConfigError
from phasewatch.tasks.induction import Induction
from phasewatch.training.module import TrainModule
from phasewatch.training.population import PopulationModule, member_config, parse_seeds


@pytest.mark.parametrize("spec, seeds", [(3, [0, 1, 2]), ("4", [0, 1, 2, 3]), ("0-3", [0, 1, 2, 3]),
                                         ("1,4,9", [1, 4, 9]), ("0-2, 8", [0, 1, 2, 8]), ([5, 2], [5, 2])])
def test_seeds_are_read_as_counts_ranges_and_lists(spec, seeds):
    assert parse_seeds(spec) == seeds


@pytest.mark.parametrize("spec, problem", [(0, "at least one"), ("3-1", "backwards"), ("1,1", "twice"),
                                           ("a-b", "not a seed"), ("", "not seeds"), (True, "not seeds")])
def test_bad_seeds_are_refused_with_the_problem_named(spec, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_seeds(spec)


def test_a_members_config_changes_only_its_seeds_and_folder(tmp_path):
    config = {"seed_everything": 0, "data": {"task": {"class_path": "X", "init_args": {"seed": 0, "p": 7}}},
              "run_dir": "runs/pop", "checkpoints": {"dirpath": "runs/pop/checkpoints", "last_every": 5},
              "population": {"seeds": "0-3", "vary_data": None}, "ckpt_path": None, "model": {"lr": 0.1}}
    own = member_config(config, 3, True, tmp_path / "m02")
    assert own == {"seed_everything": 3, "data": {"task": {"class_path": "X", "init_args": {"seed": 3, "p": 7}}},
                   "run_dir": str(tmp_path / "m02"),
                   "checkpoints": {"dirpath": str(tmp_path / "m02" / "checkpoints"), "last_every": 5},
                   "model": {"lr": 0.1, "vectorised": "own"}}
    shared = member_config(config, 3, False, tmp_path)
    assert shared["data"]["task"]["init_args"]["seed"] == 0 and shared["model"]["vectorised"] == "shared"
    assert config["seed_everything"] == 0 and "population" in config  # the population's config is left as it was


def test_one_adamw_over_stacked_parameters_is_independent_adamws():
    """AdamW is elementwise (Loshchilov & Hutter 2019, Algorithm 2): its update of one entry
    reads only that entry's gradient and moments. Stacking members along a new dimension
    therefore gives exactly the members' own updates, step for step."""
    gen = torch.Generator().manual_seed(0)
    members = [torch.randn(5, 3, generator=gen) for _ in range(4)]
    grads = [[torch.randn(5, 3, generator=gen) * (k + 1) for k in range(4)] for _ in range(6)]
    alone = [torch.nn.Parameter(m.clone()) for m in members]
    opts = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.5, betas=(0.9, 0.98)) for p in alone]
    stacked = torch.nn.Parameter(torch.stack(members))
    opt = torch.optim.AdamW([stacked], lr=1e-2, weight_decay=0.5, betas=(0.9, 0.98))
    for step in grads:
        for p, o, g in zip(alone, opts, step):
            p.grad = g.clone()
            o.step()
        stacked.grad = torch.stack(step)
        opt.step()
    for k, p in enumerate(alone):
        torch.testing.assert_close(stacked.data[k], p.data, rtol=0, atol=1e-7)
        torch.testing.assert_close(opt.state[stacked]["exp_avg_sq"][k], opts[k].state[p]["exp_avg_sq"], rtol=0, atol=0)
    assert not torch.equal(stacked.data[0], stacked.data[1])


def _members(task, n, **arch):
    out = []
    arch = {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_head": 8, "attn_only": True, **arch}
    for seed in range(n):
        torch.manual_seed(seed)
        out.append(TrainModule(task, ModelConfig(**arch), lr=1e-2, weight_decay=0.1, warmup_steps=0))
    return out


def _each_members_own(out, population, modules, batches):
    """Member k's loss in `out` and its slice of the stack's gradient (after the backward pass)
    equal those of `modules[k]` (a copy of its model) on `batches[k]`, to float rounding."""
    for k, (module, batch) in enumerate(zip(modules, batches)):
        loss = masked_loss(module(batch.tokens), batch, torch.float32)
        loss.backward()
        torch.testing.assert_close(out["loss"][k], loss.detach(), rtol=1e-6, atol=1e-6)
        for name, param in module.named_parameters():
            if param.requires_grad:
                torch.testing.assert_close(population.stacked[name.replace(".", "__")].grad[k], param.grad,
                                           rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False])
def test_the_vectorised_step_gives_each_member_its_own_loss_and_gradient(shared):
    """The population's loss is the sum of the members' own mean losses, so member k's slice
    of the stack's gradient is member k's gradient alone, with every member on its own data
    (shared False) or on the same batch."""
    tasks = [Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=s) for s in range(3)]
    members = _members(tasks[0], 3)
    alone = [copy.deepcopy(native_module(m.model)) for m in members]
    population = PopulationModule(members, vary_data=not shared)
    batches = [t.train_batch(0, None) for t in (tasks[:1] * 3 if shared else tasks)]
    from phasewatch.training.population import stack_batches

    out = population._member_outputs(batches[0] if shared else stack_batches(batches))
    out["loss"].sum().backward()
    _each_members_own(out, population, alone, batches)
    # the members' own models are views into the stack: what the optimizer writes, their probes see
    key = next(iter(population.stacked))
    with torch.no_grad():
        population.stacked[key].add_(1.0)
    name = key.replace("__", ".")
    for k, m in enumerate(members):
        assert torch.equal(dict(native_module(m.model).named_parameters())[name], population.stacked[key][k])


@pytest.mark.parametrize("shared", [True, False])
def test_a_member_alone_with_vectorised_repeats_its_population_step_bit_for_bit(shared):
    """`model.vectorised` (what a member's config.yaml sets): the run alone computes member k's
    loss and gradient as a population of one, with the same bits as member k of three (a stack
    of one alone would differ in the key bias's gradient: `vectorised_outputs`)."""
    tasks = [Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=s) for s in range(3)]
    members = _members(tasks[0], 3)
    with torch.no_grad():  # away from the initial weights (zero biases)
        for k, member in enumerate(members):
            for param in member.parameters():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(k)) * 0.1)
    alone = copy.deepcopy(members[1])
    alone.hparams["vectorised"] = "shared" if shared else "own"
    population = PopulationModule(members, vary_data=not shared)
    batches = [t.train_batch(0, None) for t in (tasks[:1] * 3 if shared else tasks)]
    from phasewatch.training.population import stack_batches

    out = population._member_outputs(batches[0] if shared else stack_batches(batches))
    out["loss"].sum().backward()
    own = alone._as_population_of_one(batches[1], counts=True)
    own["loss"].sum().backward()
    for key in ("loss", "loss_sum", "tokens", "correct", "seq_ok"):
        assert torch.equal(out[key][1], own[key][0]), key
    for name, param in native_module(alone.model).named_parameters():
        if param.grad is not None:
            assert torch.equal(population.stacked[name.replace(".", "__")].grad[1], param.grad), name


def _lengths_differ(tasks) -> int:
    """A step at which the tasks' training batches have three lengths, one of them the longest
    (`task.n_ctx`, not padded), the second task's shorter (padded)."""
    for step in range(100):
        lengths = [t.train_batch(step, None).tokens.shape[-1] for t in tasks]
        if len(set(lengths)) == 3 and tasks[0].n_ctx in lengths and lengths[1] < tasks[0].n_ctx:
            return step
    raise AssertionError("no such step")


@pytest.mark.parametrize("shared", [True, False])
def test_a_rasp_populations_lengths_are_one_pass_and_a_member_alone_repeats_it_bit_for_bit(shared, monkeypatch):
    """A RASP task draws each step's length per member. The population pads every member's
    batch to the task's longest input (the padding masked out of attention and loss) and runs
    one vectorised pass; member k's loss and gradient equal its own model's on its unpadded
    batch (to float rounding), and a member alone with `vectorised` pads its batch alike, runs
    through the same plain twin of its model (`models.plain`), and repeats them bit for bit."""
    from types import SimpleNamespace

    from phasewatch.tasks.rasp import RaspTask

    tasks = [RaspTask(program="reverse", vocab=[1, 2, 3], max_seq_len=5, batch_size=4, seed=s) for s in range(3)]
    step = _lengths_differ(tasks)
    members = _members(tasks[0], 3, attn_only=False, d_mlp=32, normalization="LN")  # (reverse's: a bridge rounds otherwise)
    with torch.no_grad():
        for k, member in enumerate(members):
            for param in member.parameters():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(k)) * 0.1)
    plain = [copy.deepcopy(native_module(m.model)) for m in members]
    alone = copy.deepcopy(members[1])
    alone.hparams["vectorised"] = "shared" if shared else "own"
    population = PopulationModule(members, vary_data=not shared)
    batches = [t.train_batch(step, None) for t in (tasks[1:2] * 3 if shared else tasks)]
    passes = []
    counted = PopulationModule._outputs  # a pass: vmap's, or the member dimension's (`stacked_outputs`)
    monkeypatch.setattr(PopulationModule, "_outputs", lambda self, *a: passes.append(a) or counted(self, *a))
    out = population._member_outputs(population._padded(batches[0] if shared else batches))
    assert len(passes) == 1 and passes[0][1].tokens.shape[-1] == tasks[0].n_ctx
    out["loss"].sum().backward()
    _each_members_own(out, population, plain, batches)
    # the run alone's training step (not a logging step), on its own unpadded batch
    alone._trainer = SimpleNamespace(log_every_n_steps=10, global_step=0,
                                     strategy=SimpleNamespace(root_device=torch.device("cpu")))
    loss = alone._vectorised_step(batches[1])
    loss.backward()
    assert torch.equal(out["loss"][1], loss.detach())
    for name, param in native_module(alone.model).named_parameters():
        if param.grad is not None:
            assert torch.equal(population.stacked[name.replace(".", "__")].grad[1], param.grad), name


@pytest.mark.parametrize("vocab,min_len,max_len", [([1, 2, 3], 1, 4), ([1, 2, 3], 4, 4),
                                                   (list(range(1, 11)), 5, 6)])
def test_a_rasp_populations_batches_encoded_a_length_at_a_time_are_each_members_own(vocab, min_len, max_len):
    """The population's RASP batches (`_Lockstep`: each member's own draw, the members of one
    length encoded and padded together, `encoded_members`) are tensor for tensor the members'
    own `train_batch`es padded and stacked as the training step pads them (`padded_members`),
    from a resumed run's step on; with lengths 4 of 4 only, where every member's batch is
    the longest and nothing is padded, too; and where length 6 has too many inputs to list
    (10**6, drawn by rejection, `train_rows` None) beside length 5's listed ones, in one step."""
    from phasewatch.tasks.rasp import RaspTask
    from phasewatch.training.module import TaskDataModule
    from phasewatch.training.population import _Lockstep, member_batches, padded_members

    tasks = [RaspTask(program="reverse", vocab=vocab, max_seq_len=max_len, min_seq_len=min_len, batch_size=3, seed=s,
                      n_val_per_length=8) for s in (0, 5, 2, 9, 4)]
    lockstep, attends, mixed = iter(_Lockstep([TaskDataModule(t) for t in tasks], 3)), set(), 0
    for step in range(3, 33):
        mixed += len({t.train_rows(step, None) is None for t in tasks}) == 2
        together = next(lockstep)
        alone = padded_members(member_batches([t.train_batch(step, None) for t in tasks]), tasks[0].n_ctx)
        assert together.extras.keys() == alone.extras.keys(), step
        for field in ("tokens", "targets", "loss_mask"):
            assert torch.equal(getattr(together, field), getattr(alone, field)), (step, field)
        if "attend" in alone.extras:
            assert torch.equal(together.extras["attend"], alone.extras["attend"]), step
            attends.add(bool(alone.extras["attend"].all(-1).any()))  # a member at the longest length among padded ones
    if max_len == 4:
        assert attends == ({True, False} if min_len == 1 else set())
    else:  # steps with a member of length 6 (rejection-drawn) among padded ones, and steps mixing both draws
        assert True in attends
    assert (mixed > 0) == (max_len == 6)


@pytest.mark.parametrize("shared", [True, False])
def test_validation_in_passes_gives_each_member_its_own_values(shared, monkeypatch):
    """On the CPU a validation pass takes `members_per_pass` members (its residual stream within
    `PASS_FLOATS`): five members in passes of 2, 2 and 1 (a stack of one runs doubled). Member
    k's loss equals its own model's on its own held-out batch to float rounding, its counts
    exactly, and a member alone with `vectorised` repeats its values bit for bit."""
    import phasewatch.training.population as population_module
    from phasewatch.training.population import stack_batches

    tasks = [Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=s) for s in range(5)]
    members = _members(tasks[0], 5)
    plain = [copy.deepcopy(native_module(m.model)) for m in members]
    alone = [copy.deepcopy(m) for m in members]
    population = PopulationModule(members, vary_data=not shared)
    batches = [t.val_batches()[0] for t in (tasks[:1] * 5 if shared else tasks)]
    batch = batches[0] if shared else stack_batches(batches)
    monkeypatch.setattr(population_module, "PASS_FLOATS", 2 * batches[0].tokens.numel() * 16)  # d_model 16: 2 a pass
    assert population.members_per_pass(batch, shared) == 2
    passes = []
    counted = PopulationModule._outputs  # a pass: vmap's, or the member dimension's (`stacked_outputs`)
    monkeypatch.setattr(PopulationModule, "_outputs",
                        lambda self, params, *a: passes.append(next(iter(params.values())).shape[0])
                        or counted(self, params, *a))
    with torch.no_grad():
        out = population._member_outputs(batch, in_passes=True)
        assert passes == [2, 2, 1]
        for k, (model, own) in enumerate(zip(plain, batches)):
            logits = model(own.tokens)
            torch.testing.assert_close(out["loss"][k], masked_loss(logits, own, torch.float32), rtol=1e-6, atol=1e-6)
            right = (logits.argmax(-1) == own.targets) & own.loss_mask
            assert out["tokens"][k] == own.loss_mask.sum() and out["correct"][k] == right.sum()
            assert out["seq_ok"][k] == (right | ~own.loss_mask).all(-1).sum()
            alone[k].hparams["vectorised"] = "shared" if shared else "own"
            again = alone[k]._as_population_of_one(own, counts=True)
            for key in ("loss", "loss_sum", "tokens", "correct", "seq_ok"):
                assert torch.equal(out[key][k], again[key][0]), (k, key)
    monkeypatch.setattr(population_module, "PASS_FLOATS", 2**40)  # a large budget: every member in one pass
    assert population.members_per_pass(batch, shared) >= 5


def test_members_of_other_architectures_are_refused():
    task = Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8)
    torch.manual_seed(0)
    a = TrainModule(task, ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, attn_only=True))
    b = TrainModule(task, ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=8, attn_only=True))
    with pytest.raises(ConfigError, match="architecture"):
        PopulationModule([a, b], vary_data=False)


def _scheduled_callbacks(tmp_path, pending_at: int | None):
    """A member's schedule-driven callbacks over 30 steps: probes at [0, 6, 12], checkpoints at
    [0, 7] and last.ckpt every 5, and a watcher with a 10-point dense grid
    {0, 1, 2, 3, 5, 7, 10, 14, 21, 30}, its onset found at `pending_at` (dense up to 3x it), that
    looks at validations only (`looks` 0: a grid of looks would be due at its steps as well)."""
    from types import SimpleNamespace

    from phasewatch.callbacks.checkpoints import ScheduledCheckpoints
    from phasewatch.callbacks.probes import ProbeRunner
    from phasewatch.callbacks.schedule import Schedule
    from phasewatch.callbacks.transitions import TransitionWatcher
    from phasewatch.tasks.modular_addition import ModularAddition

    runner = ProbeRunner(names=["grokking"], schedule=Schedule(kind="list", steps=[0, 6, 12]))
    saver = ScheduledCheckpoints(dirpath=str(tmp_path), schedule=Schedule(kind="list", steps=[0, 7]), last_every=5)
    watcher = TransitionWatcher(dense_count=10, looks=0)
    trainer = SimpleNamespace(max_steps=30, callbacks=[runner, watcher, saver], global_step=0, received_sigterm=False)
    runner.setup(trainer, SimpleNamespace(task=ModularAddition(p=7)), "fit")
    saver.setup(trainer, None, "fit")
    watcher.setup(trainer, None, "fit")
    if pending_at is not None:
        watcher.pending = [{"metric": "val/loss", "detected_at": pending_at}]
    return trainer, runner, saver, watcher


def test_a_callback_is_due_at_the_steps_where_it_acts(tmp_path, monkeypatch):
    """`due_at` (what a population asks once per step) holds at the steps of the schedules
    and of the dense grid while an onset is pending, and wherever the callback acts."""
    trainer, runner, saver, watcher = _scheduled_callbacks(tmp_path, pending_at=5)
    saved = []
    monkeypatch.setattr(saver, "_save", lambda trainer, name, *args, **kwargs: saved.append(trainer.global_step))
    probed, due_probes, due_saves = [], [], []
    for step in range(31):
        trainer.global_step = step
        dense = watcher.dense_now(step)
        probed += [step] if runner._scheduled(trainer) else []
        saver._save_due(trainer)
        due_probes += [step] if runner.due_at(step, dense) else []
        due_saves += [step] if saver.due_at(step, dense) else []
    dense_steps = [0, 1, 2, 3, 5, 7, 10, 14]  # the grid up to 3 x 5
    assert due_probes == sorted({0, 6, 12} | set(dense_steps))
    assert due_saves == sorted({0, 5, 7, 10, 15, 20, 25, 30} | set(dense_steps))
    assert set(probed) <= set(due_probes) and set(saved) <= set(due_saves)
    assert set(probed) == {0, 6, 12} | set(dense_steps)  # (the known answer of the runner itself)
    # a cheap probe of `every_validation` runs at validations (their own hook) and step 0, not on the schedule
    from types import SimpleNamespace

    from phasewatch.callbacks.probes import ProbeRunner

    from phasewatch.tasks.modular_addition import ModularAddition

    cheap = ProbeRunner(names=["composition"], schedule=runner.schedule)
    cheap.setup(trainer, SimpleNamespace(task=ModularAddition(p=7)), "fit")
    ran = []
    for step in range(31):
        trainer.global_step = step
        ran += [step] if cheap._scheduled(trainer) else []
    assert [s for s in range(31) if cheap.due_at(s)] == [0]
    assert [s for s in range(31) if cheap.due_at(s, watcher.dense_now(s))] == ran == sorted({0} | set(dense_steps))


def test_the_population_runs_member_callbacks_only_at_steps_where_one_is_due(tmp_path):
    """At a step hook, every member's callbacks run where member 0's schedules are due (and on
    SIGTERM); elsewhere only those of members whose watcher asks for the step (an onset
    pending, the step on its dense grid); none on the other steps. Other hooks: every member."""
    from phasewatch.training.population import MEMBER_HOOKS, MemberCallbacks, overrides

    members = [_scheduled_callbacks(tmp_path / str(k), pending) for k, pending in enumerate([None, None, 5])]
    callbacks = [[runner, watcher, saver] for _, runner, saver, watcher in members]
    population = MemberCallbacks(callbacks, [[] for _ in members], ["m0", "m1", "m2"], tmp_path / "last.ckpt")
    population.hooked = {hook: [(k, None, [cb for cb in cbs if overrides(cb, hook)]) for k, cbs in enumerate(callbacks)]
                         for hook in MEMBER_HOOKS}

    def acting(hook, step, sigterm=False):
        return [k for k, _, _ in population.acting(hook, step, sigterm)]

    assert acting("on_train_batch_start", 6) == [0, 1, 2]  # the probes' schedule
    assert acting("on_train_batch_end", 6) == []  # not the checkpoints'
    assert acting("on_train_batch_end", 5) == [0, 1, 2]  # last.ckpt's
    assert acting("on_train_batch_start", 4) == acting("on_train_batch_end", 4) == []
    assert acting("on_train_batch_start", 3) == acting("on_train_batch_end", 3) == [2]  # member 2's dense grid
    assert acting("on_train_batch_start", 21) == []  # past 3 x the onset
    assert acting("on_train_batch_start", 4, sigterm=True) == [0, 1, 2]
    assert acting("on_validation_end", 4) == acting("on_train_end", 4) == [0, 1, 2]


@pytest.mark.parametrize("arch", [dict(), dict(attn_only=False, normalization="LN", act_fn="gelu", d_mlp=24),
                                  dict(attn_bias=False), dict(n_layers=1, attention="bidirectional")])
def test_models_built_under_one_build_are_the_models_built_alone(arch):
    """`one_build` (a population's members: the bridge constructed once, then copied): the
    model of seed k is the one a build alone after `seed_everything(k)` gives, bit for bit, and
    the global RNG is left where that build leaves it; every copy is a bridge of its own
    (hooks named as a bridge's, its weights in its own storage) and computes what the model
    built alone computes."""
    from lightning.pytorch import seed_everything

    from phasewatch.models import build_model
    from phasewatch.models.factory import one_build

    task = Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=0)
    cfg = ModelConfig(**{"n_layers": 2, "d_model": 16, "n_heads": 2, "d_head": 8, "attn_only": True,
                         "attention": "causal", **arch})
    alone, states = [], []
    for seed in (3, 5, 7):
        seed_everything(seed, verbose=False)
        alone.append(build_model(cfg, task))
        states.append(torch.get_rng_state())
    built = []
    with one_build():
        for seed, state in zip((3, 5, 7), states):
            seed_everything(seed, verbose=False)
            built.append(build_model(cfg, task))
            assert torch.equal(torch.get_rng_state(), state)
    tokens = task.train_batch(0, None).tokens
    storages = set()
    for own, ref in zip(built, alone):
        assert type(own) is type(ref)
        mine, theirs = own.state_dict(), ref.state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert [(n, p.requires_grad) for n, p in own.named_parameters()] == \
            [(n, p.requires_grad) for n, p in ref.named_parameters()]
        storages |= {p.untyped_storage().data_ptr() for p in own.parameters()}
        logits, cache = own.run_with_cache(tokens)
        ref_logits, ref_cache = ref.run_with_cache(tokens)
        assert torch.equal(logits, ref_logits)
        assert list(cache.keys()) == list(ref_cache.keys()) and all(torch.equal(cache[k], ref_cache[k]) for k in cache)
        assert torch.equal(own.W_Q, ref.W_Q)
    assert len(storages) == len(built) * len(list(built[0].parameters()))  # no member shares a weight's storage
    assert not torch.equal(built[0].W_E, built[1].W_E)


def test_one_build_builds_alone_where_its_copy_would_differ(monkeypatch):
    """`one_build` checks its copy path on the first build of an architecture: where it would
    not give the model `boot_native` gives (here `_drawn_copy` initialises otherwise than
    `boot_native`: an extra draw), every model of that architecture is built alone, the same
    models bit for bit; and a change of torch's default dtype is another architecture."""
    import transformer_lens.model_bridge.sources.native.init as native_init
    from lightning.pytorch import seed_everything

    from phasewatch.models import build_model
    from phasewatch.models.factory import _BUILT, one_build

    task = Induction(vocab_size=8, seq_len=11, max_len=5, batch_size=6, n_val=8, seed=0)
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, attn_only=True, attention="causal")

    def alone(seed):
        seed_everything(seed, verbose=False)
        return build_model(cfg, task).state_dict()

    expected = [alone(seed) for seed in (3, 5)]
    original = native_init.initialize_native_model

    def drifted(model, config):  # what a later TransformerLens might do that the copy path does not repeat
        torch.rand(1)
        original(model, config)

    monkeypatch.setattr(native_init, "initialize_native_model", drifted)
    with one_build():
        got = []
        for seed in (3, 5):
            seed_everything(seed, verbose=False)
            got.append(build_model(cfg, task).state_dict())
        assert list(_BUILT[-1].values()) == [None]  # the copy path refused
    monkeypatch.undo()
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with one_build():
        seed_everything(3, verbose=False)
        build_model(cfg, task)
        with torch.random.fork_rng():
            torch.set_default_dtype(torch.float64)
            try:
                seed_everything(5, verbose=False)
                wide = build_model(cfg, task)
            finally:
                torch.set_default_dtype(torch.float32)
    assert wide.W_E.dtype == torch.float64


def test_a_members_token_id_outside_the_vocabulary_stops_the_population_on_the_host():
    """A run alone fails on a token id outside its task's vocabulary (the embedding's index
    error); the population's stacked embedding (one table of every member's rows) would read
    another member's row instead, so the members' batches are checked as they are drawn
    (`_Lockstep`, `in_vocabulary`): ids in range pass untouched, one out of range (a task's bug,
    here a subclass drawing id `d_vocab` in the second member's batch at step 4) stops it, named."""
    from phasewatch.training.module import TaskDataModule
    from phasewatch.training.population import _Lockstep

    class Leaky(Induction):
        def train_batches(self, seeds, step, batch_size=None):  # every member's, drawn in one call
            batch = super().train_batches(seeds, step, batch_size)
            if step == 4:
                batch.tokens[1, 0, 1] = self.d_vocab  # the second member's
            return batch

    tasks = [Leaky(vocab_size=10, seq_len=9, max_len=4, batch_size=3, seed=s) for s in (0, 2)]
    lockstep = iter(_Lockstep([TaskDataModule(t) for t in tasks], 1))
    for step in (1, 2, 3):
        drawn = next(lockstep)
        assert int(drawn.tokens.max()) < tasks[0].d_vocab, step
    with pytest.raises(ValueError, match=r"Leaky drew token id 1\d, outside its vocabulary of 1\d ids"):
        next(lockstep)


def test_the_members_build_runs_without_the_cyclic_collector_and_leaves_the_objects_frozen_until_thawed():
    """`out_of_the_collectors_way`: no collection while the members are built, then every object
    of the process frozen (out of the collector's full collections) until `thaw`; a build that
    fails freezes nothing, and a process whose collector is off, or that froze objects itself,
    is left as it is."""
    import gc

    from phasewatch.training.population import out_of_the_collectors_way, thaw

    assert gc.isenabled() and gc.get_freeze_count() == 0
    with out_of_the_collectors_way():
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]  # objects the collector tracks
    assert gc.isenabled() and gc.get_freeze_count() > len(kept)
    thaw()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    thaw()  # (twice: nothing)
    with pytest.raises(RuntimeError):
        with out_of_the_collectors_way():
            raise RuntimeError("a build that fails")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with out_of_the_collectors_way():
            pass
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()
    gc.freeze()  # the process's own
    frozen = gc.get_freeze_count()
    try:
        with out_of_the_collectors_way():
            assert gc.isenabled()
        thaw()
        assert gc.get_freeze_count() == frozen  # not thawed by the population
    finally:
        gc.unfreeze()

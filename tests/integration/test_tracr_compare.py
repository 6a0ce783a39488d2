"""The learned-vs-compiled probes on real compiled programs: the compiled model against
itself, a random model, the necessity of compiled components, and the errors."""

import pytest
import torch

from phasewatch.models import ModelConfig, build_model
from phasewatch.probes.ablation import ablation_probe
from phasewatch.probes.tracr import tracr_probe
from phasewatch.errors import ConfigError
from phasewatch.tasks.rasp import RaspTask


@pytest.fixture(scope="module")
def task():
    return RaspTask(program="reverse", vocab=[1, 2, 3], max_seq_len=5, val_fraction=0.5)  # 181 held-out inputs


def test_the_compiled_model_matches_itself(reverse, task):
    _, bridge, layout, cache = reverse
    with torch.no_grad():
        out = tracr_probe(bridge, task, cache_dir=str(cache))
    assert out["tracr/agreement"] == 1.0
    assert all(out[f"tracr/agreement/len{n}"] == 1.0 for n in range(1, 6))
    # its two non-empty attention layers: L0 (length, uniform) and L3 (the reversal lookup)
    assert {k for k in out if k.startswith("tracr/attn_match/") and not k.endswith("/path")} == {
        "tracr/attn_match/L0H0", "tracr/attn_match/L3H0"}
    assert out["tracr/attn_match/L3H0"] == pytest.approx(1.0) and out["tracr/attn_match/L0H0"] == pytest.approx(1.0)
    assert "L3H0=L3H0" in out["match_heads"]
    cka = out["cka"]
    assert cka.shape == (9, 9) and torch.allclose(cka.diagonal(), torch.ones(9, dtype=cka.dtype), atol=1e-6)
    # each variable becomes decodable exactly where the compiled layout writes it
    assert out["tracr/probe/reverse/resid_mid3"] == 1.0 and out["tracr/probe/reverse/resid_pre3"] < 0.6
    assert out["tracr/probe/opp_idx/resid_pre2"] == 1.0
    assert out["tracr/probe/length/resid_pre1"] == 1.0


def test_a_random_model_agrees_at_chance_and_length_is_decodable_at_initialisation(reverse, task):
    _, _, _, cache = reverse
    model = build_model(ModelConfig(attention="bidirectional", seed=3), task).eval()
    initial = build_model(ModelConfig(attention="bidirectional", seed=4), task).eval()
    with torch.no_grad():
        out = tracr_probe(model, task, cache_dir=str(cache), initial=initial)
        alone = tracr_probe(model, task, cache_dir=str(cache))
    assert abs(out["tracr/agreement"] - 1 / 3) < 0.1  # 3 output values
    assert out["tracr/attn_match/L3H0"] < 0.5
    # docs/reference.md: length is linearly decodable from a randomly initialised model;
    # the baseline (the probe on the initial weights) says so too; without them, no baseline
    assert out["tracr/probe_baseline/length/resid_post1"] > 0.9
    assert out["tracr/probe/length/resid_post1"] > 0.9
    assert out["tracr/probe_baseline/reverse/resid_post1"] < 0.8  # the answer itself is not
    assert set(k.replace("probe_baseline", "probe") for k in out if "probe_baseline" in k) == {
        k for k in out if k.startswith("tracr/probe/")}
    assert not any("probe_baseline" in k for k in alone)


def test_ablation_finds_exactly_the_non_empty_compiled_components(reverse, task):
    _, bridge, layout, _ = reverse
    out = ablation_probe(bridge, task)
    non_empty = {f"L{i}.{part}" for i, layer in enumerate(layout["layers"]) for part in ("attn", "mlp")
                 if not layer[part]["empty"]}
    assert non_empty == {"L0.attn", "L0.mlp", "L1.mlp", "L2.mlp", "L3.attn"}
    necessary = {c for c in out["necessary_components"] if "." in c}
    assert necessary == non_empty
    for component in {f"L{i}.{part}" for i in range(4) for part in ("attn", "mlp")} - non_empty:
        assert out[f"ablation/{component}/acc"] == 1.0 and out[f"ablation/{component}/loss_delta"] == pytest.approx(0, abs=1e-9)
    assert out["ablation/L3.attn/acc"] == pytest.approx(1 / 3, abs=0.06)  # without the lookup: chance


def halve(model, component: str) -> None:
    """Halve a component's output (`L0.attn`, `L1H2`, `L0.mlp`: as an intervention's hook would
    change it) or a residual stream hook's value (`blocks.<l>.hook_resid_pre`: a hook of the
    bridge's own, as a user's would), for the rest of the model's life."""
    from phasewatch.models import register_component_hook

    if component.startswith("blocks."):
        model.add_hook(component, lambda x, hook: 0.5 * x, is_permanent=True)
    else:
        register_component_hook(model, component, lambda out: 0.5 * out)


INTERVENED = ("L0.attn", "L1H2", "L0.mlp")


@pytest.mark.parametrize("arch, intervened", [
    ({}, ()), ({"n_layers": 3, "attn_only": True, "normalization": "none"}, ()), ({}, INTERVENED),
    ({}, ("blocks.1.hook_resid_pre",))])
def test_the_residual_pass_keeps_what_the_bridges_hooks_cache(task, arch, intervened):
    """ResidualPass (the native module with plain PyTorch hooks: the tracr probe's pass and the
    ablation's clean pass) keeps, per layer, the bridge's hook_resid_pre, hook_attn_out (with an
    intervention on the attention layer: what enters the stream, after its hook), hook_resid_mid
    and attn.hook_pattern, and the last block's hook_resid_post, and gives the
    bridge's logits: on every length padded into one batch (an attention mask), on the task's
    model with MLPs and LayerNorm, on a 3-layer attention-only model without normalization, and
    with an intervention's hooks on an attention layer, a head and an MLP, or a hook on a block's
    residual stream in; and the ablation's means of each component's output."""
    from phasewatch.models import native_module
    from phasewatch.probes.ablation import components, position_means
    from phasewatch.probes.residual import ResidualPass
    from phasewatch.tasks.base import mask_kwargs, padded

    model = build_model(ModelConfig(attention="bidirectional", seed=1, **arch), task).eval()
    for component in intervened:
        halve(model, component)
    n = model.cfg.n_layers
    batches = task.val_batches()
    joined, mask = padded(batches)
    names = {f"blocks.{layer}.{name}" for layer in range(n)
             for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "attn.hook_pattern")}
    names.add(f"blocks.{n - 1}.hook_resid_post")
    with torch.no_grad():
        logits, cache = model.run_with_cache(joined.tokens, names_filter=lambda name: name in names,
                                             **mask_kwargs(mask, "cpu"))
        run = ResidualPass(native_module(model), joined.tokens, mask)
    assert mask is not None and torch.equal(run.logits, logits)
    for layer in range(n):
        assert torch.equal(run.pre[layer], cache[f"blocks.{layer}.hook_resid_pre"])
        if intervened == INTERVENED:  # what enters the stream: after the intervention's hook, which hook_attn_out precedes
            entered = cache[f"blocks.{layer}.hook_resid_mid"] - cache[f"blocks.{layer}.hook_resid_pre"]
            assert torch.allclose(run.attn[layer], entered, atol=1e-6)
        else:
            assert torch.equal(run.attn[layer], cache[f"blocks.{layer}.hook_attn_out"])
        assert torch.equal(run.pattern[layer], cache[f"blocks.{layer}.attn.hook_pattern"])
        if not model.cfg.attn_only:
            assert torch.equal(run.site(f"blocks.{layer}.hook_resid_mid"), cache[f"blocks.{layer}.hook_resid_mid"])
    assert torch.equal(run.site(f"blocks.{n - 1}.hook_resid_post"), cache[f"blocks.{n - 1}.hook_resid_post"])
    # the ablation's means of every component's output, from one padded pass, are over every
    # held-out sequence with that position (padding left out), not over one batch
    hooks = {hook for _, hook, _ in components(model)}
    means = position_means(model, batches, hooks)
    with torch.no_grad():
        caches = [model.run_with_cache(b.tokens, names_filter=lambda name: name in hooks)[1] for b in batches]
    for hook in hooks:
        for position in range(max(b.tokens.shape[1] for b in batches)):
            everything = torch.cat([c[hook][:, position] for c in caches if c[hook].shape[1] > position])
            assert torch.allclose(means[hook][position], everything.mean(0), atol=1e-5), (hook, position)


@pytest.mark.parametrize("mode, arch, intervened", [
    ("mean", {}, ()), ("zero", {}, ()),
    ("mean", {"n_layers": 3, "attn_only": True, "normalization": "none"}, ()),
    ("mean", {}, INTERVENED), ("mean", {}, ("blocks.1.hook_resid_pre",))])
def test_batched_ablation_gives_what_one_pass_per_component_gives(task, mode, arch, intervened):
    """ablation_scores runs the clean batch once and, per layer, one ablated copy per component
    from the clean residual stream at that layer on; here each component is ablated in a full
    pass of its own through the bridge, with a hook written for the test (the task's model with
    MLPs and LayerNorm, a 3-layer attention-only one without normalization, and the task's
    model with an intervention's hooks on an attention layer, a head and an MLP, which act in
    the ablation's passes as in any other; or a hook on a block's residual stream in, outside
    every ablated module). A module without a hook does not run again: its copies' outputs come
    from the clean pass; with the intervention both ways are taken."""
    from phasewatch.models import native_module
    from phasewatch.probes.ablation import (ablation_scores, components, hooked, position_means,
                                            proportional_sample, sample_weights)
    from phasewatch.tasks.base import masked_loss_and_acc

    model = build_model(ModelConfig(attention="bidirectional", seed=2, **arch), task).eval()
    for component in intervened:
        halve(model, component)
    layers = native_module(model).layers
    ways = [hooked(module) for block in layers for module in (block.attn, getattr(block, "mlp", None)) if module]
    assert ways == ([True, True, True, False] if intervened == INTERVENED else [False] * len(ways))
    batches = [b for b, g in zip(task.val_batches(), task.val_groups()) if g == "val"]
    comps = components(model)

    def expected_with(means) -> dict[str, tuple[float, float]]:
        """Each component ablated in a full pass of its own over every held-out batch."""
        expected = {}
        with torch.no_grad():
            for label, hook, head in [("clean", None, None), *comps]:
                loss_sum = acc_sum = count = 0.0
                for batch in batches:
                    n_pos = batch.tokens.shape[1]
                    value = (0.0 if mode == "zero" or hook is None else
                             means[hook][:n_pos] if head is None else means[hook][:n_pos, head])

                    def ablate(x, hook=None, value=value, head=head):
                        x = x.clone()
                        if head is None:
                            x[:] = value
                        else:
                            x[:, :, head] = value
                        return x

                    logits = (model(batch.tokens) if hook is None
                              else model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, ablate)]))
                    loss, acc = masked_loss_and_acc(logits, batch, torch.float64)
                    n = int(batch.loss_mask.sum())
                    loss_sum, acc_sum, count = loss_sum + float(loss) * n, acc_sum + float(acc) * n, count + n
                expected[label] = (loss_sum / count, acc_sum / count)
        return expected

    def check(got, expected) -> None:
        assert set(got) == set(expected)
        wrong = {label: (got[label]["loss"], loss) for label, (loss, acc) in expected.items()
                 if got[label]["loss"] != pytest.approx(loss, rel=1e-5) or got[label]["acc"] != pytest.approx(acc)}
        assert not wrong, wrong

    expected = expected_with(position_means(model, batches, {h for _, h, _ in comps}))
    # all held-out inputs (the means' pass is the ablated one's); a row budget that splits the
    # components over several passes
    for max_rows in (16384, 3 * max(len(b) for b in batches)):
        check(ablation_scores(model, task, mode, sample=None, mean_over=None, max_rows=max_rows), expected)
    if mode == "mean":  # means from a sample smaller than the ablated one: a pass of their own
        drawn = proportional_sample(batches, 10)
        means = position_means(model, drawn, {h for _, h, _ in comps}, sample_weights(batches, drawn))
        check(ablation_scores(model, task, mode, sample=None, mean_over=10), expected_with(means))
    # a subsample: fewer inputs, the same components
    sub = ablation_scores(model, task, mode, sample=12, mean_over=None)
    assert set(sub) == set(expected) and sub["clean"]["loss"] != pytest.approx(expected["clean"][0], rel=1e-9)


def test_a_global_forward_hook_makes_every_module_run_again(task):
    """A hook on every module (`register_module_forward_hook`) acts inside the ablated module too,
    so `hooked` says so and the ablation runs the module again."""
    from phasewatch.models import native_module
    from phasewatch.probes.ablation import hooked

    attn = native_module(build_model(ModelConfig(attention="bidirectional", seed=2), task)).layers[0].attn
    assert not hooked(attn)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert hooked(attn)
    finally:
        handle.remove()
    assert not hooked(attn)


def test_a_sample_weighs_each_length_as_the_whole_held_out_set_does(task):
    """A sample of a sixth of the held-out set, every length in proportion and at least one
    of each: a sampled input stands for as many as its length has per sampled one, so the
    estimate is each length's sum scaled up to its share of the whole set (computed here
    batch by batch, without padding)."""
    from phasewatch.probes.ablation import ablation_scores, nested_sample, proportional_sample
    from phasewatch.tasks.base import masked_loss_and_acc

    model = build_model(ModelConfig(attention="bidirectional", seed=6), task).eval()
    batches = [b for b, g in zip(task.val_batches(), task.val_groups()) if g == "val"]
    total = sum(len(b) for b in batches)
    drawn = proportional_sample(batches, total // 6)
    weights = [len(b) / len(d) for b, d in zip(batches, drawn)]
    assert len(set(weights)) > 1  # rounding (at least one of each length) makes them unequal
    loss_sum = acc_sum = count = 0.0
    with torch.no_grad():
        for d, w in zip(drawn, weights):
            loss, acc = masked_loss_and_acc(model(d.tokens), d, torch.float64)
            n = int(d.loss_mask.sum())
            loss_sum, acc_sum, count = loss_sum + w * float(loss) * n, acc_sum + w * float(acc) * n, count + w * n
        got = ablation_scores(model, task, "zero", sample=total // 6, mean_over=None)["clean"]
        whole = ablation_scores(model, task, "zero", sample=None, mean_over=None)["clean"]
    assert got["loss"] == pytest.approx(loss_sum / count, rel=1e-6) and got["acc"] == pytest.approx(acc_sum / count)
    # the unweighted mean of the sample would overweight the short lengths; the estimate is near the whole set's
    assert abs(got["loss"] - whole["loss"]) < 0.1 * whole["loss"]
    # mean ablation draws the ablated sample from the means' (one pass serves both): as many of
    # each length, spread over the means' sample, and its clean numbers are those sequences'
    means_drawn = proportional_sample(batches, total // 2)
    nested = [d.take(i) for d, i in zip(means_drawn, nested_sample(batches, means_drawn, total // 6))]
    assert [len(n) for n in nested] == [len(d) for d in drawn] and nested_sample(batches, drawn, total // 2) is None
    with torch.no_grad():
        direct = [masked_loss_and_acc(model(n.tokens), n, torch.float64) for n in nested]
        got = ablation_scores(model, task, "mean", sample=total // 6, mean_over=total // 2)["clean"]
    counts = [w * int(n.loss_mask.sum()) for n, w in zip(nested, weights)]
    assert got["loss"] == pytest.approx(sum(float(l) * c for (l, _), c in zip(direct, counts)) / sum(counts), rel=1e-6)
    assert got["acc"] == pytest.approx(sum(float(a) * c for (_, a), c in zip(direct, counts)) / sum(counts))
    assert any(not torch.equal(n.tokens, d.tokens) for n, d in zip(nested, drawn))  # other sequences than `drawn`


def test_ablation_means_from_a_proportional_sample(task):
    """Each length keeps its share of the held-out set, so the sample's per-position mean
    estimates the whole set's."""
    from phasewatch.probes.ablation import position_means, proportional_sample

    batches = [b for b, g in zip(task.val_batches(), task.val_groups()) if g == "val"]
    total = sum(len(b) for b in batches)
    sample = proportional_sample(batches, total // 2)
    sizes = [len(b) for b in sample]
    assert all(abs(n - len(b) / 2) <= 1 for n, b in zip(sizes, batches)) and abs(sum(sizes) - total // 2) <= len(batches)
    assert proportional_sample(batches, None) is batches and proportional_sample(batches, total) is batches
    model = build_model(ModelConfig(attention="bidirectional", seed=5), task).eval()
    hook = "blocks.0.hook_attn_out"
    with torch.no_grad():
        full, half = position_means(model, batches, {hook})[hook], position_means(model, sample, {hook})[hook]
    assert torch.allclose(full, half, atol=0.1 * float(full.abs().max()))


def test_a_causal_model_cannot_be_compared_with_a_non_causal_program(reverse, task):
    model = build_model(ModelConfig(attention="bidirectional"), task)
    model.cfg.attention_dir = "causal"  # a model built elsewhere, causal
    with pytest.raises(ConfigError, match="bidirectional"):
        tracr_probe(model, task, cache_dir=str(reverse[3]))


def test_comparison_during_training_fills_the_run_folder_and_report(tmp_path):
    from phasewatch.report.html import _arrays
    from phasewatch.rundir import RunFolder
    from phasewatch.cli.main import main
    from phasewatch.rundir import read_jsonl

    run = tmp_path / "run"
    assert main(["fit", "--config", "configs/reverse.yaml", "--data.task.vocab", "[1, 2, 3]",
                 "--data.task.max_seq_len", "5", "--data.task.train_max_seq_len", "4",
                 "--trainer.max_steps", "30", "--trainer.val_check_interval", "10",
                 "--probes.schedule", '{"kind": "list", "steps": [0, 15, 30]}',
                 "--checkpoints.schedule", '{"kind": "list", "steps": [0, 30]}', "--run_dir", str(run), "--no_wandb",
                 "--trainer.enable_progress_bar", "false"]) == 0
    records = list(read_jsonl(run / "metrics.jsonl"))
    measured = [r for r in records if "tracr/agreement" in r]
    assert [r["step"] for r in measured] == [0, 15, 30]
    assert all(any(k.startswith("ablation/L1H") for k in r) for r in measured)
    # the held-out lengths 1-4 and the longer, never trained, length 5 are validated apart
    validated = [r for r in records if "val/acc" in r]
    assert validated and all("val_longer/acc" in r and "val_longer/loss" in r for r in validated)
    assert all("tracr/agreement/len5" in r for r in measured)
    # the baseline is the probe on the run's own step-0 weights, the same at every step
    baselines = {k.replace("probe_baseline", "probe"): v for k, v in measured[0].items() if "probe_baseline" in k}
    assert baselines and all(r[k.replace("probe", "probe_baseline", 1)] == v for r in measured
                             for k, v in baselines.items())
    assert all(measured[0][k] == pytest.approx(v, abs=1e-9) for k, v in baselines.items())
    # ... also after a resume, which rebuilds the step-0 weights from the checkpoint
    assert main(["fit", "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps", "40",
                 "--probes.schedule", '{"kind": "list", "steps": [0, 15, 30, 40]}', "--no_wandb"]) == 0
    (resumed,) = [r for r in read_jsonl(run / "metrics.jsonl") if r["step"] == 40 and "tracr/agreement" in r]
    assert {k: resumed[k.replace("probe", "probe_baseline", 1)] for k in baselines} == baselines
    # ... and in analyze, which reads the step-0 checkpoint
    assert main(["analyze", str(run), "--probes", "tracr", "--replace", "--no_wandb"]) == 0
    analysed = [r for r in read_jsonl(run / "metrics.jsonl") if "tracr/agreement" in r]
    assert {r["step"] for r in analysed} == {0, 30}  # its step checkpoints
    assert all({k: r[k.replace("probe", "probe_baseline", 1)] for k in baselines} == baselines for r in analysed)
    arrays = _arrays(RunFolder(run))  # as analyze left them: measured again at the step checkpoints
    cka = arrays["tracr/cka"]
    assert cka["steps"] == [0, 30] and len(cka["data"][0]) == 5 and len(cka["data"][0][0]) == 9
    assert cka["rows"][0] == "resid_pre0" and cka["cols"][-1] == "compiled resid_post3"
    assert arrays["tracr/attn_match"]["rows"] == ["compiled L0H0", "compiled L3H0"]
    assert main(["plot", str(run)]) == 0  # curves.png and the learned-vs-compiled figure
    assert (run / "figures" / "tracr.png").stat().st_size > 20_000

"""Interventions during training do exactly what they say (real Trainer, real model)."""

import json

import pytest
import torch

from phasewatch.models import ModelConfig, build_model, component_parameters, register_component_hook
from phasewatch.tasks import make_task
from phasewatch.errors import ConfigError
from phasewatch.cli.main import main
from phasewatch.callbacks.interventions import Interventions
from phasewatch.cli.analyze import load_run_module

BASE = ["--data.task.p", "23", "--model.arch.d_model", "32", "--model.arch.n_heads", "2", "--model.arch.d_head", "16",
        "--model.arch.d_mlp", "64", "--trainer.val_check_interval", "5", "--probes.names", "[]", "--no_wandb",
        "--trainer.enable_progress_bar", "false", "--model.warmup_steps", "0"]


def fit(run, steps, items, *extra):
    return main(["fit", *BASE, "--trainer.max_steps", str(steps), "--run_dir", str(run),
                 "--checkpoints.schedule", json.dumps({"kind": "list", "steps": list(range(0, steps + 1))}),
                 "--interventions.items", json.dumps(items), *extra])


def weights(run, step):
    return torch.load(run / "checkpoints" / f"step={step:07d}.ckpt", weights_only=False)["state_dict"]


def slices(run, state, component):
    module = load_run_module(run)
    module.load_state_dict(state)
    return [p.detach()[index].clone() for p, index in component_parameters(module.model, component)]


def test_a_frozen_head_is_bit_identical_across_its_window_and_trains_outside(tmp_path):
    run = tmp_path / "run"
    assert fit(run, 14, [{"kind": "freeze", "component": "L0H1", "start": 2, "end": 9}]) == 0
    head = {s: slices(run, weights(run, s), "L0H1") for s in (0, 2, 5, 9, 14)}
    other = {s: slices(run, weights(run, s), "L0H0") for s in (2, 9)}
    assert all(torch.equal(a, b) for a, b in zip(head[2], head[9]))  # frozen through steps 2..8
    assert all(torch.equal(a, b) for a, b in zip(head[2], head[5]))
    assert not all(torch.equal(a, b) for a, b in zip(head[0], head[2]))  # trained before
    assert not all(torch.equal(a, b) for a, b in zip(head[9], head[14]))  # and after
    assert not all(torch.equal(a, b) for a, b in zip(other[2], other[9]))  # the other head trains
    assert json.loads((run / "interventions.jsonl").read_text())["component"] == "L0H1"
    from phasewatch.report.html import build_report

    assert '"interventions": [{"kind": "freeze", "component": "L0H1", "start": 2, "end": 9' in build_report(run)


def test_reinit_draws_the_component_from_a_fresh_initialisation(tmp_path):
    run = tmp_path / "run"
    assert fit(run, 8, [{"kind": "reinit", "component": "L0.mlp", "step": 5, "seed": 7}], "--model.lr", "1e-12") == 0
    fresh = build_model(ModelConfig(d_model=32, n_heads=2, d_head=16, d_mlp=64, seed=7), make_task("modular_addition", p=23))
    expected = [p.detach()[i] for p, i in component_parameters(fresh, "L0.mlp")]
    before, after = slices(run, weights(run, 5), "L0.mlp"), slices(run, weights(run, 6), "L0.mlp")
    assert all(torch.allclose(a, e, atol=1e-9) for a, e in zip(after, expected))  # one 1e-12 step after the draw
    # before the draw the weight matrices were the run's own (biases start at zero in both)
    assert not any(torch.allclose(b, e, atol=1e-3) for b, e in zip(before, expected) if b.dim() == 2)


def test_an_ablated_head_outputs_zero_or_its_mean_inside_the_window_only():
    task = make_task("modular_addition", p=23)
    model = build_model(ModelConfig(d_model=32, n_heads=2, d_head=16, d_mlp=64, seed=0), task).eval()
    tokens = task.val_batches()[0].tokens[:64]
    seen = {}
    recorder = model.original_model.layers[0].attn.o.register_forward_pre_hook(
        lambda module, args: seen.__setitem__("z", args[0].detach().clone()))
    with torch.no_grad():
        model(tokens)
        clean = seen["z"]
        for mode in ("zero", "mean"):
            callback = Interventions([{"kind": "ablate", "component": "L0H1", "mode": mode, "start": 10, "end": 20}])
            callback._hooks = [register_component_hook(model, "L0H1", callback._replacer(callback.items[0]))]
            recorder.remove()
            recorder = model.original_model.layers[0].attn.o.register_forward_pre_hook(
                lambda module, args: seen.__setitem__("z", args[0].detach().clone()))
            for step, inside in ((9, False), (10, True), (19, True), (20, False)):
                callback._step = step
                model(tokens)
                z = seen["z"]
                assert torch.equal(z[..., :16], clean[..., :16])  # head 0 untouched
                if not inside:
                    assert torch.equal(z, clean)
                elif mode == "zero":
                    assert torch.count_nonzero(z[..., 16:]) == 0
                else:
                    assert torch.allclose(z[..., 16:], clean[..., 16:].mean(0, keepdim=True).expand_as(z[..., 16:]))
            for handle in callback._hooks:
                handle.remove()
    recorder.remove()


def test_bad_interventions_stop_before_training(tmp_path, capsys):
    for items, expected in (([{"kind": "melt", "component": "L0H0", "start": 0, "end": 2}], "unknown kind"),
                            ([{"kind": "freeze", "component": "L3H0", "start": 0, "end": 2}], "not in a model"),
                            ([{"kind": "freeze", "component": "L0H0", "start": 5, "end": 2}], "not after start"),
                            ([{"kind": "reinit", "component": "L0.mlp"}], "needs the step")):
        run = tmp_path / expected.replace(" ", "_")
        assert fit(run, 4, items) == 2
        err = capsys.readouterr().err
        assert err.startswith("phasewatch: error: interventions.items") and expected in err, err
        assert not (run / "metrics.jsonl").exists()
    with pytest.raises(ConfigError):
        Interventions(["freeze L0H0"])


def test_an_auxiliary_loss_term_is_added_and_logged_in_the_breakdown(tmp_path):
    from phasewatch.rundir import read_jsonl

    run = tmp_path / "run"
    assert fit(run, 12, [{"kind": "aux_loss", "measure": "excluded_loss", "weight": -0.1, "start": 3, "end": 8}],
               "--trainer.log_every_n_steps", "1") == 0
    logged = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r}
    inside = [s for s in logged if 3 <= s < 8]
    assert inside and all(logged[s]["train/aux/excluded_loss"] != 0 for s in inside)
    assert all(logged[s]["train/aux/excluded_loss"] == 0 for s in logged if not 3 <= s < 8)
    for s in inside:
        r = logged[s]
        assert r["train/aux/excluded_loss"] < 0  # weight -0.1 times a positive loss
        assert abs(r["train/loss"] - (r["train/task_loss"] + r["train/aux/excluded_loss"])) < 1e-5
    # the term is the weighted excluded loss of the training pairs, as the probe defines it
    from phasewatch.probes.grokking import progress_measures, training_measure
    from phasewatch.cli.analyze import load_run_module

    module = load_run_module(run)
    module.load_state_dict(weights(run, 5))
    with torch.no_grad():
        term = float(training_measure(module.model, module.task, "excluded_loss"))
        probe = progress_measures(module.model, module.task)["grok/excluded_loss"]
    assert abs(term - probe) < 1e-6 * max(1.0, abs(probe))
    assert abs(logged[5]["train/aux/excluded_loss"] - (-0.1 * term)) < 1e-5

"""Work the probe callback shares between probes and the run (callbacks/probes.py): the
held-out set's logits of a validation serve a `held_out` probe at its end (digit_tokens), with
the values of the probe's own pass."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from phasewatch.callbacks.probes import ProbeRunner
from phasewatch.models import ModelConfig, build_model, native_module
from phasewatch.probes.digits import per_token_metrics
from phasewatch.tasks import make_task


def _digits():
    task = make_task("digit_addition", n_digits=2, n_val=24, batch_size=8)
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_mlp=32), task)
    return task, model.eval()


def test_per_token_metrics_by_the_definition_and_from_given_logits():
    task, model = _digits()
    (batch,) = task.val_batches()
    with torch.no_grad():
        logits = model(batch.tokens)  # through the bridge
    values = per_token_metrics(model, task)
    assert values == per_token_metrics(model, task, [logits])
    for i, pos in enumerate(task.answer_positions):
        target = batch.targets[:, pos]
        assert values[f"digits/loss/{i}"] == float(F.cross_entropy(logits[:, pos].float(), target))
        assert values[f"digits/acc/{i}"] == float((logits[:, pos].argmax(-1) == target).float().mean())
    # known answers: logits that put all their mass on the target at the first answer token, on
    # another token at the second
    made = torch.zeros(*batch.tokens.shape, logits.shape[-1])
    first, second = task.answer_positions[:2]
    made[torch.arange(len(batch)), first, batch.targets[:, first]] = 100.0
    made[torch.arange(len(batch)), second, (batch.targets[:, second] + 1) % logits.shape[-1]] = 100.0
    given = per_token_metrics(model, task, [made])
    assert given["digits/acc/0"] == 1.0 and given["digits/loss/0"] < 1e-30
    assert given["digits/acc/1"] == 0.0 and abs(given["digits/loss/1"] - 100.0) < 1e-4


def _run_validation(runner, trainer, module, passes, autocast: torch.dtype | None = None):
    """The callback around a validation whose passes are `passes` (token batches), as
    `TrainModule.validation_step` runs them (under a CPU autocast to `autocast` if given, as a
    mixed-precision trainer runs them); the native module's passes during the probes."""
    native = native_module(module.model)
    runner.on_validation_start(trainer, module)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        for tokens in passes:
            assert native(tokens).dtype == (autocast or torch.float32)
    calls = []
    handle = native.register_forward_hook(lambda *args: calls.append(1))
    try:
        runner.on_validation_end(trainer, module)
    finally:
        handle.remove()
    return len(calls)


def _runner(tmp_path):
    """A digit_tokens ProbeRunner set up on a fitting trainer at step 25, what it logs, and the
    values of the probe's own pass."""
    task, model = _digits()
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), sanity_checking=False, global_step=25, max_steps=100,
                              loggers=[logger], default_root_dir=str(tmp_path))
    module = SimpleNamespace(model=model, task=task)
    runner = ProbeRunner(names=["digit_tokens"])
    runner.setup(trainer, module, "fit")
    return runner, trainer, module, logged, per_token_metrics(model, task)


def test_validation_logits_serve_the_held_out_probe(tmp_path):
    runner, trainer, module, logged, expected = _runner(tmp_path)
    (batch,) = module.task.val_batches()
    # validation's pass over the held-out batch serves the probe: no pass of its own
    assert _run_validation(runner, trainer, module, [batch.tokens]) == 0
    assert logged == [(25, expected)]
    # a validation that did not pass the held-out set as such (a population's, other tokens):
    # the probe runs its own pass, the same values
    trainer.global_step = 50
    assert _run_validation(runner, trainer, module, []) == 1
    assert _run_validation(runner, trainer, module, [batch.tokens[:, :-1]]) == 1
    assert logged[1:] == [(50, expected), (50, expected)]
    assert not native_module(module.model)._forward_hooks  # nothing left on the model


def test_validation_under_mixed_precision_does_not_serve_the_probe(tmp_path):
    # logits of a bf16 autocast differ from the probe's own float32 pass: the probe runs its own
    runner, trainer, module, logged, expected = _runner(tmp_path)
    (batch,) = module.task.val_batches()
    assert _run_validation(runner, trainer, module, [batch.tokens], autocast=torch.bfloat16) == 1
    assert logged == [(25, expected)]

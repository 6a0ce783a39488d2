"""Several optimisation steps per Lightning step (`TrainModule.chunked`): the same run, bit
for bit, as one step per Lightning step: metrics.jsonl, every checkpoint's weights, and a run
resumed from a step inside a chunk."""

import shutil

import pytest
import torch

from phasewatch.cli.main import main
from phasewatch.rundir import read_jsonl
from phasewatch.training.module import TrainModule

STEPS = 30
ARGS = ["--data.task", "Induction", "--data.task.vocab_size", "10", "--data.task.seq_len", "13",
        "--data.task.max_len", "6", "--data.task.batch_size", "8", "--data.task.n_val", "16",
        "--model.arch.d_model", "16", "--model.arch.n_heads", "2", "--model.arch.d_head", "8", "--model.arch.d_mlp", "32",
        "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", "10", "--trainer.log_every_n_steps", "5",
        "--checkpoints.schedule", '{"kind": "list", "steps": [0, 13, 30]}', "--checkpoints.last_every", "7",
        "--report.every_n_validations", "0", "--trainer.enable_progress_bar", "false", "--no_wandb"]
TRAINING_STEP = TrainModule.training_step
#: every step's update skipped from step 1 on (lr 1e30 at step 0 makes every later loss infinite)
NONFINITE = ["--model.lr", "1e30", "--model.weight_decay", "0", "--model.warmup_steps", "0",
             "--model.on_nonfinite", "skip", "--probes.names", "[]"]


def fit(run_dir, chunks: bool, monkeypatch, *extra) -> list[int]:
    """`phasewatch fit` with steps in chunks or not; the optimizer steps each Lightning step ran."""
    per_call: list[int] = []

    def counted(self, batch, batch_idx):
        before = self.global_step
        loss = TRAINING_STEP(self, batch, batch_idx)
        # a chunk steps the optimizer itself; Lightning's automatic step follows the call
        per_call.append(self.global_step - before if self.chunked() else 1)
        return loss

    monkeypatch.setattr(TrainModule, "chunks", chunks)
    monkeypatch.setattr(TrainModule, "training_step", counted)
    assert main(["fit", *ARGS, *extra, "--run_dir", str(run_dir)]) == 0
    return per_call


def checkpoints(run_dir) -> dict[str, tuple[int, dict[str, bytes]]]:
    """Every checkpoint's step and weights, as bytes (NaN compares equal to NaN)."""
    out = {}
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        ckpt = torch.load(path, weights_only=False)
        out[path.name] = (ckpt["global_step"], {k: v.numpy().tobytes() for k, v in ckpt["state_dict"].items()})
    return out


@pytest.mark.filterwarnings("error:Converting a tensor with requires_grad")  # logged values are read detached
@pytest.mark.parametrize("extra, deferred", [([], False), (NONFINITE, False), (NONFINITE, True)],
                         ids=["probes", "nonfinite-skipped", "nonfinite-skipped-on-the-device"])
def test_chunked_steps_train_log_and_save_exactly_as_one_step_at_a_time(tmp_path, monkeypatch, extra, deferred):
    """Also with the accelerator's check run on the CPU (`deferred`: fused AdamW skips each
    non-finite update on the device, the count read at logging steps)."""
    if deferred:
        monkeypatch.setattr(TrainModule, "defer_checks", property(lambda self: True))
    plain = fit(tmp_path / "plain", False, monkeypatch, *extra)
    chunked = fit(tmp_path / "chunked", True, monkeypatch, *extra)
    assert plain == [1] * STEPS and sum(chunked) == STEPS
    if not extra:  # chunks end where anything is due: logging every 5 steps, here before that
        assert len(chunked) < STEPS and max(chunked) > 1
    text = (tmp_path / "plain" / "metrics.jsonl").read_text()
    assert text and (tmp_path / "chunked" / "metrics.jsonl").read_text() == text
    saved = checkpoints(tmp_path / "plain")
    assert {"step=0000013.ckpt", "last.ckpt"} <= set(saved) and checkpoints(tmp_path / "chunked") == saved
    if extra:
        skipped = [r["train/skipped_steps"] for r in read_jsonl(tmp_path / "chunked" / "metrics.jsonl")
                   if "train/skipped_steps" in r]
        assert skipped[-1] == STEPS - 1


def test_a_run_resumed_from_a_step_inside_a_chunk_goes_on_exactly(tmp_path, monkeypatch):
    """Step 13 lies inside a chunk (logging at 10 and 15): the chunked run resumed from its
    checkpoint there, and the same checkpoint resumed one step at a time, both write the
    uninterrupted run's metrics and weights."""
    fit(tmp_path / "a", True, monkeypatch, "--probes.names", "[]")
    for chunks in (True, False):
        run = tmp_path / f"resumed-{chunks}"
        shutil.copytree(tmp_path / "a", run)
        monkeypatch.setattr(TrainModule, "chunks", chunks)
        assert main(["fit", "--run_dir", str(run), "--ckpt_path", str(run / "checkpoints" / "step=0000013.ckpt")]) == 0
        assert (run / "metrics.jsonl").read_text() == (tmp_path / "a" / "metrics.jsonl").read_text()
        assert checkpoints(run)["last.ckpt"] == checkpoints(tmp_path / "a")["last.ckpt"]


def test_validation_runs_every_module_in_eval_mode_and_training_resumes_in_train_mode(tmp_path, monkeypatch):
    """`TrainModule.on_validation_model_eval` (each module switched once, the bridge's own model
    too) against what the training and validation steps see: every module of the module and of
    the bridge's wrapped model in eval mode during validation, in train mode at every step."""
    seen: dict[str, set[bool]] = {"train": set(), "val": set()}
    step, validation_step = TrainModule._step, TrainModule.validation_step

    def modes(module) -> set[bool]:
        return {sub.training for root in (module, module.model.original_model) for sub in root.modules()}

    def training(self, batch, batch_idx):
        seen["train"] |= modes(self)
        return step(self, batch, batch_idx)

    def validating(self, batch, batch_idx):
        seen["val"] |= modes(self)
        return validation_step(self, batch, batch_idx)

    monkeypatch.setattr(TrainModule, "_step", training)
    monkeypatch.setattr(TrainModule, "validation_step", validating)
    fit(tmp_path / "run", True, monkeypatch, "--probes.names", "[]", "--trainer.max_steps", "21")
    assert seen == {"train": {True}, "val": {False}}


def test_validation_starts_without_gradients_and_training_resumes_in_train_mode(tmp_path, monkeypatch):
    """Before each of a fit's validations every parameter's gradient is released (as Lightning's
    `zero_grad`, in `TrainModule.on_validation_model_zero_grad`, one walk over the modules), and
    training resumes with every module in train mode (`eval_mode`'s record, put back)."""
    seen: list[tuple] = []
    step, validation_step = TrainModule._step, TrainModule.validation_step

    def training(self, batch, batch_idx):
        seen.append(("train", {sub.training for sub in self.modules()}))
        return step(self, batch, batch_idx)

    def validating(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            seen.append(("val", {p.grad is None for p in self.parameters()}, {sub.training for sub in self.modules()}))
        return validation_step(self, batch, batch_idx)

    monkeypatch.setattr(TrainModule, "_step", training)
    monkeypatch.setattr(TrainModule, "validation_step", validating)
    fit(tmp_path / "run", True, monkeypatch, "--probes.names", "[]", "--trainer.max_steps", "21")
    assert [s for s in seen if s[0] == "val"] == [("val", {True}, {False})] * 2
    assert {frozenset(s[1]) for s in seen if s[0] == "train"} == {frozenset({True})}


def test_a_fit_trains_as_with_the_for_loop_adamw(tmp_path, monkeypatch):
    """The CPU's AdamW over all tensors at once (`adamw_with_warmup`'s `foreach`) against
    PyTorch's for-loop AdamW: every checkpoint's weights bit for bit (tests/unit/
    test_adamw_foreach.py: each shipped config's model, a population's stacked weights)."""
    short = ["--probes.names", "[]", "--trainer.max_steps", "14"]
    fit(tmp_path / "foreach", True, monkeypatch, *short)
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: adamw(*a, **{**k, "foreach": False}))
    fit(tmp_path / "for-loop", True, monkeypatch, *short)
    saved = checkpoints(tmp_path / "for-loop")
    assert len(saved) >= 3 and checkpoints(tmp_path / "foreach") == saved


def test_last_ckpt_is_written_once_at_the_end(tmp_path, monkeypatch):
    """28 steps, last.ckpt due every 7 (and a copy of the schedule's full checkpoints at 0 and
    13): refreshed at 7, 14, 21 and once at 28 (by `on_train_end`, after the watcher's final
    look: it holds the watcher's final state), not also by the last step's own refresh."""
    from phasewatch.callbacks.checkpoints import ScheduledCheckpoints

    written, save = [], ScheduledCheckpoints._save

    def recorded(self, trainer, name, weights_only=False, copy_to_last=False):
        if name == "last.ckpt" or copy_to_last:
            written.append(trainer.global_step)
        return save(self, trainer, name, weights_only, copy_to_last)

    monkeypatch.setattr(ScheduledCheckpoints, "_save", recorded)
    run = tmp_path / "run"
    fit(run, True, monkeypatch, "--probes.names", "[]", "--trainer.max_steps", "28")
    assert written == [0, 7, 13, 14, 21, 28]
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    watcher = next(v for k, v in last["callbacks"].items() if "TransitionWatcher" in k)
    assert last["global_step"] == 28 and not watcher["pending"]  # the final look leaves nothing pending


def test_a_chunk_logs_its_logging_steps_itself_and_draws_no_batch_for_lightning(tmp_path, monkeypatch):
    """A logging step where nothing else is due ends no chunk: its values are handed to the
    loggers inside the chunk (`TrainModule._hand_over`), metrics.jsonl as one step at a time
    writes it (the tests above). Lightning's own batch, which a chunk does not read, is not
    drawn (`StepStream`'s `UNUSED`): the task draws each step's batch once."""
    from phasewatch.tasks.induction import Induction

    drawn: list[int] = []
    train_batch = Induction.train_batch

    def counted(self, step, batch_size=None):
        drawn.append(step)
        return train_batch(self, step, batch_size)

    monkeypatch.setattr(Induction, "train_batch", counted)
    # no checkpoints but at 0 and the end, no validation: only logging every 5 steps is left
    chunked = fit(tmp_path / "run", True, monkeypatch, "--probes.names", "[]", "--trainer.max_steps", "20",
                  "--checkpoints.schedule", '{"kind": "list", "steps": [0]}', "--checkpoints.last_every", "100",
                  "--trainer.limit_val_batches", "0", "--transitions.looks", "0")
    logged = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert logged == [4, 9, 14, 19] and chunked == [20], chunked
    # each step's batch once, and Lightning's first (fetched before the fit decides on chunks)
    assert drawn == [0, *range(20)], drawn


def test_validation_values_reach_the_callbacks_and_the_progress_bar_as_logged(tmp_path, monkeypatch):
    """Validation's values go to the loggers straight in a fit; `trainer.callback_metrics`
    (EarlyStopping, a monitor) and `progress_bar_metrics` hold what was logged, as `self.log`
    leaves them; `phasewatch validate` still reports them through Lightning."""
    import lightning.pytorch as pl

    from phasewatch.training import lightning_cli

    seen: list[tuple] = []

    class Watch(pl.Callback):
        def on_validation_end(self, trainer, pl_module):
            if trainer.state.fn == "fit":
                seen.append((trainer.global_step, {k: float(v) for k, v in trainer.callback_metrics.items()},
                             dict(trainer.progress_bar_metrics)))

    original = lightning_cli.PhasewatchCLI.instantiate_trainer

    def with_watch(self, **kwargs):
        trainer = original(self, **kwargs)
        trainer.callbacks.append(Watch())
        return trainer

    monkeypatch.setattr(lightning_cli.PhasewatchCLI, "instantiate_trainer", with_watch)
    fit(tmp_path / "run", True, monkeypatch, "--probes.names", "[]", "--trainer.max_steps", "20")
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "val/loss" in r}
    assert [step for step, _, _ in seen] == sorted(rows) == [10, 20]
    for step, metrics, bar in seen:
        row = rows[step]
        assert {k: metrics[k] for k in ("val/loss", "val/acc", "val/seq_acc")} == {k: row[k] for k in
                                                                                   ("val/loss", "val/acc", "val/seq_acc")}
        assert metrics["step"] == step and bar == {"val/loss": row["val/loss"], "val/acc": row["val/acc"]}


def test_a_module_fitted_again_after_a_chunked_fit_raised_gets_real_batches():
    """A chunked fit that raises leaves its plan behind (no `on_train_end`); the same module
    fitted again by another trainer, not chunkable (gradient clipping), must be handed Lightning's
    batches, not the empty stand-in chunks use (review, session 20: the second fit failed on a
    batch of 0 tokens)."""
    import warnings

    import lightning.pytorch as pl

    from phasewatch.training.lightning_cli import instantiate_config

    warnings.filterwarnings("ignore")
    config = {"seed_everything": 0,
              "model": {"arch": {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_head": 8, "d_mlp": 32, "attn_only": False},
                        "lr": 0.001},
              "data": {"task": {"class_path": "phasewatch.tasks.Induction",
                                "init_args": {"vocab_size": 10, "seq_len": 13, "max_len": 6, "batch_size": 8, "n_val": 16}}}}
    run = instantiate_config(config, "inline")
    model, data = run.model, run.datamodule

    class Boom(pl.Callback):
        def due_at(self, step, dense=False):
            return step == 5

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= 5:
                raise RuntimeError("boom")

    kw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              check_val_every_n_epoch=None, val_check_interval=10, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="boom"):
        pl.Trainer(max_steps=20, callbacks=[Boom()], **kw).fit(model, data)
    assert model._fit_plan is not None and model._fit_plan.chunked  # left behind

    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(tuple(batch.tokens.shape))

    pl.Trainer(max_steps=3, gradient_clip_val=1.0, callbacks=[Spy()], **kw).fit(model, data)
    assert seen == [(8, 12)] * 3


@pytest.mark.parametrize("extra", [[], ["--transitions.logs_per_doubling", "16"]], ids=["plain", "early"])
def test_chunks_ended_by_the_progress_bars_clock_train_as_one_step_at_a_time(tmp_path, monkeypatch, extra):
    """With a progress bar, a chunk also ends after `BAR_SECONDS` (so that the bar moves on): chunk
    ends set by the clock, not the schedules, change nothing (metrics.jsonl, checkpoints, events),
    with the watcher logging early too (review, session 20)."""
    from phasewatch.training import module

    monkeypatch.setattr(module, "BAR_SECONDS", 0.01)
    bar = ["--trainer.enable_progress_bar", "true"]
    plain = fit(tmp_path / "plain", False, monkeypatch, *bar, *extra)
    chunked = fit(tmp_path / "chunked", True, monkeypatch, *bar, *extra)
    assert plain == [1] * STEPS and sum(chunked) == STEPS
    for name in ("metrics.jsonl", "events.jsonl"):
        text = (tmp_path / "plain" / name).read_text() if (tmp_path / "plain" / name).exists() else None
        assert (tmp_path / "chunked" / name).read_text() == text if text is not None else not (tmp_path / "chunked" / name).exists()
    assert checkpoints(tmp_path / "chunked") == checkpoints(tmp_path / "plain")

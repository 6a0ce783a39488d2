"""The run folder's checkpoints: weights only where they exist for post-hoc probes, the full
state in last.ckpt and on an explicit schedule, the dense grid thinned, and post-hoc `analyze`
measuring the same values on weights-only or thinned checkpoints as on full ones."""

import shutil

import pytest
import torch

from phasewatch.callbacks.checkpoints import ScheduledCheckpoints
from phasewatch.cli.main import main
from phasewatch.errors import ConfigError
from phasewatch.rundir import RunFolder, checkpoint_name, format_size, read_checkpoint, read_jsonl

from .test_fit import TASKS, TINY

RUN = [*TASKS["modular_addition"], "--trainer.max_steps", "16", "--trainer.val_check_interval", "8",
       "--trainer.log_every_n_steps", "4", "--probes.names", "[]", "--probes.schedule",
       '{"kind": "list", "steps": [0, 3, 7, 16]}', "--checkpoints.dense_per_decade", "0", "--no_wandb", *TINY]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 16-step run twice: default checkpoints (weights only), and full ones."""
    root = tmp_path_factory.mktemp("ckpt")
    assert main(["fit", "--run_dir", str(root / "weights"), *RUN]) == 0
    assert main(["fit", "--run_dir", str(root / "full"), *RUN, "--checkpoints.weights_only", "false"]) == 0
    return root / "weights", root / "full"


def test_step_checkpoints_hold_the_weights_and_last_the_full_state(runs):
    weights, full = RunFolder(runs[0]), RunFolder(runs[1])
    assert list(weights.checkpoint_steps()) == list(full.checkpoint_steps()) == [0, 3, 7, 16]
    for step, path in weights.checkpoint_steps().items():
        small, big = load(path), load(full.checkpoint_steps()[step])
        assert "optimizer_states" not in small and "optimizer_states" in big
        assert small["global_step"] == big["global_step"] == step
        for key, tensor in big["state_dict"].items():  # the same weights
            assert torch.equal(small["state_dict"][key], tensor), (step, key)
    assert "optimizer_states" in load(weights.last_checkpoint)  # last.ckpt resumes
    # AdamW keeps two numbers per trained weight: the weights-only file is smaller by (about) their bytes
    moments = [t for s in load(full.checkpoint_steps()[16])["optimizer_states"][0]["state"].values()
               for t in s.values() if t.dim() > 0]
    saved = full.checkpoint_steps()[16].stat().st_size - weights.checkpoint_steps()[16].stat().st_size
    assert saved >= sum(t.numel() * t.element_size() for t in moments) > 0
    assert weights.size_bytes() < full.size_bytes()
    assert weights.size_bytes() == sum(p.stat().st_size for p in weights.root.rglob("*") if p.is_file())


def test_a_weights_only_checkpoint_is_refused_as_a_resume_point_with_the_fix(runs, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(runs[0], copy)
    step7 = copy / "checkpoints" / checkpoint_name(7)
    with pytest.raises(ConfigError, match="holds the weights only") as err:
        read_checkpoint(step7, resume=True)
    assert "--ckpt_path last" in str(err.value)
    assert read_checkpoint(step7)["global_step"] == 7  # post-hoc readers take it
    assert main(["fit", "--run_dir", str(copy), "--ckpt_path", str(step7)]) == 2
    assert "holds the weights only" in capsys.readouterr().err


def test_analyze_measures_the_same_values_on_weights_only_and_thinned_checkpoints(runs, tmp_path):
    """`phasewatch analyze` over full checkpoints, and over weights-only ones thinned (step 3
    removed): the same value at every step the thinned run has."""
    measured = {}
    for name, source, keep in (("full", runs[1], None), ("thinned", runs[0], (0, 7, 16))):
        run = tmp_path / name
        shutil.copytree(source, run)
        for step, path in RunFolder(run).checkpoint_steps().items():
            if keep is not None and step not in keep:
                path.unlink()
        assert main(["analyze", str(run), "--probes", "grokking", "--device", "cpu", "--no_wandb"]) == 0
        measured[name] = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r}
    assert sorted(measured["full"]) == [0, 3, 7, 16] and sorted(measured["thinned"]) == [0, 7, 16]
    for step, record in measured["thinned"].items():
        assert record == measured["full"][step], step


def test_dense_checkpoints_are_thinned_to_their_count_per_decade(tmp_path):
    """A dense-grid checkpoint is kept when the step checkpoint before it is more than a factor
    10**(1/n) earlier: with n = 10 (a factor 1.2589) after step 100, step 125 is skipped and 126 kept."""
    (tmp_path / checkpoint_name(100)).write_bytes(b"")
    (tmp_path / checkpoint_name(300)).write_bytes(b"")  # later files (a resumed run's) do not count
    thin = ScheduledCheckpoints(dirpath=str(tmp_path), dense_per_decade=10)
    assert [s for s in (101, 125, 126, 200) if thin._dense_kept(s)] == [126, 200]
    assert ScheduledCheckpoints(dirpath=str(tmp_path), dense_per_decade=None)._dense_kept(101)
    assert not ScheduledCheckpoints(dirpath=str(tmp_path), dense_per_decade=0)._dense_kept(1000)
    assert ScheduledCheckpoints(dirpath=str(tmp_path / "empty"), dense_per_decade=10)._dense_kept(1)


def test_weights_only_except_at_the_steps_of_an_explicit_schedule():
    from phasewatch.callbacks.schedule import Schedule

    explicit = Schedule(kind="list", steps=[0, 5])
    assert ScheduledCheckpoints().light(scheduled=True) and ScheduledCheckpoints().light(scheduled=False)
    assert not ScheduledCheckpoints(schedule=explicit).light(scheduled=True)  # a resume point
    assert ScheduledCheckpoints(schedule=explicit).light(scheduled=False)  # the dense grid's: post-hoc only
    assert ScheduledCheckpoints(schedule=explicit, weights_only=True).light(scheduled=True)
    assert not ScheduledCheckpoints(weights_only=False).light(scheduled=False)
    with pytest.raises(ConfigError, match="dense_per_decade"):
        ScheduledCheckpoints(dense_per_decade=-1)


def test_sizes_read_as_people_write_them():
    assert [format_size(n) for n in (999, 1000, 123_456, 99_950_000, 3_400_000_000)] == [
        "999 B", "1.0 kB", "123.5 kB", "100.0 MB", "3.4 GB"]

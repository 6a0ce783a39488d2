"""The command line: bad input stops early and clearly, writes nothing; start-up stays lean."""

import re
import subprocess
import sys

import pytest
import torch
import yaml

from phasewatch.cli.main import main

REPO_CONFIGS = ["quickstart", "grokking_nanda2023", "digit_addition", "induction_2l", "reverse", "sort", "hist",
                "induction_2l_freeze_l0", "quickstart_aux_restricted"]


@pytest.mark.parametrize("args,field", [
    (["--data.task.p", "1"], "data.task.p"),
    (["--data.task", "Nope"], "data.task"),
    (["--data.task.frac_train", "1.5"], "data.task.frac_train"),
    (["--model.arch.n_ctx", "2"], "model.arch.n_ctx"),
    (["--data.task", "digit_addition", "--data.task.n_digits", "0"], "data.task.n_digits"),
    (["--data.task", "induction", "--data.task.seq_len", "20"], "data.task.seq_len"),
    (["--data.task", "rasp", "--data.task.program", "revers"], "data.task.program"),
    (["--data.task", "rasp", "--data.task.vocab", "[1, BOS]"], "data.task.vocab"),
    (["--data.task", "rasp", "--model.arch.attention", "causal"], "model.arch.attention"),
    (["--model.lr", "-1"], "model.lr"),
    (["--checkpoints.schedule.kind", "linear"], "checkpoints.schedule.every"),
])
def test_bad_config_stops_before_training_with_one_clear_line(tmp_path, capsys, args, field):
    run = tmp_path / "run"
    assert main(["fit", *args, "--run_dir", str(run), "--no_wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"phasewatch: error: {field}: ")
    assert not run.exists()  # nothing written


def test_unparseable_value_is_one_line_naming_the_field(tmp_path, capsys):
    assert main(["fit", "--model.lr", "abc", "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phasewatch: error: model.lr: ") and "usage:" not in err and not (tmp_path / "run").exists()


def test_existing_run_folder_is_not_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed_everything: 0\n")
    assert main(["fit", "--run_dir", str(run), "--no_wandb"]) == 2
    assert "--ckpt_path last" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == "seed_everything: 0\n"


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    assert main(["fit", "--run_dir", str(tmp_path / "none"), "--ckpt_path", "last"]) == 2
    assert "no run to resume" in capsys.readouterr().err


@pytest.mark.parametrize("name", REPO_CONFIGS)
def test_shipped_configs_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", f"configs/{name}.yaml", "--print_config"])
    assert exit_.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"]["max_steps"] > 0 and cfg["data"]["task"]["class_path"].startswith("phasewatch.tasks.")


def test_quickstart_config_is_the_embedded_default(capsys):
    dumps = []
    for args in ([], ["--config", "configs/quickstart.yaml"]):
        with pytest.raises(SystemExit):
            main(["fit", *args, "--print_config"])
        dumps.append(yaml.safe_load(capsys.readouterr().out))
    assert dumps[0] == dumps[1]


def test_cli_start_up_imports_no_heavy_modules():
    code = ("import sys; from phasewatch.cli.main import main; main(['--help']); "
            "heavy = [m for m in ('torch', 'lightning', 'jax', 'tracr', 'transformer_lens', 'wandb') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_tasks_command_lists_tasks_programs_and_probes(capsys):
    from phasewatch.probes import probe_names

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "modular_addition" in out and "reverse" in out and "frac_prevs" in out
    probes = {line.split()[0]: line.split(None, 1)[1] for line in out.split("probes (")[1].splitlines()[1:]}
    assert sorted(probes) == probe_names()
    assert probes["grokking"].split()[0] == "modular_addition*"  # the grokking task's default, for it alone
    assert "*" not in probes["llc"] and "24 log-spaced" in probes["llc"]  # on request, on its own schedule
    assert probes["tracr"].split()[0] == "rasp*" and "induction*" in probes["heads"]


def test_phases_command_on_the_published_csv(reference_dir, capsys):
    assert main(["phases", str(reference_dir / "5_digit_addition_infinite_per_token.csv"), "--series"]) == 0
    out = capsys.readouterr().out
    first, rest = out.split("\n", 1)
    assert re.fullmatch(r"\d+ stages? in 6 series .*", first) and re.search(r"\n\d+ transitions in 6 series", rest)
    assert all(f"answer_token_{i}" in out for i in range(6))


def test_phases_command_json_on_a_run_and_bad_keys(tmp_path, capsys):
    import json as _json

    run = tmp_path / "m.jsonl"
    rows = [{"step": s, "val/loss": 3.0 if s < 300 else 0.5} for s in range(10, 2000, 10)]
    run.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    assert main(["phases", str(run), "--json", "--series"]) == 0
    (event,) = [_json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event["metric"] == "val/loss" and event["direction"] == "down" and 250 <= event["midpoint"] <= 310
    assert main(["phases", str(run), "--json"]) == 0  # the stages: val/loss is a headline series, alone a stage
    (stage,) = [_json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert stage["lead"] == "val/loss" and [m["series"] for m in stage["members"]] == ["val/loss"]
    assert stage["onset"] == event["onset"] and stage["end"] == event["end"]
    assert main(["phases", str(run), "--keys", "nope"]) == 2
    assert "no series ['nope']" in capsys.readouterr().err


def test_phases_command_tables_each_series_and_its_lead_over_the_reference(tmp_path, capsys):
    """Two losses dropping at steps 300 and 600 (sampled every 10): each series' row has its
    drop, and the earlier one leads the later by about 300 steps, against either reference."""
    import json as _json

    run = tmp_path / "m.jsonl"
    rows = [{"step": s, "val/loss": 3.0 if s < 600 else 0.5, "train/loss": 2.5 if s < 300 else 0.1}
            for s in range(10, 3000, 10)]
    run.write_text("".join(_json.dumps(r) + "\n" for r in rows))

    def printed(*args) -> tuple[dict[str, list[str]], str]:
        assert main(["phases", str(run), "--series", *args]) == 0
        out = capsys.readouterr().out
        table = out.split("\n2 transitions in 2 series", 1)[1].split("lead/lag", 1)[0]
        return {line.split()[0]: line.split() for line in table.splitlines()[2:] if line.strip()}, out

    table, out = printed()
    assert table["train/loss"][1] == "down" and 290 <= int(table["train/loss"][3]) <= 300  # midpoint
    assert table["val/loss"][1] == "down" and 590 <= int(table["val/loss"][3]) <= 600
    lead = re.search(r"lead/lag against val/loss going down .*\n  train/loss +down midpoint +\d+  leads by +(-?\d+) steps",
                     out)
    assert lead and 290 <= int(lead[1]) <= 310
    _, out = printed("--reference", "train/loss")
    lag = re.search(r"lead/lag against train/loss .*\n  val/loss +down midpoint +\d+  leads by +(-?\d+) steps", out)
    assert lag and -310 <= int(lag[1]) <= -290


TINY_MOD = ["--data.task.p", "13", "--model.arch.d_model", "16", "--model.arch.n_heads", "2", "--model.arch.d_head",
            "8", "--model.arch.d_mlp", "32", "--trainer.enable_progress_bar", "false", "--no_wandb"]


def test_nonfinite_loss_stops_with_the_step_and_keeps_what_was_written(tmp_path, capsys):
    import torch

    from phasewatch.rundir import read_jsonl

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--run_dir", str(run), *TINY_MOD, "--model.lr", "1e30", "--model.weight_decay", "0", "--model.warmup_steps", "0",
              "--trainer.max_steps", "50", "--trainer.val_check_interval", "5"])
    assert exit_.value.code == 1
    assert "the training loss is nan at step 1; training stops" in capsys.readouterr().out
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] < 5 and all(torch.isfinite(v).all() for v in ckpt["state_dict"].values()
                                           if v.is_floating_point())
    assert list(read_jsonl(run / "metrics.jsonl"))  # readable, nothing half-written


def test_nonfinite_loss_can_be_skipped(tmp_path):
    from phasewatch.rundir import read_jsonl

    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TINY_MOD, "--model.lr", "1e30", "--model.weight_decay", "0", "--model.warmup_steps", "0",
                 "--model.on_nonfinite", "skip", "--trainer.max_steps", "20", "--trainer.val_check_interval", "10",
                 "--trainer.log_every_n_steps", "1"]) == 0
    skipped = [r["train/skipped_steps"] for r in read_jsonl(run / "metrics.jsonl") if "train/skipped_steps" in r]
    assert skipped and skipped[-1] >= 10


def test_a_run_folder_held_by_a_live_process_is_refused(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = tmp_path / "run"
        run.mkdir()
        (run / ".lock").write_text(f"{holder.pid}\n")
        assert main(["fit", "--run_dir", str(run), *TINY_MOD, "--trainer.max_steps", "2"]) == 2
        assert f"another phasewatch process (pid {holder.pid})" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # a lock left by a dead process is taken over
    assert main(["fit", "--run_dir", str(run), *TINY_MOD, "--trainer.max_steps", "2"]) == 0
    assert not (run / ".lock").exists()


def test_unwritable_run_folder_fails_at_start(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["fit", "--run_dir", str(blocker / "run"), *TINY_MOD]) == 2
    assert "run_dir: cannot write to" in capsys.readouterr().err


def test_corrupt_checkpoint_is_named_with_the_previous_one(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TINY_MOD, "--trainer.max_steps", "8"]) == 0
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # truncated
    assert main(["fit", "--run_dir", str(run), "--ckpt_path", "last", "--no_wandb"]) == 2
    err = capsys.readouterr().err
    assert f"{last} is truncated or corrupt" in err and "step=0000008.ckpt" in err


@pytest.fixture
def device_side_checks(monkeypatch):
    """The accelerator's path (fused AdamW, non-finite steps skipped on the device, read at
    logging steps), run on the CPU."""
    from phasewatch.training.module import TrainModule

    monkeypatch.setattr(TrainModule, "defer_checks", property(lambda self: True))


def test_device_side_check_trains_like_the_per_step_check(tmp_path, device_side_checks):
    from phasewatch.rundir import read_jsonl

    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TINY_MOD, "--trainer.max_steps", "30", "--trainer.val_check_interval",
                 "10", "--trainer.log_every_n_steps", "5"]) == 0
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["optimizer_states"][0]["param_groups"][0]["fused"] is True
    losses = [r["train/loss"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_device_side_check_skips_and_counts_nonfinite_steps(tmp_path, device_side_checks):
    from phasewatch.rundir import read_jsonl

    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TINY_MOD, "--model.lr", "1e30", "--model.weight_decay", "0",
                 "--model.warmup_steps", "0", "--model.on_nonfinite", "skip", "--trainer.max_steps", "20",
                 "--trainer.val_check_interval", "10", "--trainer.log_every_n_steps", "5"]) == 0
    skipped = [(r["step"], r["train/skipped_steps"]) for r in read_jsonl(run / "metrics.jsonl")
               if "train/skipped_steps" in r]
    # step 0 (lr 1e30) makes every later loss non-finite: all of steps 1..19 are skipped
    assert skipped[-1] == (19, 19) and [s for _, s in skipped] == sorted(s for _, s in skipped)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert int(ckpt["optimizer_states"][0]["state"][0]["step"]) == 1  # only step 0's update was applied


def test_device_side_check_stops_at_the_next_logging_step(tmp_path, capsys, device_side_checks):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--run_dir", str(run), *TINY_MOD, "--model.lr", "1e30", "--model.weight_decay", "0",
              "--model.warmup_steps", "0", "--trainer.max_steps", "50", "--trainer.val_check_interval", "5",
              "--trainer.log_every_n_steps", "5"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "the training loss was not finite at 4 step(s) from step 1 to 4; their updates were skipped" in out
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 5 and int(ckpt["optimizer_states"][0]["state"][0]["step"]) == 1


def test_a_fit_ends_with_a_summary_and_without_library_noise(tmp_path, capfd, monkeypatch):
    """The libraries' start-up lines that phasewatch causes are gone, W&B's own lines too
    (offline, phasewatch says where its files are), and the run ends with what a person acts
    on: final values, report, folder and its size, how to upload and how to train on."""
    import glob
    import re

    from phasewatch.rundir import RunFolder, read_jsonl

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    args = [a for a in TINY_MOD if a != "--no_wandb"]
    assert main(["fit", "--run_dir", str(run), *args, "--trainer.max_steps", "20", "--trainer.val_check_interval", "10"]) == 0
    captured = capfd.readouterr()
    text = captured.out + captured.err
    for noise in ("💡 Tip", "TPU available", "anonymous setting", "LeafSpec", "overridden `transfer_batch_to_device`",
                  "Tracking run with wandb", "Seed set to", "`Trainer.fit` stopped"):
        assert noise not in text, noise
    lines = captured.out.splitlines()
    (first,) = [i for i, line in enumerate(lines) if line.startswith("phasewatch: finished at step 20 of 20:")]
    last_val = [r["val/loss"] for r in read_jsonl(run / "metrics.jsonl") if "val/loss" in r][-1]
    shown = float(re.search(r"val/loss (\S+)", lines[first]).group(1))
    assert shown == pytest.approx(last_val, rel=1e-2)
    summary = "\n".join(lines[first:])
    assert f"report: {run / 'report.html'}" in summary
    size = re.search(rf"run folder: {re.escape(str(run))} \(([\d.]+) (kB|MB|GB)\)", summary)
    actual = RunFolder(run).size_bytes() / {"kB": 1e3, "MB": 1e6, "GB": 1e9}[size.group(2)]
    assert float(size.group(1)) == pytest.approx(actual, rel=0.2)
    pattern = re.search(r"upload to W&B: wandb sync (\S+)", summary).group(1)
    assert glob.glob(pattern)
    assert f"train on: phasewatch fit --run_dir {run} --ckpt_path last --trainer.max_steps 40" in summary
    from phasewatch.phases.stages import read_stages

    assert RunFolder(run).stages.exists()  # written at the end of the fit, for the report and this summary
    for stage in read_stages(RunFolder(run)):
        assert f"  {stage.summary()}" in summary

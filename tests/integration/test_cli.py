"""The command line: bad input stops early and clearly, writes nothing; start-up stays lean."""

import subprocess
import sys

import pytest
import yaml

from phasewatch.trainers.cli import main

REPO_CONFIGS = ["quickstart", "grokking_nanda2023", "digit_addition", "induction_2l", "reverse"]


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


def test_unparseable_value_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model.lr", "abc", "--run_dir", str(tmp_path / "run")])
    assert exit_.value.code == 2 and 'model.lr' in capsys.readouterr().err


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
    code = ("import sys; from phasewatch.trainers.cli import main; main(['--help']); "
            "heavy = [m for m in ('torch', 'lightning', 'jax', 'tracr', 'transformer_lens', 'wandb') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_tasks_command_lists_tasks_and_programs(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "modular_addition" in out and "reverse" in out and "frac_prevs" in out


def test_phases_command_on_the_published_csv(reference_dir, capsys):
    assert main(["phases", str(reference_dir / "5_digit_addition_infinite_per_token.csv")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 transitions in 6 series")
    assert all(f"answer_token_{i}" in out for i in range(6))


def test_phases_command_json_on_a_run_and_bad_keys(tmp_path, capsys):
    import json as _json

    run = tmp_path / "m.jsonl"
    rows = [{"step": s, "val/loss": 3.0 if s < 300 else 0.5} for s in range(10, 2000, 10)]
    run.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    assert main(["phases", str(run), "--json"]) == 0
    (event,) = [_json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event["metric"] == "val/loss" and event["direction"] == "down" and 250 <= event["midpoint"] <= 310
    assert main(["phases", str(run), "--keys", "nope"]) == 2
    assert "no series ['nope']" in capsys.readouterr().err

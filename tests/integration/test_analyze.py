"""`phasewatch analyze RUN_DIR`: probes over a finished run's checkpoints, into its run
folder and into a W&B run of its own (read back from the offline transaction log)."""

import numpy as np
import pytest
import torch

from phasewatch.cli.main import main
from phasewatch.rundir import read_jsonl
from phasewatch.loggers.wandb_logger import transition_summary

from . import wandb_records
from .conftest import GROKKING_RUN, copy_run
from .test_fit import TASKS
from .test_probes_in_training import by_step


@pytest.fixture(scope="module")
def trained(grokking_run, tmp_path_factory):
    """A 300-step grokking run without probes, logged to an offline W&B run: the session's
    (conftest.py), copied, as the analyses write into it."""
    return copy_run(grokking_run, tmp_path_factory.mktemp("analyze") / "run")


def test_analysis_goes_to_the_run_folder_and_to_a_wandb_run_of_its_own(trained, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    (training,) = wandb_records.offline_runs(trained)
    training_log = next(training.glob("*.wandb")).read_bytes()
    with pytest.warns(UserWarning, match="last checkpoint has no key frequency"):
        assert main(["analyze", str(trained), "--probes", "grokking", "--device", "cpu"]) == 0
    assert "W&B is offline" in capsys.readouterr().out

    added = by_step(r for r in read_jsonl(trained / "metrics.jsonl") if "grok/restricted_loss" in r)
    assert sorted(added) == sorted(int(p.name[5:12]) for p in (trained / "checkpoints").glob("step=*.ckpt"))
    (analysis,) = wandb_records.offline_runs(trained / "analyze")
    assert wandb_records.offline_runs(trained) == [training]  # the training run's wandb/ holds it alone
    assert wandb_records.by_step(wandb_records.history(analysis)) == added  # every value, at its step

    events = [e for e in read_jsonl(trained / "events.jsonl") if e["metric"].startswith("grok/")]
    assert events and all("detected_at" not in e for e in events)  # found offline, over all checkpoints
    latest = {}
    for event in events:
        latest.update(transition_summary(event))
    assert {k: v for k, v in wandb_records.summary(analysis).items()
            if k.startswith("transitions/") and k != "transitions/events"} == latest
    table = wandb_records.summary_table(analysis, "transitions/events")  # every event, in order
    assert [row[:5] for row in table["data"]] == [["confirmed", e["metric"], e["direction"], e["onset"], e["midpoint"]]
                                                  for e in events]
    assert wandb_records.alerts(analysis) == []  # alerts are for training runs, while they train

    info = wandb_records.run_info(analysis)
    training_id = (trained / "wandb_id").read_text().strip()
    assert info["name"] == "run-analyze-grokking" and info["job_type"] == "analyze" and info["id"] != training_id
    (record,) = read_jsonl(trained / "analyses.jsonl")
    # the final checkpoint's key frequencies, fixed over the run (analyze's default; this
    # small run has none: said with a warning)
    assert record["options"] == {"grokking": {"key_freqs": []}}
    assert info["config"]["analyze"] == {"probes": ["grokking"], "options": record["options"],
                                         "training_run_id": training_id}
    assert info["config"]["model"]["weight_decay"] == 0.1  # the training run's config, to compare runs by
    assert record["wandb_id"] == info["id"] and record["device"] == "cpu"
    # the training run's own W&B log is left as it was
    assert next(training.glob("*.wandb")).read_bytes() == training_log

    # --no_wandb: the values again, no W&B run
    assert main(["analyze", str(trained), "--probes", "grokking", "--replace", "--no_wandb"]) == 0
    assert wandb_records.offline_runs(trained) == [training]
    assert wandb_records.offline_runs(trained / "analyze") == [analysis]  # no new W&B run
    assert list(read_jsonl(trained / "analyses.jsonl"))[-1]["wandb_id"] is None
    assert by_step(r for r in read_jsonl(trained / "metrics.jsonl") if "grok/restricted_loss" in r) == added


def independent_key_frequencies(w_l: np.ndarray) -> list[int]:
    """Key frequencies of a neuron-logit map (residue x neuron) by numpy's FFT: frequencies
    1..(p-1)/2 with more than twice the uniform share of the power, strongest first."""
    p = w_l.shape[0]
    power = (np.abs(np.fft.rfft(w_l, axis=0)) ** 2).sum(axis=1)[1:(p - 1) // 2 + 1]
    share = power / power.sum()
    return [int(k) + 1 for k in np.argsort(-share) if share[k] > 2 / len(share)]


def plant_fourier_unembedding(run, path, amplitudes: dict[int, float]) -> None:
    """Give the checkpoint at `path` an unembedding whose answer classes c lie along
    sum_k a_k cos(2 pi k c / p) in one residual direction: its W_L then holds exactly the
    frequencies k, with norms in the ratio of a_k^2."""
    from phasewatch.cli.analyze import load_run_module, load_weights

    module = load_weights(load_run_module(run), path)
    p = module.task.p
    c = torch.arange(p, dtype=torch.float32)
    head = module.model.original_model.head.weight  # (d_vocab_out, d_model): W_U transposed
    with torch.no_grad():
        head.zero_()
        head[:p, 0] = sum(a * torch.cos(2 * np.pi * k * c / p) for k, a in amplitudes.items())
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"] = module.state_dict()
    torch.save(checkpoint, path)


def test_analyze_measures_every_checkpoint_with_the_last_checkpoints_key_frequencies(trained, tmp_path, capsys):
    """The paper's way: the key frequencies of the run's last checkpoint (found here by an
    FFT of its W_L), used at every checkpoint and recorded in the analysis; null gives
    each checkpoint's own, as during training. The small run forms no Fourier circuit in
    its 300 steps, so its last checkpoint gets one: frequencies 2 and 4 (shares 0.55, 0.45
    of W_L, both over twice the uniform 1/5 at p = 11); the earlier checkpoints have none."""
    import shutil

    from phasewatch.cli.analyze import load_run_module, load_weights

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    checkpoints = sorted((run / "checkpoints").glob("step=*.ckpt"))
    last_step = int(checkpoints[-1].name[5:12])
    plant_fourier_unembedding(run, checkpoints[-1], {2: 1.0, 4: 0.9})
    module = load_weights(load_run_module(run), checkpoints[-1])
    p = module.task.p
    w_l = (module.model.W_out[0] @ module.model.W_U[:, :p]).T.detach().double().numpy()
    expected = independent_key_frequencies(w_l)
    assert expected == [2, 4]

    assert main(["analyze", str(run), "--probes", "grokking", "--no_wandb", "--replace"]) == 0
    assert f"with {{'key_freqs': {expected}}} (from the last checkpoint, step {last_step})" in capsys.readouterr().out
    record = list(read_jsonl(run / "analyses.jsonl"))[-1]
    assert record["options"] == {"grokking": {"key_freqs": expected}} and record["options_from_step"] == last_step
    used = sorted((run / "arrays" / "grokking" / "key_freqs").glob("step=*.npy"))
    assert len(used) == len(checkpoints) and all(np.load(u).tolist() == expected for u in used)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r]
    assert len(rows) == len(checkpoints)
    assert all(r["grok/n_key_freqs"] == 2 and {"grok/key_freq/2", "grok/key_freq/4"} <= set(r) for r in rows)

    # each checkpoint's own (the live default), asked for explicitly
    assert main(["analyze", str(run), "--probes", "grokking", "--no_wandb", "--replace",
                 "--options", '{"grokking": {"key_freqs": null}}']) == 0
    record = list(read_jsonl(run / "analyses.jsonl"))[-1]
    assert record["options"] == {"grokking": {"key_freqs": None}} and record["options_from_step"] is None
    own = {int(u.name[5:12]): np.load(u).tolist() for u in (run / "arrays" / "grokking" / "key_freqs").glob("*.npy")}
    assert own[last_step] == expected and all(v == [] for step, v in own.items() if step != last_step)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r]
    assert len(rows) == len(checkpoints)  # the per-frequency keys of the fixed set went with the others
    assert [r["step"] for r in rows if "grok/key_freq/2" in r] == [last_step]


def test_replacing_drops_the_earlier_members_of_a_per_frequency_family():
    from phasewatch.cli.analyze import same_families

    old = {"grok/key_freq/7", "grok/excluded_loss/7", "grok/key_freq/2", "grok/restricted_loss", "val/loss",
           "heads/induction/L0H1"}
    grokking = old - {"val/loss", "heads/induction/L0H1"}
    assert same_families(old, {"grok/key_freq/2", "grok/excluded_loss/2", "grok/restricted_loss"}) == grokking
    assert same_families(old, {"grok/restricted_loss"}) == grokking  # a first checkpoint without key frequencies
    assert same_families(old, {"heads/induction/max"}) == {"heads/induction/L0H1"}


@pytest.mark.parametrize("options, says", [
    ('{"grokking": {"key_freqs": [0, 2]}}', "[0] is not a frequency of p = 11"),
    ('{"grokking": {"key_freqs": [2, 2]}}', "[2] given more than once"),
    ('{"grokking": {"key_freqs": "last"}}', "expected 'final', a list of frequencies or null")])
def test_bad_key_frequencies_are_refused_by_analyze_before_anything_is_written(trained, capsys, options, says):
    before = (trained / "metrics.jsonl").read_bytes(), sorted(p.name for p in trained.rglob("*"))
    assert main(["analyze", str(trained), "--probes", "grokking", "--replace", "--options", options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "probes.options.grokking.key_freqs" in err
    assert ((trained / "metrics.jsonl").read_bytes(), sorted(p.name for p in trained.rglob("*"))) == before


def test_final_key_frequencies_are_refused_during_fit(tmp_path, capsys):
    """While a run trains its last checkpoint does not exist: "final" is one line saying
    what to do instead, not a measurement with some other set."""
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TASKS["modular_addition"], "--trainer.max_steps", "4",
                 "--trainer.enable_progress_bar", "false", "--no_wandb", "--model.arch.d_model", "16",
                 "--model.arch.d_mlp", "32", "--probes.options", '{"grokking": {"key_freqs": "final"}}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key_freqs: 'final'" in err and "phasewatch analyze RUN_DIR --probes grokking" in err
    assert not any("grok/" in key for r in read_jsonl(run / "metrics.jsonl") for key in r)


def test_replace_leaves_no_array_from_the_earlier_measurement(trained, tmp_path):
    """Arrays are saved per step: values from an earlier analysis at steps the new one
    does not measure must not stay beside the new ones."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    assert main(["analyze", str(run), "--probes", "grokking", "--no_wandb", "--replace"]) == 0
    spectrum = run / "arrays" / "grokking" / "spectrum"
    before = sorted(p.name for p in spectrum.glob("step=*.npy"))
    last = sorted((run / "checkpoints").glob("step=*.ckpt"))[-1]
    last.unlink()  # the new analysis measures one checkpoint fewer
    assert main(["analyze", str(run), "--probes", "grokking", "--no_wandb", "--replace"]) == 0
    after = sorted(p.name for p in spectrum.glob("step=*.npy"))
    assert after == before[:-1] == [p.name.replace(".ckpt", ".npy") for p in
                                    sorted((run / "checkpoints").glob("step=*.ckpt"))]


def test_the_analysis_run_joins_the_training_runs_group(tmp_path, monkeypatch):
    """A sweep's runs are grouped under its name (WANDB_RUN_GROUP); their analyses, run
    later without that variable, join the same group."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep-x")
    run = tmp_path / "run"
    short = [a if a != "300" else "30" for a in GROKKING_RUN]  # 30 steps
    assert main(["fit", "--run_dir", str(run), *short]) == 0
    (training,) = wandb_records.offline_runs(run)
    assert wandb_records.run_info(training)["group"] == "sweep-x"
    monkeypatch.delenv("WANDB_RUN_GROUP")
    assert main(["analyze", str(run), "--probes", "grokking"]) == 0
    # the analysis's W&B run is kept apart: the training run's wandb/ (what the README says to sync) is untouched
    assert wandb_records.offline_runs(run) == [training]
    assert (run / "wandb" / "latest-run").resolve() == training.resolve()
    (analysis,) = wandb_records.offline_runs(run / "analyze")
    info = wandb_records.run_info(analysis)
    assert info["group"] == "sweep-x" and info["job_type"] == "analyze"


def test_a_run_trained_without_wandb_is_analysed_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TASKS["modular_addition"], "--trainer.max_steps", "8",
                 "--trainer.val_check_interval", "4", "--trainer.enable_progress_bar", "false", "--no_wandb",
                 "--probes.names", "[]", "--model.arch.d_model", "16", "--model.arch.d_mlp", "32"]) == 0
    assert main(["analyze", str(run), "--probes", "grokking"]) == 0
    assert not (run / "wandb").exists() and not (run / "analyze").exists()
    assert list(read_jsonl(run / "analyses.jsonl"))[-1]["wandb_id"] is None


def test_a_wandb_failure_does_not_stop_the_analysis(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # trained without a W&B run, W&B still on in its config
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TASKS["modular_addition"], "--trainer.max_steps", "8",
                 "--trainer.val_check_interval", "4", "--trainer.enable_progress_bar", "false",
                 "--probes.names", "[]", "--model.arch.d_model", "16", "--model.arch.d_mlp", "32"]) == 0
    monkeypatch.setenv("WANDB_MODE", "offline")
    (run / "analyze").mkdir()
    (run / "analyze" / "wandb").write_text("not a directory")  # W&B cannot create the analysis's folder
    with pytest.warns(UserWarning, match="W&B logging failed"):
        assert main(["analyze", str(run), "--probes", "grokking"]) == 0
    steps = sorted(int(p.name[5:12]) for p in (run / "checkpoints").glob("step=*.ckpt"))
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r] == steps
    assert list(read_jsonl(run / "analyses.jsonl"))[-1]["wandb_id"] is None


@pytest.mark.slow  # about a minute of CPU: CI time (runs with --runslow)
def test_probes_get_the_runs_configured_options_under_those_given(trained, tmp_path):
    """A run whose config sets probe options (e.g. an LLC step size calibrated for its
    model) is analysed with them; --options overrides single settings."""
    import shutil

    import numpy as np
    import yaml

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["probes"]["options"] = {"llc": {"chains": 1, "draws": 4, "burn_in": 3, "step_size": 1e-5},
                                   "heads": {"unused": 1}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["analyze", str(run), "--probes", "llc", "--no_wandb", "--options", '{"llc": {"draws": 6}}']) == 0
    analysis = list(read_jsonl(run / "analyses.jsonl"))[-1]  # the fixture's run may have been analysed before
    assert analysis["probes"] == ["llc"] and analysis["options"] == {"llc": {"chains": 1, "draws": 6, "burn_in": 3, "step_size": 1e-5}}
    traces = sorted((run / "arrays" / "llc" / "trace").glob("step=*.npy"))
    assert traces and all(np.load(t).shape == (1, 3 + 6) for t in traces)  # 1 chain of burn-in + draws


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
@pytest.mark.parametrize("device, says", [("cuda", "sees no CUDA GPU"), ("gpu0", "is not a device"),
                                          ("meta", "probes run on cpu or cuda")])
def test_a_device_this_machine_lacks_is_refused_before_anything_is_written(trained, capsys, device, says):
    before = (trained / "metrics.jsonl").read_bytes(), sorted(p.name for p in trained.rglob("*"))
    assert main(["analyze", str(trained), "--probes", "grokking", "--device", device]) == 2
    err = capsys.readouterr().err
    assert says in err and "--device" in err
    assert ((trained / "metrics.jsonl").read_bytes(), sorted(p.name for p in trained.rglob("*"))) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probes_on_the_gpu_give_the_cpu_values(trained, tmp_path):
    """On a GPU machine: the same probes over the same checkpoints, on cuda and on the CPU."""
    import shutil

    values = {}
    for device in ("cpu", "cuda"):
        copy = tmp_path / device
        shutil.copytree(trained, copy)
        assert main(["analyze", str(copy), "--probes", "grokking", "heads", "--device", device, "--no_wandb",
                     "--replace"]) == 0
        values[device] = by_step(r for r in read_jsonl(copy / "metrics.jsonl") if "grok/restricted_loss" in r)
    assert values["cuda"].keys() == values["cpu"].keys()
    for step, cpu in values["cpu"].items():
        assert values["cuda"][step] == pytest.approx(cpu, rel=1e-3, abs=1e-4), step


def test_analyze_says_what_each_kind_of_target_needs(trained, tmp_path, capsys):
    assert main(["analyze", str(trained)]) == 2
    assert "needs the probes to run" in capsys.readouterr().err
    paper_file = tmp_path / "model.pth"
    paper_file.write_bytes(b"")
    assert main(["analyze", str(paper_file), "--probes", "llc"]) == 2
    assert "apply to run folders" in capsys.readouterr().err
    before = (trained / "metrics.jsonl").read_bytes()
    assert main(["analyze", str(trained), "--probes", "grokking", "--options", '{"llc": {"step_size": 3e-5}}']) == 2
    assert "options for 'llc', which is not a probe being run" in capsys.readouterr().err
    assert main(["analyze", str(trained), "--probes", "llc", "--options", '{"llc": 3e-5}']) == 2
    assert "options.llc: expected a mapping of option names" in capsys.readouterr().err
    assert (trained / "metrics.jsonl").read_bytes() == before
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    help_text = capsys.readouterr().out
    assert "RUN_DIR|FILE.pth" in help_text and "--probes" in help_text and "--device" in help_text

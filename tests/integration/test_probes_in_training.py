"""Probes running inside `phasewatch fit`: on their schedule, at validations, into the run folder."""

import numpy as np

from phasewatch.cli.main import main
from phasewatch.rundir import read_jsonl

from phasewatch.loggers.wandb_logger import transition_summary

from . import wandb_records
from .test_fit import TASKS, TINY, fit


def by_step(records) -> dict[int, dict]:
    """metrics.jsonl's lines merged per step."""
    merged: dict[int, dict] = {}
    for record in records:
        record = dict(record)
        merged.setdefault(record.pop("step"), {}).update(record)
    return merged


def test_grokking_probe_runs_on_its_schedule_and_saves_arrays(tmp_path):
    run = tmp_path / "run"
    assert fit(run, *TASKS["modular_addition"], "--probes.schedule.kind", "list",
               "--probes.schedule.steps", "[0, 5, 12]") == 0
    grok = [r for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r]
    assert [r["step"] for r in grok] == [0, 5, 12]
    assert all(r["grok/weight_norm"] > 0 and 0 <= r["grok/gini_embed"] <= 1 for r in grok)
    spectra = sorted((run / "arrays" / "grokking" / "spectrum").iterdir())
    assert [p.name for p in spectra] == ["step=0000000.npy", "step=0000005.npy", "step=0000012.npy"]
    assert np.load(spectra[0]).shape == (6,)  # (13 - 1) / 2 frequencies
    assert "- grokking" in (run / "config.yaml").read_text()


def test_digit_probe_runs_at_every_validation(tiny_runs):
    run = tiny_runs("digit_addition")  # fit(run, *TASKS["digit_addition"]) (conftest.py)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "digits/loss/0" in r]
    assert [r["step"] for r in rows] == [0, 4, 8, 12]  # the initial weights, then every validation
    assert all(set(r) >= {f"digits/{m}/{i}" for m in ("loss", "acc") for i in range(3)} for r in rows)


def test_unknown_or_inapplicable_probe_is_refused(tmp_path, capsys):
    assert main(["fit", "--run_dir", str(tmp_path / "a"), "--probes.names", "[nope]", "--no_wandb"]) == 2
    assert "unknown probe 'nope'" in capsys.readouterr().err
    assert main(["fit", "--run_dir", str(tmp_path / "b"), "--probes.names", "[digit_tokens]", "--no_wandb"]) == 2
    assert "does not apply" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_options_for_a_misspelt_probe_are_refused_not_ignored(tmp_path, capsys):
    """Options keyed by a name no probe has would otherwise be dropped without a word."""
    assert main(["fit", "--run_dir", str(tmp_path / "a"), "--probes.options", '{"lcc": {"step_size": 3e-5}}',
                 "--no_wandb"]) == 2
    err = capsys.readouterr().err
    assert "options for 'lcc', which is not a registered probe" in err and "llc" in err
    assert not (tmp_path / "a").exists()


def test_a_probe_budget_of_nothing_keeps_the_probes_on_their_schedule_and_says_so(tmp_path, capsys):
    """Adaptive resolution still adds checkpoints on its dense grid; with --probes.budget 0
    no probe runs there (every probe's cost is known after its first runs on the schedule).
    200 steps: onsets pending away from the schedule's 44 steps (10 added checkpoints; at 100
    steps the schedule holds nearly every step and the grid adds none)."""
    from phasewatch.callbacks.schedule import Schedule

    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TASKS["modular_addition"], "--data.task.p", "11",
                 "--trainer.max_steps", "200", "--trainer.val_check_interval", "10",
                 "--model.weight_decay", "0.1", "--model.arch.d_model", "32", "--model.arch.d_mlp", "64",
                 "--model.arch.n_heads", "2", "--model.arch.d_head", "16", "--trainer.enable_progress_bar", "false",
                 "--transitions.every_n_validations", "3", "--probes.budget", "0", "--no_wandb"]) == 0
    scheduled = set(Schedule(kind="log", count=60).resolve(200))
    extra = {int(p.stem.split("=")[1]) for p in (run / "checkpoints").glob("step=*.ckpt")} - scheduled
    probed = {r["step"] for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r}
    assert extra and probed == scheduled
    out = capsys.readouterr().out
    assert "adaptive resolution added 0 probe runs, left out" in out and "grokking" in out
    assert "within 0% of training time" in out


def test_live_transition_detector_writes_events_and_everything_reaches_wandb(tmp_path, capsys, monkeypatch):
    """Every event of the live watcher in events.jsonl, on the console (verbose) and in the W&B
    run. 200 steps: onsets, withdrawals and confirmations of the Fourier measures, memorisation
    (train/acc up) confirmed at ~117 and again at the end, onsets withdrawn when training ends."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TASKS["modular_addition"], "--data.task.p", "11",
                 "--trainer.max_steps", "200", "--trainer.val_check_interval", "10",
                 "--model.weight_decay", "0.1", "--model.arch.d_model", "32", "--model.arch.d_mlp", "64",
                 "--model.arch.n_heads", "2", "--model.arch.d_head", "16", "--trainer.enable_progress_bar", "false",
                 "--transitions.every_n_validations", "3", "--probes.budget", "null", "--transitions.verbose", "true"]) == 0
    everything = list(read_jsonl(run / "events.jsonl"))
    fields = {"onset": {"metric", "direction", "onset", "detected_at", "stage", "snr", "confidence", "scale"},
              "withdrawn": {"metric", "direction", "onset", "detected_at", "stage", "reason", "scale"},
              "confirmed": {"metric", "direction", "onset", "midpoint", "end", "magnitude", "detected_at",
                            "kind", "steepest", "snr", "confidence", "stage", "scale"}}
    assert all(set(e) == fields[e["stage"]] for e in everything), [
        (e["stage"], set(e) ^ fields[e["stage"]]) for e in everything if set(e) != fields[e["stage"]]]
    events = [e for e in everything if e["stage"] == "confirmed"]
    assert events and all(e["kind"] == "transition" for e in events)
    # the last validation (step 200) has no look of its own: the final look follows, and an onset
    # said there would be withdrawn at once (this run's val/acc and val/seq_acc were)
    assert not [e for e in everything if e["stage"] == "onset" and e["detected_at"] == 200]
    assert all(e["onset"] <= e["midpoint"] <= e["end"] <= e["detected_at"] for e in events)
    # a confirmed transition that had an onset event had it earlier, from the same series (an
    # onset that began after its end is the next change's: with looks between validations it
    # can be said soon after the confirmation)
    for e in events:
        onsets = [o for o in everything if o["stage"] == "onset" and o["metric"] == e["metric"]
                  and o["direction"] == e["direction"] and e["onset"] / 1.5 <= o["onset"] <= e["end"]]
        assert all(o["detected_at"] < e["detected_at"] for o in onsets)
    # adaptive resolution: checkpoints and probe values off the probes' schedule exist only on the
    # watcher's dense grid, while some onset was pending (from its step to 3 x it at most)
    from phasewatch.callbacks.schedule import Schedule
    scheduled, grid = set(Schedule(kind="log", count=60).resolve(200)), set(Schedule(kind="log", count=200).resolve(200))
    saved = {int(p.stem.split("=")[1]) for p in (run / "checkpoints").glob("step=*.ckpt")}
    extra = saved - scheduled
    onsets = [e["detected_at"] for e in everything if e["stage"] == "onset"]
    assert scheduled <= saved and extra and extra <= grid, (sorted(saved), onsets)
    assert all(any(at <= s <= 3 * at for at in onsets) for s in extra)
    probed = {r["step"] for r in read_jsonl(run / "metrics.jsonl") if "grok/restricted_loss" in r}
    assert extra <= probed  # the scheduled probes ran there too
    acc = [e for e in events if e["metric"] == "train/acc"]
    assert acc and acc[0]["direction"] == "up"  # memorisation of the training pairs
    # losses watched in log10 of their values, accuracies as they are (phases/scale.py)
    assert all(e["scale"] == "log" for e in everything if e["metric"].endswith("/loss"))
    assert all(e["scale"] == "linear" for e in everything if e["metric"].endswith("/acc"))
    out = capsys.readouterr().out  # --transitions.verbose true: every event has its line
    assert f"transition in train/acc (up) from step {acc[0]['onset']}" in out
    for e in everything:  # a change still under way when training ended is not said to be no transition
        if e["stage"] == "withdrawn" and e["reason"] == "training ended":
            assert (f"withdrawn: training ended before the change in {e['metric']} ({e['direction']}) from step "
                    f"{e['onset']} was confirmed as a transition") in out
    keys = [(e["metric"], e["direction"], e["onset"]) for e in events]
    assert len(keys) == len(set(keys))  # each reported once

    # the W&B run (read back from its offline transaction log) has every value of the run folder
    (offline,) = wandb_records.offline_runs(run)
    assert wandb_records.by_step(wandb_records.history(offline)) == by_step(read_jsonl(run / "metrics.jsonl"))
    latest = {}  # the summary keeps the latest confirmed transition of each series and direction
    for event in events:
        latest.update(transition_summary(event))
    assert {k: v for k, v in wandb_records.summary(offline).items()
            if k.startswith("transitions/") and k != "transitions/events"} == latest
    # every event is a row of the events table, in order
    table = wandb_records.summary_table(offline, "transitions/events")
    assert table["columns"][:3] == ["stage", "metric", "direction"]
    assert [row[:4] for row in table["data"]] == [[e["stage"], e["metric"], e["direction"], e["onset"]]
                                                   for e in everything]
    # the alerts are the stages': one per stage said confirmed (the stages table's rows), each
    # with its summary; none per series, though headline series were confirmed
    from phasewatch.probes.keys import headline_keys
    assert any(e["metric"] in headline_keys() for e in events)
    stages = wandb_records.summary_table(offline, "stages/table")["data"]
    confirmed = [row for row in stages if row[1] == "confirmed"]
    alerts = wandb_records.alerts(offline)
    assert confirmed and sorted(a["title"] for a in alerts) == sorted(
        f"stage {row[0]} {row[2] or '(unnamed)'}" for row in confirmed)
    assert all(a["text"].startswith(" ".join(a["title"].split()[:2]) + " ") for a in alerts)
    info = wandb_records.run_info(offline)
    assert info["id"] == (run / "wandb_id").read_text().strip() and info["name"] == "run"
    assert info["config"]["model"]["weight_decay"] == 0.1


def test_llc_keeps_its_own_log_schedule_and_training_is_unaffected(tmp_path):
    """Asked for without a schedule, llc runs at its 24 log-spaced steps; it samples the
    model's own parameters and puts them back, so training goes on exactly as without it."""
    from phasewatch.callbacks.schedule import Schedule

    with_llc, without = tmp_path / "llc", tmp_path / "none"
    assert fit(with_llc, *TASKS["induction"], "--probes.names", "[llc]", "--probes.options",
               '{"llc": {"chains": 1, "draws": 4, "burn_in": 2, "pool": 2}}', steps=40) == 0
    assert fit(without, *TASKS["induction"], "--probes.names", "[]", steps=40) == 0
    records = list(read_jsonl(with_llc / "metrics.jsonl"))
    steps = [r["step"] for r in records if "llc/converged" in r]
    assert steps == Schedule(kind="log", count=24).resolve(40) and len(steps) > 15
    assert all(r["llc/loss_star"] > 0 and "llc/estimate" in r for r in records if "llc/converged" in r)
    losses = lambda run: [r["train/loss"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]  # noqa: E731
    assert losses(with_llc) == losses(without)


def test_a_costly_probe_can_have_its_own_sparse_schedule(tmp_path):
    run = tmp_path / "run"
    assert fit(run, *TASKS["modular_addition"], "--probes.names", "[grokking, llc]",
               "--probes.schedules", '{"llc": {"kind": "list", "steps": [0, 12]}}',
               "--probes.options", '{"llc": {"chains": 1, "draws": 5, "burn_in": 2, "step_size": 1e-7}}') == 0
    records = list(read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in records if "llc/converged" in r] == [0, 12]
    assert len([r for r in records if "grok/weight_norm" in r]) > 2  # the others keep their schedule
    assert sorted((run / "arrays" / "llc" / "trace").iterdir())


def test_adaptive_resolution_runs_densely_only_the_probes_whose_series_are_in_transition(tmp_path):
    """A RASP run with the tracr and ablation probes: a step that adaptive resolution added
    has a probe's values only when an onset of one of its series, or of a series that no probe
    logs (the loss, the accuracy), was found before it and no longer ago than `dense_for`
    (3) x its step allows; and there are such steps where one of them ran and the other did not.
    100 steps: the tracr probe's series have onsets from step 15 on, the ablation's from 45
    (tracr alone at 16 added steps, both at 29); 150 steps added only more steps where both ran."""
    from phasewatch.callbacks.schedule import Schedule

    run = tmp_path / "run"
    assert main(["fit", "--run_dir", str(run), *TASKS["rasp"], *TINY, "--probes.names", "[tracr, ablation]",
                 "--trainer.max_steps", "100", "--trainer.val_check_interval", "15", "--no_wandb",
                 # looks at validations only: onsets enough to test the rule, and not the grid's
                 # extra onsets, each densifying the two costliest probes (the grid: test_look_schedule)
                 "--transitions.looks", "0"]) == 0
    scheduled = set(Schedule(kind="log", count=60).resolve(100))
    onsets = [e for e in read_jsonl(run / "events.jsonl") if e["stage"] == "onset"]
    ran = {name: {r["step"] for r in read_jsonl(run / "metrics.jsonl") if key in r} - scheduled
           for name, key in (("tracr", "tracr/agreement"), ("ablation", "ablation/L0.attn/acc"))}
    for name, steps in ran.items():
        for step in steps:
            assert any(o["detected_at"] <= step <= 3 * o["detected_at"]
                       and (o["metric"].startswith(f"{name}/") or o["metric"].split("/")[0] not in ran)
                       for o in onsets), (name, step)
    assert ran["tracr"] ^ ran["ablation"], ran  # only one of them at some added step

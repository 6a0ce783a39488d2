"""Sweeps: the shipped W&B sweep files, `phasewatch sweep` (parallel, resumable),
`phasewatch compare` and `phasewatch analyze RUN_DIR --probes` on real runs."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from phasewatch.cli.main import main
from phasewatch.errors import ConfigError
from phasewatch.cli.sweep import LocalSweep, command_for, load_sweep_file

from . import warm

REPO = Path(__file__).resolve().parents[2]
SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))
MAX_STEPS = 120
#: 10 log-spaced checkpoints of the weights (not ~40, dense ones added): each run's trajectory
#: and the analysis of its checkpoints read a quarter of the files
CHECKPOINTS = "--checkpoints.schedule.count=10, --checkpoints.weights_only=true, --checkpoints.dense_per_decade=0,"
TINY = f"""
name: tiny
method: grid
metric: {{name: val/acc, goal: maximize}}
parameters:
  model.weight_decay: {{values: [0.5, 1.0]}}
  data.task.frac_train: {{values: [0.5, 0.7]}}
command: ["${{env}}", phasewatch, fit, --config, configs/quickstart.yaml, --data.task.p=23,
          --trainer.max_steps={MAX_STEPS}, --trainer.val_check_interval=10, "--probes.names=[]",
          {CHECKPOINTS}
          --report.every_n_validations=1000, "${{args}}"]
"""


def _lookup(cfg: dict, dotted: str):
    """A dotted CLI flag's value in a printed config (class_path/init_args shorthand allowed)."""
    node = cfg
    for part in dotted.split("."):
        if part not in node and "init_args" in node:
            node = node["init_args"]
        node = node[part]
    return node


def test_sweep_files_exist_for_each_study():
    assert {p.stem for p in SWEEP_FILES} >= {"grokking", "induction", "digit_addition", "reverse"}


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_sweep_file_parameters_are_fit_flags(path, tmp_path, capsys, monkeypatch):
    """Every parameter of every sweep file lands at its own place in the resolved config
    of the sweep's first run (parsed by the real CLI parser)."""
    monkeypatch.chdir(REPO)
    config = load_sweep_file(path)
    assert config["method"] in ("grid", "random", "bayes")
    first = LocalSweep(path, tmp_path / "out").planned(1)[0]
    cmd = command_for(config, first["params"], path)
    assert cmd[:4] == [sys.executable, "-m", "phasewatch", "fit"]
    with pytest.raises(SystemExit) as exit_:
        main(cmd[3:] + ["--print_config"])
    assert exit_.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    for name, value in first["params"].items():
        assert _lookup(printed, name) == value, name
    assert not (tmp_path / "out").exists()  # planning writes nothing


def test_bad_sweep_files_are_refused_clearly(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    cases = {
        "method: grid\nparameters: {model.lr: {values: [1]}}\ncommand: [python, train.py, '${args}']\n": "phasewatch fit",
        "method: gridd\nparameters: {model.lr: {values: [1]}}\n": "not a valid W&B sweep",
        "method: grid\n": "no parameters",
        "method: random\nparameters: {model.lr: {min: 0.0001, max: 0.01}}\n"
        "command: ['${env}', phasewatch, fit, '${args}']\n": "--count",
    }
    for text, expected in cases.items():
        bad.write_text(text)
        assert main(["sweep", str(bad), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("phasewatch: error: ") and expected in err, (text, err)
    assert not (tmp_path / "o").exists()


def _sweep(tmp_path, *args) -> subprocess.Popen:
    env = dict(os.environ, WANDB_MODE="offline")
    return subprocess.Popen([sys.executable, "-m", "phasewatch", "sweep", str(tmp_path / "tiny.yaml"),
                             "--out", str(tmp_path / "out"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _state(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "sweep.json").read_text())


def _warm_sweep(monkeypatch, *args) -> int:
    """`phasewatch sweep ARGS` in this process, its runs' processes started warm (tests/integration/warm.py)."""
    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", warm.popen(subprocess.Popen))
        return main(["sweep", *map(str, args)])


def test_offline_grid_sweep_in_parallel_then_compare_and_analyze(tmp_path, capsys, monkeypatch, warm_phasewatch):
    (tmp_path / "tiny.yaml").write_text(TINY)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WANDB_MODE", "offline")
    # each run on one thread whatever the machine's cores (the sweep's default is cores // parallel):
    # the assertions below read the runs' trajectories (the final val/acc, the train/acc rise)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = _warm_sweep(monkeypatch, tmp_path / "tiny.yaml", "--out", tmp_path / "out", "--parallel", "2")
    assert code == 0, capsys.readouterr().out
    runs = _state(tmp_path)["runs"]
    assert [r["state"] for r in runs] == ["finished"] * 4
    assert sorted((r["params"]["model.weight_decay"], r["params"]["data.task.frac_train"]) for r in runs) == [
        (0.5, 0.5), (0.5, 0.7), (1.0, 0.5), (1.0, 0.7)]
    # two at a time: some runs overlapped in time, never more than two
    spans = [(r["start_time"], r["end_time"]) for r in runs]
    overlap = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(overlap) == 2
    folders = {tmp_path / "out" / r["name"] for r in runs}
    assert len(folders) == 4
    for folder, run in zip(sorted(folders), sorted(runs, key=lambda r: r["name"])):
        cfg = yaml.safe_load((folder / "config.yaml").read_text())
        assert cfg["model"]["weight_decay"] == run["params"]["model.weight_decay"]
        assert cfg["data"]["task"]["init_args"]["frac_train"] == run["params"]["data.task.frac_train"]
        assert cfg["run_dir"] == str(folder)
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert max(m["step"] for m in metrics) == MAX_STEPS
        assert (folder / "checkpoints" / "last.ckpt").exists()
        assert list((folder / "wandb").glob("offline-run-*"))  # an offline W&B run to sync later
        assert run["summary"]["val/acc"] == [m["val/acc"] for m in metrics if "val/acc" in m][-1]

    assert main(["compare", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    for row, run in zip(rows, runs):
        assert row["run"] == run["name"] and float(row["model.weight_decay"]) == run["params"]["model.weight_decay"]
        # every tiny run memorises its training set: an upward train/acc transition inside the run
        assert 0 < float(row["train/acc up"]) <= MAX_STEPS
    # the larger training fraction generalises better in 120 steps
    final = {(float(r["data.task.frac_train"]), float(r["model.weight_decay"])): float(r["final val/acc"]) for r in rows}
    assert final[(0.7, 0.5)] > final[(0.5, 0.5)] and final[(0.7, 1.0)] > final[(0.5, 1.0)]

    # probes after the fact, over the saved checkpoints of one run
    run_dir = tmp_path / "out" / runs[0]["name"]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step=*.ckpt"))
    assert main(["analyze", str(run_dir), "--probes", "grokking"]) == 0
    added = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "grok/restricted_loss" in line]
    assert [f"step={m['step']:07d}.ckpt" for m in added] == checkpoints
    assert len(list((run_dir / "arrays" / "grokking" / "key_freqs").glob("*.npy"))) == len(checkpoints)
    capsys.readouterr()
    assert main(["analyze", str(run_dir), "--probes", "grokking"]) == 2
    assert "--replace" in capsys.readouterr().err
    assert main(["analyze", str(run_dir), "--probes", "grokking", "--replace"]) == 0
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "grok/restricted_loss" in line]
    assert again == added  # same checkpoints, same numbers, no duplicates
    analyses = [json.loads(line) for line in (run_dir / "analyses.jsonl").read_text().splitlines()]
    assert [(a["probes"], a["replace"]) for a in analyses] == [(["grokking"], False), (["grokking"], True)]
    assert analyses[0]["steps"] == [m["step"] for m in added]  # the refused analysis wrote nothing


@pytest.mark.slow  # two minutes of sweep processes; a resumed run's files are tested in test_fit.py
def test_an_interrupted_sweep_resumes_without_rerunning_finished_runs(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY.replace("[0.5, 0.7]", "[0.5]"))  # 2 runs
    proc = _sweep(tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until the first run finished and the second has a checkpoint
        time.sleep(0.5)
        try:
            runs = _state(tmp_path)["runs"]
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if (len(runs) == 2 and runs[0]["state"] == "finished"
                and list((tmp_path / "out" / runs[1]["name"] / "checkpoints").glob("step=*.ckpt"))):
            break
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "run the same command again to resume" in out
    runs = _state(tmp_path)["runs"]
    assert [r["state"] for r in runs] == ["finished", "stopped"]
    first_metrics = (tmp_path / "out" / runs[0]["name"] / "metrics.jsonl").read_bytes()

    proc = _sweep(tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "resuming sweep tiny" in out and "1 runs done, 1 to continue" in out
    runs = _state(tmp_path)["runs"]
    assert [r["state"] for r in runs] == ["finished", "finished"]
    assert (tmp_path / "out" / runs[0]["name"] / "metrics.jsonl").read_bytes() == first_metrics
    log = (tmp_path / "out" / "logs" / f"{runs[1]['name']}.log").read_text()
    assert "Restoring states from the checkpoint" in log or "Restored all states" in log
    # continued without a repeat or a gap: the same lines in the same order as the run that
    # was never interrupted (their values differ: another weight decay)
    def layout(run):
        lines = (tmp_path / "out" / run["name"] / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], tuple(sorted(r))) for r in map(json.loads, lines)]

    resumed, reference = layout(runs[1]), layout(runs[0])
    assert resumed == reference
    assert max(step for step, _ in resumed) == MAX_STEPS


def test_a_run_started_by_wandb_agent_takes_the_agents_run_id(tmp_path, monkeypatch):
    """`wandb agent` sets WANDB_SWEEP_ID and WANDB_RUN_ID for each run it starts; the run
    must use that id (or W&B would not count it in the sweep) and get its own folder."""
    from phasewatch.rundir import RunFolder, default_run_dir
    from phasewatch.loggers.wandb_logger import make_wandb_logger

    monkeypatch.setenv("WANDB_SWEEP_ID", "sw33p")
    monkeypatch.setenv("WANDB_RUN_ID", "agentrun1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert default_run_dir("induction") == Path("runs") / "sweep-sw33p" / "agentrun1"
    folder = RunFolder(tmp_path / "run")
    folder.create()
    logger = make_wandb_logger(folder, "run", "phasewatch-test", {})
    assert (folder.root / "wandb_id").read_text().strip() == "agentrun1"
    assert logger.version == "agentrun1"
    monkeypatch.delenv("WANDB_SWEEP_ID")
    monkeypatch.delenv("WANDB_RUN_ID")
    assert default_run_dir("induction").parent == Path("runs")


def test_without_the_sweep_engine_the_error_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sweeps", None)  # import sweeps -> ImportError
    assert main(["sweep", str(SWEEP_FILES[0]), "--dry-run"]) == 2
    assert "pip install --no-deps sweeps==0.3.0" in capsys.readouterr().err


#: `python -c` that runs phasewatch in an environment lacking a module (argv[1]): what `pip install
#: --no-deps sweeps==0.3.0` leaves when the `sweep` extra's requirements were not installed
WITHOUT_MODULE = """
import sys
missing = sys.argv.pop(1)

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name == missing or name.startswith(missing + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
sys.argv[0] = "phasewatch"
from phasewatch.cli.main import console_main
console_main()
"""


def test_a_missing_requirement_of_the_sweep_engine_is_named_with_the_install_line_that_works():
    """The engine installed without its requirements (`--no-deps`, as its numpy pin asks): the
    error names the missing module and gives the one line that installs both, not 'not installed'."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_MODULE, "jsonschema", "sweep", str(SWEEP_FILES[0]), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("phasewatch: error: sweep: ") and "'jsonschema'" in line and "not installed" in line
    assert "the `sweeps` package) is not installed" not in line  # the engine is there; its requirement is not
    assert line.endswith('pip install -e ".[sweep]" && pip install --no-deps sweeps==0.3.0')


def test_an_empty_wandb_mode_variable_means_unset(tmp_path, monkeypatch):
    from phasewatch.rundir import RunFolder
    from phasewatch.loggers.wandb_logger import make_wandb_logger

    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: offline
    store = RunFolder(tmp_path / "run")
    store.create()
    logger = make_wandb_logger(store, "run", "phasewatch-test", {})
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    assert not logger._failed and list((store.root / "wandb").glob("offline-run-*"))


def test_a_grid_over_seeds_packs_into_populations(tmp_path, monkeypatch, warm_phasewatch):
    """seed_everything x weight decay: the two seeds of each weight decay train as one
    population (one process each); every grid point's run is a member folder with exactly
    its configuration, and compare reads the seeds as a distribution per weight decay."""
    sweep = TINY.replace("max_steps={MAX_STEPS}".format(MAX_STEPS=MAX_STEPS), "max_steps=30").replace(
        "  data.task.frac_train: {values: [0.5, 0.7]}", "  seed_everything: {values: [3, 4]}")
    (tmp_path / "seeds.yaml").write_text(sweep)
    out = tmp_path / "out"
    assert _warm_sweep(monkeypatch, tmp_path / "seeds.yaml", "--out", out, "--parallel", "2") == 0
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r["state"] for r in runs] == ["finished"] * 4
    assert len({r["pack"] for r in runs}) == 2
    for run in runs:
        pack = {r["params"]["seed_everything"] for r in runs if r["pack"] == run["pack"]}
        assert pack == {3, 4}  # one population per weight decay, both seeds in it
        cfg = yaml.safe_load((out / run["folder"] / "config.yaml").read_text())
        assert cfg["seed_everything"] == run["params"]["seed_everything"]
        assert cfg["model"]["weight_decay"] == run["params"]["model.weight_decay"]
        assert cfg["data"]["task"]["init_args"]["seed"] == 0  # the grid point's data seed, not the member's
        assert max(json.loads(line)["step"] for line in (out / run["folder"] / "metrics.jsonl").open()) == 30
    assert main(["compare", str(out)]) == 0
    with open(out / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows[:4]] == [r["name"] for r in runs]
    summary = [r for r in rows if r["state"] == "2 seeds"]
    assert sorted((r["run"], float(r["model.weight_decay"])) for r in summary) == sorted(
        (stat, wd) for stat in ("n", "median", "q25", "q75", "min", "max") for wd in (0.5, 1.0))


def test_packing_makes_populations_of_the_seeds_of_each_grid_point_only(tmp_path, monkeypatch):
    """Which processes a sweep starts: one population per grid point with 2+ seeds (each seed
    given as a range, never read as a count), a run alone for a grid point left with one seed,
    and no packing for a sweep whose runs set what a population refuses."""
    monkeypatch.chdir(REPO)
    sweep = TINY.replace("  data.task.frac_train: {values: [0.5, 0.7]}", "  seed_everything: {values: [3, 4]}")
    (tmp_path / "seeds.yaml").write_text(sweep)
    local = LocalSweep(tmp_path / "seeds.yaml", tmp_path / "out")
    assert local.pack
    runs = local.planned()
    units = local.units(runs[:3])  # the count cut the second weight decay's seeds to one
    assert [len(u) for u in units] == [2, 1] and "pack" not in units[1][0]
    cmd = local.command(units[0])
    assert cmd[cmd.index("--population.seeds") + 1] == "3-3,4-4"
    assert "--population.seeds" not in local.command(units[1])
    alone = LocalSweep(tmp_path / "seeds.yaml", tmp_path / "out2", pack=False)
    fresh = alone.planned()
    assert alone.units(fresh) == [[r] for r in fresh]
    assert [len(u) for u in alone.units(runs[:2])] == [2]  # runs packed before stay in their pack
    clipped = tmp_path / "clip.yaml"
    clipped.write_text(sweep.replace("--report.every_n_validations=1000,", "--report.every_n_validations=1000, "
                                     "--trainer.gradient_clip_val=1.0,"))
    assert not LocalSweep(clipped, tmp_path / "out3").pack
    with pytest.raises(ConfigError, match="packs into populations"):
        LocalSweep(clipped, tmp_path / "out4", pack=True)
    seeded = tmp_path / "seeded.yaml"  # the architecture's own seed, in the class_path/init_args form
    seeded.write_text("model:\n  arch:\n    class_path: phasewatch.models.ModelConfig\n    init_args: {seed: 3}\n")
    (tmp_path / "arch.yaml").write_text(sweep.replace("--data.task.p=23,", f"--data.task.p=23, --config, {seeded},"))
    assert not LocalSweep(tmp_path / "arch.yaml", tmp_path / "out5").pack

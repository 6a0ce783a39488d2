"""Checkpoint trajectories of a real run: drawn at the end of `fit` and by `phasewatch
report` (no `phasewatch trajectory` needed), redrawn when out of date, and by `phasewatch
trajectory` itself."""

import shutil

import numpy as np
import yaml

from phasewatch.rundir import RunFolder
from phasewatch.cli.main import main

from .conftest import copy_run


def test_trajectory_of_a_run_and_its_place_in_the_report(tmp_path, capsys, modular_run):
    run = copy_run(modular_run, tmp_path / "run")  # a fit's folder (conftest.py), to redraw and thin
    folder = RunFolder(run)
    checkpoints = list(folder.checkpoint_steps())
    figure = run / "figures" / "trajectory.png"

    def coordinates_of(steps, kinds=("logits", "weights")):
        for kind in kinds:
            pca = np.load(run / "arrays" / "trajectory" / kind / "pca.npy")
            assert pca.shape == (len(steps), 3) and pca[:, 0].tolist() == steps
            assert np.isfinite(pca).all() and np.abs(pca[:, 1]).max() > 0

    # fit drew it, and its report shows it
    assert figure.stat().st_size > 20_000
    coordinates_of(checkpoints)
    assert "Checkpoint trajectory" in (run / "report.html").read_text()
    # the report draws the trajectory itself
    shutil.rmtree(run / "arrays" / "trajectory")
    figure.unlink()
    assert main(["report", str(run)]) == 0
    assert figure.stat().st_size > 20_000
    coordinates_of(checkpoints)
    assert "Checkpoint trajectory" in (run / "report.html").read_text()
    # up to date: kept as it is; out of date (other checkpoints than it shows): drawn again
    drawn = figure.stat().st_mtime_ns
    assert main(["report", str(run)]) == 0 and figure.stat().st_mtime_ns == drawn
    folder.checkpoint_steps()[checkpoints[1]].unlink()
    assert main(["report", str(run)]) == 0
    coordinates_of(checkpoints[:1] + checkpoints[2:])

    # a config the report may not rebuild a model from: the report without the trajectory, and why
    crafted = tmp_path / "crafted"
    shutil.copytree(run, crafted, ignore=shutil.ignore_patterns("figures", "trajectory", "report.html"))
    config = yaml.safe_load((crafted / "config.yaml").read_text())
    config["data"]["task"]["class_path"] = "elsewhere.Task"
    (crafted / "config.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["report", str(crafted)]) == 0
    assert "phasewatch: no checkpoint trajectory in the report: " in capsys.readouterr().err
    assert "Checkpoint trajectory" not in (crafted / "report.html").read_text()

    # phasewatch trajectory (one kind: the other's coordinates stay as they were)
    figure.unlink()
    (run / "arrays" / "trajectory" / "weights" / "pca.npy").unlink()
    assert main(["trajectory", str(run), "--kind", "weights"]) == 0
    assert figure.stat().st_size > 10_000
    coordinates_of(checkpoints[:1] + checkpoints[2:], ("weights",))
    capsys.readouterr()
    assert main(["trajectory", str(tmp_path / "nothing")]) == 2
    assert "saved checkpoints" in capsys.readouterr().err

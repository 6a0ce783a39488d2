"""`phasewatch trajectory` on a real run: PCA paths of its checkpoints, in the report."""

import numpy as np

from phasewatch.trainers.cli import main


def test_trajectory_of_a_run_and_its_place_in_the_report(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--data.task.p", "23", "--data.task.frac_train", "0.7", "--trainer.max_steps", "120",
                 "--trainer.val_check_interval", "20", "--probes.names", "[]", "--run_dir", str(run), "--no_wandb",
                 "--trainer.enable_progress_bar", "false"]) == 0
    checkpoints = sorted(int(p.stem.split("=")[1]) for p in (run / "checkpoints").glob("step=*.ckpt"))
    assert main(["trajectory", str(run)]) == 0
    assert (run / "figures" / "trajectory.png").stat().st_size > 20_000
    for kind in ("logits", "weights"):
        pca = np.load(run / "arrays" / "trajectory" / kind / "pca.npy")
        assert pca.shape == (len(checkpoints), 3) and pca[:, 0].tolist() == checkpoints
        assert np.isfinite(pca).all() and np.abs(pca[:, 1]).max() > 0
    assert main(["report", str(run)]) == 0
    assert "Checkpoint trajectory" in (run / "report.html").read_text()
    capsys.readouterr()
    assert main(["trajectory", str(tmp_path / "nothing")]) == 2
    assert "saved checkpoints" in capsys.readouterr().err

"""The stages in W&B (loggers/wandb_logger.py `log_stage`), read back from a real offline run:
the stages table (one row per stage, its latest news) and one alert per confirmed stage."""

from phasewatch.loggers.wandb_logger import STAGE_COLUMNS, make_wandb_logger
from phasewatch.phases.stages import Stage
from phasewatch.rundir import RunFolder

from . import wandb_records


def member(series, direction, onset, midpoint, end):
    return {"metric": series, "series": series, "direction": direction, "onset": onset, "midpoint": midpoint,
            "end": end, "magnitude": 1.0, "kind": "transition"}


def test_the_stages_table_and_an_alert_per_confirmed_stage_in_an_offline_run(tmp_path, monkeypatch):
    for key, value in wandb_records.offline_env().items():
        monkeypatch.setenv(key, value)
    folder = RunFolder(tmp_path / "run")
    folder.create()
    logger = make_wandb_logger(folder, "run", "phasewatch-test", {})
    first = Stage(1, 20, 35, 70, [member("train/acc", "up", 20, 35, 60), member("train/loss", "down", 25, 40, 70)],
                  "train/acc", "memorisation")
    second = Stage(2, 200, 300, 450, [member("grok/weight_norm", "down", 200, 300, 450)], "grok/weight_norm")
    third = Stage(3, 600, 700, 800, [member("val/loss", "down", 600, 700, 800)], "val/loss", under_way_at_end=True)
    for what, stage in [("begins", first), ("confirmed", first), ("begins", second), ("begins", third),
                        ("confirmed", third), ("withdrawn", Stage(2, 900, 900, 900, [], ""))]:
        logger.log_stage(what, stage)
    logger.finalize("success")
    assert not logger.failed
    (offline,) = wandb_records.offline_runs(folder.root)
    table = wandb_records.summary_table(offline, "stages/table")
    assert table["columns"] == list(STAGE_COLUMNS)
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert [(k, r["said"], r["name"]) for k, r in sorted(rows.items())] == [
        (1, "confirmed", "memorisation"), (2, "withdrawn", None), (3, "confirmed", None)]
    assert rows[1]["moved"] == "train/acc up, train/loss down" and (rows[1]["onset"], rows[1]["end"]) == (20, 70)
    assert (rows[1]["under_way_at_end"], rows[3]["under_way_at_end"]) == (False, True)
    alerts = wandb_records.alerts(offline)
    assert [a["title"] for a in alerts] == ["stage 1 memorisation", "stage 3 (unnamed)"]
    assert alerts[0]["text"] == first.summary()

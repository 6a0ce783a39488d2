"""The run folder's append-only files and their rollback on resume."""

import json

from phasewatch.rundir import RunFolder, read_jsonl


def test_rollback_keeps_what_preceded_the_checkpoint_and_drops_the_rest(tmp_path):
    store = RunFolder(tmp_path)
    store.create()
    for step in (0, 4, 9):
        store.append(store.metrics, {"step": step, "train/loss": 1.0})
    store.append(store.metrics, {"step": 10, "val/loss": 2.0})
    snapshot = store.snapshot()  # a checkpoint at step 10, saved after validation
    store.append(store.metrics, {"step": 9, "late": 1.0})  # logged after the save, belongs before it
    store.append(store.metrics, {"step": 14, "train/loss": 0.5})  # will be logged again
    store.append(store.metrics, {"step": 20, "val/loss": 1.5})
    with open(store.metrics, "a") as f:
        f.write('{"step": 24, "train/lo')  # half-written line of the crash
    store.rollback(snapshot, step=10)
    assert [(r["step"], sorted(r)) for r in read_jsonl(store.metrics)] == [
        (0, ["step", "train/loss"]), (4, ["step", "train/loss"]), (9, ["step", "train/loss"]),
        (10, ["step", "val/loss"]), (9, ["late", "step"])]


def test_read_jsonl_skips_a_half_written_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "x"')
    assert list(read_jsonl(path)) == [{"step": 1}]


def test_a_full_disk_is_refused_before_training(tmp_path):
    import shutil

    import pytest

    from phasewatch.errors import ConfigError

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match="MiB free on the disk"):
        RunFolder(tmp_path / "run").create(min_free_bytes=free * 2)  # asks for more than the disk has
    RunFolder(tmp_path / "ok").create()  # the default margin (64 MiB) is there


def test_post_hoc_transitions_replace_earlier_events_of_the_same_series(tmp_path):
    """`phasewatch analyze` detects transitions in the series it added (a drop at step
    ~1,000 on 30 log-spaced checkpoints) and leaves the other events alone; its
    diagnostics (llc/std) are not watched."""
    import math

    import numpy as np

    from phasewatch.cli.analyze import record_transitions

    store = RunFolder(tmp_path)
    store.create()
    steps = sorted({0} | {int(round(s)) for s in np.geomspace(1, 3000, 30)})
    for s in steps:
        drop = 250 / (1 + math.exp(-8 * (math.log(max(s, 1)) - math.log(1000))))
        store.append(store.metrics, {"step": s, "llc/estimate": 300 - drop, "llc/std": 300 - drop})
    store.append(store.events, {"metric": "val/acc", "direction": "up", "onset": 1200, "midpoint": 1500,
                                      "end": 1900, "magnitude": 0.9, "detected_at": 2000})
    store.append(store.events, {"metric": "llc/estimate", "direction": "up", "onset": 5, "midpoint": 6,
                                      "end": 7, "magnitude": 1.0, "detected_at": 10})  # a stale earlier analysis
    found = record_transitions(store, {"llc/estimate", "llc/std"})
    assert [(e["metric"], e["direction"]) for e in found] == [("llc/estimate", "down")]
    assert 700 <= found[0]["midpoint"] <= 1400 and "detected_at" not in found[0]  # found offline
    events = list(read_jsonl(store.events))
    assert [e["metric"] for e in events] == ["val/acc", "llc/estimate"] and events[1] == found[0]


def test_saved_arrays_are_the_bytes_np_save_writes(tmp_path):
    """save_array writes each value as `np.save` does (readers load them as before), makes the
    key's folder at its first array and again after `drop_arrays`."""
    import numpy as np

    folder = RunFolder(tmp_path / "run")
    values = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([["L0H1", "L1H0"]]), [0.25, 1.5],
              ["L0H0"], [], np.float64(2.5), np.array([True, False]), np.asfortranarray(np.eye(3))]
    for step, value in enumerate(values):
        path = folder.save_array("heads", "scores", step, value)
        np.save(tmp_path / "ref.npy", value)
        assert path.read_bytes() == (tmp_path / "ref.npy").read_bytes(), value
    assert [s for s, _ in folder.array_files("heads", "scores")] == list(range(len(values)))
    folder.drop_arrays("heads", "scores")
    folder.save_array("heads", "scores", 9, values[0])
    assert [s for s, _ in folder.array_files("heads", "scores")] == [9]

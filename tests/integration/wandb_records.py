"""What an offline W&B run holds: the records of its `run-<id>.wandb` file, read back.

The file is W&B's transaction log: a 7-byte header (`:W&B`, a 2-byte magic number, a
version byte), then 32 KiB blocks of chunks in the LevelDB log layout (a 4-byte CRC, a
2-byte length, a 1-byte kind: whole, first, middle or last piece of a record). Each record
is a serialised `wandb_internal_pb2.Record` protobuf. Tests use this to check what the
project sent to W&B, value by value, without a server.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32 * 1024
CHUNK_HEADER = 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def offline_runs(run_folder: Path) -> list[Path]:
    """The offline W&B runs under a run folder, oldest first."""
    return sorted((Path(run_folder) / "wandb").glob("offline-run-*"))


def read_records(offline_run: Path, wait: float = 30.0) -> list:
    """The run's records, once the file ends with W&B's `exit` record: `finish()` returns
    to the caller (and the process may exit) while W&B's service process may still be
    creating or writing the file."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + wait
    while True:
        try:
            records = _parse(offline_run) if list(Path(offline_run).glob("run-*.wandb")) else []  # not yet created
        except DecodeError:  # a record cut off mid-write
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{offline_run} has no exit record after {wait:.0f} s: the run was not finished")
        time.sleep(0.2)


def _parse(offline_run: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(offline_run).glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces, records = CHUNK_HEADER, b"", []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pieces = chunk if kind in (WHOLE, FIRST) else pieces + chunk
        if kind in (WHOLE, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(offline_run: Path) -> list[dict]:
    """Every history row W&B recorded, in order, as {key: value}."""
    rows = []
    for record in read_records(offline_run):
        if record.WhichOneof("record_type") == "history":
            rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
    return rows


def summary(offline_run: Path) -> dict:
    """The run's summary after its last update."""
    state: dict = {}
    for record in read_records(offline_run):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                state[_key(item)] = json.loads(item.value_json)
            for item in record.summary.remove:
                state.pop(_key(item), None)
    return state


def summary_table(offline_run: Path, key: str) -> dict:
    """A table kept in the run's summary ({"columns", "data"}), read from the file W&B wrote."""
    ref = summary(offline_run)[key]
    assert ref.get("_type") == "table-file", f"summary key {key!r} is not a table: {ref!r}"
    return json.loads((Path(offline_run) / "files" / ref["path"]).read_text())


def alerts(offline_run: Path) -> list[dict]:
    """The alerts the run sent, in order ({"title", "text", "level"})."""
    return [{"title": r.alert.title, "text": r.alert.text, "level": r.alert.level}
            for r in read_records(offline_run) if r.WhichOneof("record_type") == "alert"]


def offline_env() -> dict:
    """The environment for a child process with an offline W&B run and a W&B service of its own,
    as a user's would be (not this test process's, which earlier tests may have started and which
    outlives a killed child)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_SERVICE", "_WANDB"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    return env


def run_info(offline_run: Path) -> dict:
    """The run record's id, name, group, job type and config (keys as W&B stored them)."""
    for record in read_records(offline_run):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            config = {_key(item): json.loads(item.value_json) for item in run.config.update}
            return {"id": run.run_id, "name": run.display_name, "project": run.project, "group": run.run_group,
                    "job_type": run.job_type, "config": {k: v.get("value", v) if isinstance(v, dict) else v
                                                         for k, v in config.items()}}
    raise AssertionError(f"{offline_run} holds no run record")


def by_step(rows: list[dict]) -> dict[int, dict]:
    """History rows merged per `trainer/global_step` (the project's x-axis), W&B's own
    keys (`_step`, `_runtime`, ...) left out."""
    merged: dict[int, dict] = {}
    for row in rows:
        if "trainer/global_step" in row:
            values = {k: v for k, v in row.items() if not k.startswith("_") and k != "trainer/global_step"}
            merged.setdefault(int(row["trainer/global_step"]), {}).update(values)
    return merged

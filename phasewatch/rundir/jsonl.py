"""JSON-lines and text files of a run folder: appended and flushed, rewritten atomically,
read tolerantly (a half-written last line, left by a crash, is skipped)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from phasewatch.errors import DiskFull, is_disk_full


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines file (none when it does not exist); a half-written last line
    (a crash) is skipped, and so is a line that is not JSON."""
    path = Path(path)
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one record as a line and flush it, so that a reader following the file sees it.
    A full disk is DiskFull (a torn last line is skipped by every reader)."""
    line = json.dumps(record) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
            f.flush()
    except OSError as err:
        if is_disk_full(err):
            raise DiskFull.in_run(Path(path).parent, Path(path).name, len(line)) from None
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it into place: a reader
    sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
    except OSError as err:
        tmp.unlink(missing_ok=True)  # no partial temporary file left behind
        if is_disk_full(err):
            raise DiskFull(path.parent, path.name, len(data),
                           f"Free some space and run the command again; {path} is as it was") from None
        raise
    os.replace(tmp, path)
    return path


def rewrite_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Replace a JSON-lines file by `records` atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def csv_cell(value) -> str:
    """A table cell: empty for None and NaN, floats to 6 significant digits."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_csv(columns: list[str], rows: list[dict], path: str | os.PathLike) -> Path:
    """A CSV table (header `columns`, one line per row; None and NaN as empty cells, floats
    to 6 significant digits), written atomically (`write_atomic`)."""
    import csv
    import io

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_cell(row.get(k)) for k in columns})
    return write_atomic(path, out.getvalue())


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """A CSV table's rows as {column: text}; [] when the file is missing."""
    import csv

    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []

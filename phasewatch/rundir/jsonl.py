"""JSON-lines and text files of a run folder: appended and flushed, rewritten atomically,
read tolerantly (a half-written last line, left by a crash, is skipped)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator


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
    """Append one record as a line and flush it, so that a reader following the file sees it."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it into place: a reader
    sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
    return path


def rewrite_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Replace a JSON-lines file by `records` atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))

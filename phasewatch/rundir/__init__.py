"""The run folder: its layout, atomic writers and tolerant readers.

Every command writes or reads run folders through this package (`RunFolder`), and no
other module spells one of its file names. It sits below everything that touches
Lightning, TransformerLens or W&B: files only.
"""

from phasewatch.rundir.folder import (LAST_CHECKPOINT, RUNS, TRAJECTORY_CHECKPOINTS, RunFolder, SweepFolder, checkpoint_name, default_run_dir,
                                      flatten_config, format_size, is_resume_point, load_series, member_name, pid_alive, read_checkpoint, run_folders,
                                      step_checkpoints)
from phasewatch.rundir.jsonl import append_jsonl, read_jsonl, rewrite_jsonl, write_atomic, write_csv, csv_cell, read_csv
from phasewatch.rundir.series import Series, is_number, read_csv_series, read_series, series_from_records

__all__ = [
    "LAST_CHECKPOINT", "RUNS", "TRAJECTORY_CHECKPOINTS", "RunFolder", "Series", "SweepFolder", "append_jsonl", "checkpoint_name", "default_run_dir",
    "flatten_config", "format_size", "is_number", "is_resume_point", "load_series", "member_name", "pid_alive", "read_checkpoint", "read_csv_series", "read_jsonl", "read_series", "rewrite_jsonl", "run_folders",
    "series_from_records", "step_checkpoints", "write_atomic", "write_csv", "csv_cell", "read_csv",
]

"""What a `fit` prints besides its own lines: library start-up noise that phasewatch causes is
silenced (`quiet_libraries`), and a finished run ends with a summary (`fit_summary`): where it
stopped, its final losses, its stages (or its headline transitions), where the report and the
run folder are and how big, how to upload the W&B run and how to go on training."""

from __future__ import annotations

import logging
import warnings
from typing import Any

#: Lightning's lines that say nothing the config and the end-of-run summary do not (its
#: advertisement, absent hardware, the seed, the reason fit stopped)
_LIGHTNING_NOISE = ("💡 Tip", "TPU available", "HPU available", "Seed set to", "`Trainer.fit` stopped")
#: warnings that phasewatch's own, intended choices cause: its module moves batches itself
#: (transfer_batch_to_device with a datamodule), and Lightning's pytree check under torch>=2.10
_INTENDED_WARNINGS = (r".*overridden `transfer_batch_to_device`.*", r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
#: the final values the summary shows, where the run has them
_FINAL_KEYS = ("train/loss", "val/loss", "train/acc", "val/acc")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_LIGHTNING_NOISE)


def quiet_libraries() -> None:
    """Silence the start-up lines and warnings that libraries print because of phasewatch's
    own choices; every other warning stays."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines())
    for message in _INTENDED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def _number(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _final_values(rows: list[dict[str, Any]]) -> tuple[int | None, dict[str, float]]:
    last: dict[str, float] = {}
    step = None
    for row in rows:
        step = row.get("step", step)
        for key in _FINAL_KEYS:
            if isinstance(row.get(key), (int, float)):
                last[key] = float(row[key])
    return step, last


def _what_happened(folder) -> list[str]:
    """The run's stages, one line each, or where no stage was found, its headline transitions."""
    from phasewatch.probes import keys

    if folder.stages.exists():
        from phasewatch.phases.stages import read_stages

        stages = read_stages(folder)
        if stages:
            return [f"  {stage.summary()}" for stage in stages]
    headline = set(keys.headline_keys())
    transitions = folder.transitions()
    found = [e for e in transitions if e.get("metric") in headline]
    lines = [f"  {e['metric']} {e.get('direction', '')} from step {e.get('onset')} to {e.get('end')} "
             f"(midpoint {e.get('midpoint')})" for e in sorted(found, key=lambda e: e.get("midpoint", 0))]
    total = len(transitions)
    if total > len(found):
        lines.append(f"  {total} transitions in all series: phasewatch phases {folder.root} --series")
    return lines or ["  no transition found in the headline series (train/val loss and accuracy)"]


def fit_summary(folder, max_steps: int | None = None) -> list[str]:
    """The lines that end a finished fit of the run folder `folder` (a RunFolder)."""
    from phasewatch.loggers.wandb_logger import wandb_mode
    from phasewatch.rundir import format_size

    step, final = _final_values(folder.read_metrics())
    of = f" of {max_steps}" if max_steps else ""
    lines = [f"phasewatch: finished at step {step}{of}: "
             + "  ".join(f"{k} {_number(v)}" for k, v in final.items())]
    lines += _what_happened(folder)
    if folder.report.exists():
        lines.append(f"  report: {folder.report}")
    lines.append(f"  run folder: {folder.root} ({format_size(folder.size_bytes())})")
    if wandb_mode() == "offline" and folder.wandb_dir.exists():
        lines.append(f"  upload to W&B: wandb sync {folder.wandb_dir}/offline-run-*")
    longer = f" --trainer.max_steps {2 * max_steps}" if max_steps else " --trainer.max_steps N"
    lines.append(f"  train on: phasewatch fit --run_dir {folder.root} --ckpt_path last{longer}")
    return lines


def max_steps_of(folder) -> int | None:
    """The run's `trainer.max_steps` from its config, where it says."""
    try:
        value = folder.read_config().get("trainer", {}).get("max_steps")
    except Exception:  # noqa: BLE001 - a summary line is not worth an error
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


"""Probes after the fact: `phasewatch analyze RUN_DIR --probes NAME ...`.

Use it for probes added after a run, or too costly to run while training (e.g. `llc`):
it rebuilds the run's task and model from `config.yaml`, loads each saved checkpoint
(`checkpoints/step=<N>.ckpt`, in step order) and runs the probes on it, exactly as
during training. Scalars are appended to `metrics.jsonl` under each checkpoint's step,
arrays go to `arrays/<probe>/<key>/step=<N>.npy`. Transitions in the new series (those
live detection would watch) are detected over all checkpoints and appended to
`events.jsonl` (without `detected_at`: found offline), replacing earlier events of the
same series; the report and `phasewatch phases` then show them
with everything else.

Probes get the options the run's config gave them (`probes.options`, e.g. the LLC step
size calibrated for its model), updated with `options` (`--options`). Each analysis is
recorded in `analyses.jsonl` (probes, the options used, device, steps, time, and the id
of its W&B run).

The values also go to W&B, into a new run beside the training run (`<run>-analyze-<probes>`,
job type `analyze`, the training run's config, logged against `trainer/global_step` like
the training run; see `make_analysis_logger`), unless W&B is disabled or the run was trained with
`--no_wandb`. Probes run on `device`: the GPU when there is one, unless told otherwise.

Refuses (ConfigError, nothing written) a folder without a config or checkpoints, an
unknown probe or one that does not apply to the task, options for a probe not being run,
a run another process is writing,
and probes whose keys the run already has, in metrics.jsonl or as arrays (pass
`replace=True` / `--replace` to drop the old values of those keys first, arrays included).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from phasewatch.callbacks.probes import is_scalar, measure, record_results
from phasewatch.callbacks.runfiles import read_jsonl, read_series
from phasewatch.callbacks.transitions import DETAIL
from phasewatch.probes import check_options, get_probe
from phasewatch.tasks.base import ConfigError, Task
from phasewatch.trainers.model import ModelConfig
from phasewatch.trainers.module import TrainModule
from phasewatch.trainers.run_store import RunStore

#: one line per `phasewatch analyze` of the run: probes, options, checkpoint steps, when
ANALYSES = "analyses.jsonl"


def load_run_module(run_dir: str | os.PathLike) -> TrainModule:
    """The run's TrainModule (task and architecture from its config.yaml, fresh weights)."""
    store = RunStore(run_dir)
    if not store.config.exists():
        raise ConfigError("run_dir", f"{store.config} does not exist", "Give a run folder written by phasewatch fit.")
    cfg = yaml.safe_load(store.config.read_text())
    spec = cfg["data"]["task"]
    module_name, _, class_name = spec["class_path"].rpartition(".")
    task: Task = getattr(importlib.import_module(module_name), class_name)(**(spec.get("init_args") or {}))
    model_cfg = dict(cfg.get("model") or {})
    model_cfg["arch"] = ModelConfig(**(model_cfg.get("arch") or {}))
    model_cfg.pop("task", None)
    if isinstance(model_cfg.get("betas"), list):
        model_cfg["betas"] = tuple(model_cfg["betas"])
    return TrainModule(task=task, **model_cfg)


def run_options(config: dict[str, Any], names: list[str], given: dict[str, dict]) -> dict[str, dict]:
    """The options for the probes `names`: those the run's config gives them
    (`probes.options`, e.g. a step size calibrated for its model), updated with `given`."""
    saved = (config.get("probes") or {}).get("options") or {}
    merged = {n: {**(saved.get(n) or {}), **(given.get(n) or {})} for n in names}
    return {n: o for n, o in merged.items() if o}


def load_weights(module: TrainModule, path: str | os.PathLike) -> TrainModule:
    """Put a saved checkpoint's weights into the module (this project's own file), on the
    module's device."""
    module.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["state_dict"])
    return module


def resolve_device(device: str | None) -> torch.device:
    """`auto`/None: the CUDA GPU when there is one, else the CPU; otherwise the device named,
    refused when this machine does not have it."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError("device", f"{device!r} is not a device ({err})", "Give --device cpu, cuda, cuda:N or auto.")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{device!r} asked for, but this PyTorch sees no CUDA GPU",
                          "Use --device cpu, or install a CUDA build of PyTorch on a machine with a GPU.")
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise ConfigError("device", f"{device!r} asked for, but there are {torch.cuda.device_count()} GPUs",
                          f"Give --device cuda:0..cuda:{torch.cuda.device_count() - 1}.")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"{device!r}: probes run on cpu or cuda", "Give --device cpu, cuda or auto.")
    return resolved


def checkpoint_steps(run_dir: str | os.PathLike) -> dict[int, Path]:
    """step -> checkpoint file, for the run's step=<N>.ckpt files."""
    found = {}
    for path in RunStore(run_dir).checkpoints.glob("step=*.ckpt"):
        match = re.fullmatch(r"step=(\d+)\.ckpt", path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def analyze_run(run_dir: str | os.PathLike, names: list[str], options: dict[str, dict] | None = None,
                replace: bool = False, progress: bool = True, device: str | None = None,
                wandb: bool = True) -> list[int]:
    """Run `names` on every saved checkpoint of the run; returns the steps measured."""
    from tqdm import tqdm

    from phasewatch.trainers.wandb_logging import make_analysis_logger

    check_options(options or {}, "options", running=list(names))
    store = RunStore(run_dir)
    on = resolve_device(device)
    module = load_run_module(run_dir).to(on)
    run_config = yaml.safe_load(store.config.read_text()) or {}
    probes = [get_probe(n, module.task) for n in names]
    options = run_options(run_config, names, options or {})
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ConfigError("run_dir", f"no step=<N>.ckpt checkpoints in {store.checkpoints}",
                          "Train with a checkpoint schedule (the default saves 30 log-spaced ones).")
    store.acquire_lock()
    try:
        first_step, first = next(iter(steps.items()))
        load_weights(module, first)
        first_results = measure(module.model, module.task, probes, options)
        keys = {k for r in first_results.values() for k in r}
        existing = {k for record in store.read_metrics() for k in record} & keys
        # array values (arrays/<probe>/<key>/step=<N>.npy) are kept per step: old ones at
        # steps this analysis does not measure would mix with the new ones
        arrays = [store.root / "arrays" / p / k for p, r in first_results.items() for k, v in r.items()
                  if not is_scalar(v)]
        old_arrays = [a for a in arrays if any(a.glob("step=*.npy"))]
        found = sorted(existing) + [str(a.relative_to(store.root)) for a in old_arrays]
        if found and not replace:
            raise ConfigError("probes", f"{store.root} already has {found[:5]}"
                                        f"{f' and {len(found) - 5} more' if len(found) > 5 else ''}",
                              "Pass --replace to measure them again (their old values are dropped).")
        if existing:
            _drop_keys(store, existing)
        for folder in old_arrays:
            shutil.rmtree(folder)
        wandb_logger = make_analysis_logger(store, run_config if wandb else {"wandb": False}, names, options)
        ok = False
        try:
            for step, path in tqdm(steps.items(), desc=f"analyze {', '.join(names)}", unit="ckpt",
                                   disable=not progress):
                if step == first_step:
                    results = first_results  # measured above
                else:
                    load_weights(module, path)
                    results = measure(module.model, module.task, probes, options)
                scalars = record_results(results, store.root, step)
                if scalars:
                    store.append_jsonl(store.metrics, {"step": step, **scalars})
                    if wandb_logger:
                        wandb_logger.log_metrics(scalars, step=step)
            events = record_transitions(store, keys)
            if wandb_logger:
                for event in events:
                    wandb_logger.log_event(event)
            ok = True
        finally:
            if wandb_logger:
                wandb_logger.finalize("success" if ok else "failed")
        # what produced these values (a run's own probes are in config.yaml)
        store.append_jsonl(store.root / ANALYSES, {
            "probes": names, "options": options, "device": str(on), "steps": list(steps), "replace": replace,
            "wandb_id": wandb_logger.version if wandb_logger and not wandb_logger.failed else None,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    finally:
        store.release_lock()
    return list(steps)


def record_transitions(store: RunStore, keys: set[str]) -> list[dict]:
    """Detect transitions in the watched ones among `keys` and put them in events.jsonl
    in place of any earlier events of those keys; returns them (each also printed)."""
    from phasewatch.probes.transitions import detect_all

    watched = {k: v for k, v in read_series(store.metrics).items() if k in keys and not DETAIL.search(k)}
    events = detect_all(watched)  # offline detection: no detected_at (DESIGN.md)
    old = list(read_jsonl(store.events))
    kept = [e for e in old if e.get("metric") not in keys]
    if len(kept) != len(old):
        store.rewrite_jsonl(store.events, kept)
    for event in events:
        store.append_jsonl(store.events, event)
        print(f"phasewatch: transition in {event['metric']} ({event['direction']}) from step {event['onset']} "
              f"to {event['end']}, midpoint {event['midpoint']}, magnitude {event['magnitude']:.4g}")
    return events


def _drop_keys(store: RunStore, keys: set[str]) -> None:
    """Rewrite metrics.jsonl without `keys` (atomically), dropping lines left with only a step."""
    kept = [{k: v for k, v in record.items() if k not in keys} for record in store.read_metrics()]
    store.rewrite_jsonl(store.metrics, [r for r in kept if set(r) - {"step"}])


def analyze_run_command(args) -> int:
    """`phasewatch analyze RUN_DIR --probes ...` with the arguments parsed by the CLI."""
    try:
        options: dict[str, Any] = json.loads(args.options) if args.options else {}
    except json.JSONDecodeError as err:
        raise ConfigError("options", f"--options is not JSON ({err})", "Write e.g. '{\"llc\": {\"draws\": 400}}'.")
    steps = analyze_run(args.target, args.probes, options, args.replace, device=args.device,
                        wandb=not args.no_wandb)
    print(f"phasewatch: {', '.join(args.probes)} measured at {len(steps)} checkpoints (steps {steps[0]}-{steps[-1]}); "
          f"values added to {RunStore(args.target).metrics}")
    return 0

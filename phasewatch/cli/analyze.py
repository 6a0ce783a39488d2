"""Probes after the fact: `phasewatch analyze RUN_DIR --probes NAME ... [--options JSON] [--replace]`.

For probes added after a run, or too costly to run while training (e.g. `llc`): rebuilds the
run's task and model from its config (`load_run_config`, fit's own parser), runs the probes on
each saved step checkpoint in step order, as during training, on the GPU when there is one.
Scalars join the run's metrics under each checkpoint's step, arrays the run's arrays; the new
series' transitions, detected over all checkpoints, replace their earlier events (without
`detected_at`: found offline). Options are the run's `probes.options` updated with `--options`,
then completed from the last checkpoint (`Probe.final_options`); each analysis is recorded in
the folder's list of analyses, and the values go to a W&B run of their own (README, "W&B").

Public: `analyze_run`, `analyze_run_command` (the CLI), `load_run_module`, `resolve_device`.
Refuses (ConfigError, nothing written): no config or checkpoints, an unknown or inapplicable
probe, options for a probe not run or that it refuses, a run another process is writing, and
keys the run already has (`--replace` drops their old values first, arrays included).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import torch

from phasewatch.callbacks.probes import frozen_copy, measure, record_results
from phasewatch.probes import check_options, get_probe
from phasewatch.probes.keys import declared_scale, is_detail
from phasewatch.rundir import RunFolder, is_number, read_checkpoint
from phasewatch.errors import ConfigError
from phasewatch.training.lightning_cli import load_run_config
from phasewatch.training.module import TrainModule


def load_run_module(run_dir: str | os.PathLike, allow: tuple[str, ...] = ()) -> TrainModule:
    """The run's TrainModule (task and architecture from its config, fresh weights); classes
    of modules other than phasewatch's and the installed plug-ins' only when `allow` names
    them (`load_run_config`)."""
    return load_run_config(run_dir, allow).model


def run_options(config: dict[str, Any], names: list[str], given: dict[str, dict]) -> dict[str, dict]:
    """The options for the probes `names`: those the run's config gives them
    (`probes.options`, e.g. a step size calibrated for its model), updated with `given`."""
    saved = (config.get("probes") or {}).get("options") or {}
    merged = {n: {**(saved.get(n) or {}), **(given.get(n) or {})} for n in names}
    return {n: o for n, o in merged.items() if o}


def finished_run_options(module: TrainModule, probes: list, options: dict[str, dict],
                         last_checkpoint: str | os.PathLike) -> dict[str, dict]:
    """`options` completed for measuring a finished run: each probe that has
    `final_options` gets its options through it, with the last checkpoint's weights loaded
    into `module` (e.g. the grokking probe's key frequencies "final" become that
    checkpoint's). ConfigError, from the probe, for options it refuses."""
    finals = [p for p in probes if p.final_options is not None]
    if not finals:
        return options
    load_weights(module, last_checkpoint)
    return {**options, **{p.name: p.final_options(module.model, module.task, options.get(p.name, {}))
                          for p in finals}}


def load_weights(module: TrainModule, path: str | os.PathLike) -> TrainModule:
    """Put a saved checkpoint's weights into the module, on the module's device; the file is
    read without running code (`read_checkpoint`: ConfigError naming it when it is missing,
    truncated or not a phasewatch checkpoint)."""
    module.load_state_dict(read_checkpoint(path, field="checkpoint")["state_dict"])
    return module


def initial_model(module: TrainModule, probes: list, steps: dict[int, Any]):
    """The run's step-0 model, from its step-0 checkpoint, for probes that compare with it
    (`Probe.initial`, e.g. the tracr probe's baselines); None when no probe wants it, or
    when the run saved no step-0 checkpoint (said, and those baselines are left out)."""
    wanting = [p.name for p in probes if p.initial]
    if not wanting:
        return None
    if 0 not in steps:
        print(f"phasewatch: no step-0 checkpoint: {', '.join(wanting)} measures without "
              "its baseline on the initial weights")
        return None
    load_weights(module, steps[0])
    return frozen_copy(module.model)


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


def analyze_run(run_dir: str | os.PathLike, names: list[str], options: dict[str, dict] | None = None,
                replace: bool = False, progress: bool = True, device: str | None = None,
                wandb: bool = True, allow: tuple[str, ...] = ()) -> list[int]:
    """Run `names` on every saved checkpoint of the run; returns the steps measured. The
    run's config may name classes of `allow`'s modules and of the probes named by a dotted
    name, besides phasewatch's and the installed plug-ins'."""
    folder = RunFolder(run_dir)
    plan = _plan(run_dir, folder, names, options or {}, resolve_device(device), allow)
    folder.acquire_lock()
    try:
        wandb_id = _measure_every_checkpoint(folder, plan, replace, progress, wandb)
        # what produced these values (a run's own probes are in its config)
        folder.add_analysis({
            "probes": plan.names, "options": plan.options, "options_from_step": plan.options_from_step,
            "device": str(plan.device), "steps": list(plan.steps), "replace": replace, "wandb_id": wandb_id,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    finally:
        folder.release_lock()
    return list(plan.steps)


@dataclasses.dataclass
class _Plan:
    """What one analysis measures: the run's module (on `device`) and config, the probes and
    their options (completed from the last checkpoint at `options_from_step`, or None), and
    the step checkpoints {step: file}."""

    module: TrainModule
    config: dict[str, Any]
    probes: list
    options: dict[str, dict]
    options_from_step: int | None
    steps: dict[int, Any]
    device: torch.device

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.probes]


def _plan(run_dir: str | os.PathLike, folder: RunFolder, names: list[str], options: dict[str, dict],
          device: torch.device, allow: tuple[str, ...]) -> _Plan:
    """The run rebuilt, its probes and options checked and completed, its checkpoints listed;
    ConfigError (nothing written) for what cannot be measured."""
    named = tuple(n.partition(":")[0] for n in names if ":" in n)
    run = load_run_config(run_dir, tuple(allow) + named)
    module = run.model.to(device)
    probes = [get_probe(n, module.task) for n in names]
    names = [p.name for p in probes]  # a plug-in named by its dotted path measures under its own name
    check_options(options, "options", running=names)
    given = run_options(run.config, names, options)
    steps = folder.checkpoint_steps()
    if not steps:
        raise ConfigError("run_dir", f"no step checkpoints in {folder.checkpoints}",
                          "Train with a checkpoint schedule (the default saves 30 log-spaced ones).")
    last_step, last = next(reversed(steps.items()))
    completed = finished_run_options(module, probes, given, last)
    for name in names:
        if completed.get(name) != given.get(name):
            print(f"phasewatch: {name} measures every checkpoint with {completed[name]} "
                  f"(from the last checkpoint, step {last_step})")
    return _Plan(module, run.config, probes, completed, last_step if completed != given else None, steps, device)


def _measure_every_checkpoint(folder: RunFolder, plan: _Plan, replace: bool, progress: bool,
                              wandb: bool) -> str | None:
    """The probes on each checkpoint in step order, their values and then their transitions
    into the run folder and to the analysis' W&B run; that run's id (None without one)."""
    from tqdm import tqdm

    from phasewatch.loggers.wandb_logger import make_analysis_logger

    module, probes, options = plan.module, plan.probes, plan.options
    initial = initial_model(module, probes, plan.steps)
    first_step, first = next(iter(plan.steps.items()))
    load_weights(module, first)
    first_results = measure(module.model, module.task, probes, options, initial)
    keys = {k for r in first_results.values() for k in r}
    _clear_earlier_values(folder, first_results, keys, replace)
    wandb_logger = make_analysis_logger(folder, plan.config if wandb else {"wandb": False}, plan.names, options)
    ok = False
    try:
        for step, path in tqdm(plan.steps.items(), desc=f"analyze {', '.join(plan.names)}", unit="ckpt",
                               disable=not progress):
            if step == first_step:
                results = first_results  # measured above
            else:
                load_weights(module, path)
                results = measure(module.model, module.task, probes, options, initial)
            _record_step(folder, results, step, wandb_logger)
        events = record_transitions(folder, keys)
        if wandb_logger:
            for event in events:
                wandb_logger.log_event(event)
        ok = True
    finally:
        if wandb_logger:
            wandb_logger.finalize("success" if ok else "failed")
    return wandb_logger.version if wandb_logger and not wandb_logger.failed else None


def _clear_earlier_values(folder: RunFolder, first_results: dict[str, dict], keys: set[str], replace: bool) -> None:
    """ConfigError when the run already has values of these probes' keys (or arrays) and
    `replace` is off; with `replace`, drop them. Array values are kept per step: old ones at
    steps this analysis does not measure would mix with the new ones."""
    existing = same_families({k for record in folder.read_metrics() for k in record}, keys)
    old_arrays = [(p, k) for p, r in first_results.items() for k, v in r.items()
                  if not is_number(v) and folder.array_files(p, k)]
    found = sorted(existing) + [str(folder.array_folder(p, k).relative_to(folder.root)) for p, k in old_arrays]
    if found and not replace:
        raise ConfigError("probes", f"{folder.root} already has {found[:5]}"
                                    f"{f' and {len(found) - 5} more' if len(found) > 5 else ''}",
                          "Pass --replace to measure them again (their old values are dropped).")
    if existing:
        _drop_keys(folder, existing)
    for probe, key in old_arrays:
        folder.drop_arrays(probe, key)


def _record_step(folder: RunFolder, results: dict[str, dict], step: int, wandb_logger) -> None:
    """One checkpoint's values into the run folder's metrics and arrays, and to W&B."""
    scalars = record_results(results, folder, step)
    if scalars:
        folder.append(folder.metrics, {"step": step, **scalars})
        if wandb_logger:
            wandb_logger.log_metrics(scalars, step=step)


def record_transitions(folder: RunFolder, keys: set[str]) -> list[dict]:
    """Detect transitions in the watched ones among `keys` and put them in the run's events
    in place of any earlier events of those keys; returns them (each also printed)."""
    from phasewatch.phases.detector import detect_all

    watched = {k: v for k, v in folder.series().items() if k in keys and not is_detail(k)}
    events = detect_all(watched, declared=declared_scale)  # offline: no detected_at (phases/events.py)
    old = folder.read_events()
    kept = [e for e in old if e.get("metric") not in keys]
    if len(kept) != len(old):
        folder.rewrite(folder.events, kept)
    for event in events:
        folder.append(folder.events, event)
        print(f"phasewatch: transition in {event['metric']} ({event['direction']}) from step {event['onset']} "
              f"to {event['end']}, midpoint {event['midpoint']}, magnitude {event['magnitude']:.4g}")
    return events


def same_families(old: set[str], new: set[str]) -> set[str]:
    """The keys of `old` that an analysis measuring `new` replaces: `new`'s own, and the
    detail keys under the same namespaces (e.g. every old `grok/key_freq/<k>` and
    `grok/excluded_loss/<k>` when it measures `grok/...`): a set of key frequencies, or of
    heads, that differs from the earlier measurement's, or from checkpoint to checkpoint,
    must not leave the earlier one's other members beside it."""
    namespaces = tuple({k.partition("/")[0] + "/" for k in new if "/" in k})
    return {k for k in old if k in new or (is_detail(k) and k.startswith(namespaces))}


def _drop_keys(folder: RunFolder, keys: set[str]) -> None:
    """Rewrite the metrics without `keys` (atomically), dropping lines left with only a step."""
    kept = [{k: v for k, v in record.items() if k not in keys} for record in folder.read_metrics()]
    folder.rewrite(folder.metrics, [r for r in kept if set(r) - {"step"}])


def analyze_run_command(args) -> int:
    """`phasewatch analyze RUN_DIR --probes ...` with the arguments parsed by the CLI."""
    try:
        options: dict[str, Any] = json.loads(args.options) if args.options else {}
    except json.JSONDecodeError as err:
        raise ConfigError("options", f"--options is not JSON ({err})", "Write e.g. '{\"llc\": {\"draws\": 400}}'.")
    steps = analyze_run(args.target, args.probes, options, args.replace, device=args.device,
                        wandb=not args.no_wandb, allow=tuple(args.allow or ()))
    print(f"phasewatch: {', '.join(args.probes)} measured at {len(steps)} checkpoints (steps {steps[0]}-{steps[-1]}); "
          f"values added to {RunFolder(args.target).metrics}")
    return 0

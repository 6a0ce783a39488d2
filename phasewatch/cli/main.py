"""`phasewatch fit` and friends: LightningCLI with a run folder, W&B and checkpoints.

    phasewatch fit --config configs/quickstart.yaml [--model.lr 3e-4 ...] [--run_dir runs/x]
    phasewatch fit --run_dir runs/x --ckpt_path last          # resume that run
    phasewatch tasks                                           # list tasks, tracr programs and probes

Every config field is a dotted flag (`phasewatch fit --help` lists them). Invalid values
stop before training with one line naming the field and the fix (exit status 2).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

USAGE = """usage: phasewatch COMMAND [...]

commands:
  fit       train a model on a task (phasewatch fit --config configs/quickstart.yaml)
  validate  evaluate a checkpoint on the task's held-out data
  plot      draw a run's curves: phasewatch plot RUN_DIR [--out FILE.png]
  analyze   probes over a run's saved checkpoints: phasewatch analyze RUN_DIR --probes llc
            (or the progress measures of a grokking-paper checkpoint: phasewatch analyze FILE.pth)
  phases    the stages of a run (series changing together), each series' transitions with --series:
            phasewatch phases RUN_DIR|FILE [--series]
  report    one self-contained HTML report of a run: phasewatch report RUN_DIR [--out FILE.html]
  compile   compile a tracr program, check it, print its layout: phasewatch compile reverse
  sweep     run a W&B sweep file locally: phasewatch sweep sweeps/grokking.yaml [--parallel 2]
  compare   hyperparameters and transition steps of runs or a sweep: phasewatch compare runs/sweep-grokking
  diff      two models' differences per component, and what patching recovers:
            phasewatch diff runs/x@300 runs/x@last, or phasewatch diff runs/x --across val/loss
  trajectory  PCA paths of a run's checkpoints (logits, weights): phasewatch trajectory RUN_DIR
  tasks     list the tasks, the tracr programs they can run, and the probes

phasewatch fit --help lists every configuration flag.
"""


def _lightning_cli(argv: list[str]) -> int:
    """`fit` or `validate`; its exit status. A fit stopped by SIGTERM or Ctrl-C still gets
    what a finished one would (its report and trajectory, from what was written; last.ckpt
    at the step SIGTERM stopped it) and ends with one line saying where it stopped and how to
    resume it, with the status a shell gives a command killed by that signal (143, 130)."""
    from phasewatch.cli.console import quiet_libraries
    from phasewatch.training.lightning_cli import Interrupted, run_lightning_cli

    quiet_libraries()
    try:
        folder = run_lightning_cli(argv)
    except Interrupted as stop:
        import signal

        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores Ctrl-C after the first
        try:
            _finish_fit(stop.folder, interrupted=True)
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the line below matters more
            print(f"phasewatch: the report of the interrupted run was not written ({err!r})", file=sys.stderr)
        print(f"phasewatch: {stop.line()}", file=sys.stderr)
        return stop.status
    if folder is not None:
        _finish_fit(folder)
    return 0


def _finish_fit(folder, interrupted: bool = False) -> None:
    """The figures and reports drawn once a fit has ended: each run's trajectory and report,
    and a population's report (a population's folder holds its members' runs)."""
    from phasewatch.rundir import run_folders

    from phasewatch.cli.console import fit_summary, max_steps_of

    members = not folder.metrics.exists()
    for run in run_folders(folder.root) if members else [folder]:
        _record_stages(run)
        _draw_trajectory(run, always=interrupted, lazy=members)
    if not folder.metrics.exists() and run_folders(folder.root):
        from phasewatch.report.population import write_population_report
        from phasewatch.rundir import format_size

        print(f"phasewatch: population report {write_population_report(folder.root)} "
              f"(folder {format_size(folder.size_bytes())})")
    elif not interrupted and folder.metrics.exists():
        print("\n".join(fit_summary(folder, max_steps_of(folder))))


def _record_stages(folder) -> None:
    """The run's stages (phases/stages.py), from its finished series, into its folder for the
    report and the summary: what `phasewatch phases RUN` prints."""
    import phasewatch.probes  # noqa: F401  (the probes' key declarations: scales, signatures)
    from phasewatch.phases.stages import record_stages
    from phasewatch.probes.keys import stage_rules

    try:
        record_stages(folder, stage_rules())
    except (OSError, ValueError) as err:  # the report and the summary go on without stages
        print(f"phasewatch: the run's stages were not written ({err!r})", file=sys.stderr)


def _draw_trajectory(folder, always: bool = False, lazy: bool = False) -> None:
    """The run's trajectory through its checkpoints (cli/trajectory.py), drawn once a
    fit has ended, and the run's report written again with it (`always`: whether drawn or not,
    e.g. after an interrupted fit, whose last report was a live one). `lazy` (a population's
    members: seconds each): not drawn; the report says how to draw it (`phasewatch report`)."""
    from phasewatch.report.html import write_report
    from phasewatch.errors import ConfigError
    from phasewatch.cli.trajectory import current_trajectory
    from phasewatch.rundir import TRAJECTORY_CHECKPOINTS

    if lazy:
        drawn = len(folder.checkpoint_steps()) >= TRAJECTORY_CHECKPOINTS or None
    else:
        try:
            drawn = current_trajectory(folder.root)
        except ConfigError as err:  # e.g. a config naming classes that may not be rebuilt
            print(f"phasewatch: no checkpoint trajectory: {err}", file=sys.stderr)
            drawn = None
    if (drawn is not None and folder.report.exists()) or (always and folder.metrics.exists()):
        write_report(folder.root)


def list_tasks() -> None:
    from phasewatch.tasks import task_class, task_names
    from phasewatch.tasks.tracr_programs import PROGRAMS

    for name in task_names():
        cls = task_class(name)
        print(f"{name:18s} {cls.__module__}.{cls.__qualname__}")
    print("\ntracr programs for the rasp task (--data.task.program NAME):")
    for name, spec in sorted(PROGRAMS.items()):
        print(f"  {name:14s} {spec.summary} (vocab {list(spec.vocab)}, max_seq_len {spec.max_seq_len}, "
              f"{'causal' if spec.causal else 'non-causal'})"
              + ("\n                 numerical output: trains, but has no compiled reference (no compile, no tracr "
                 "probe)" if spec.numerical_output else ""))
    list_probes({name: task_class(name)() for name in task_names()})


def list_probes(tasks: dict) -> None:
    """Which probe measures which task (with the task's default settings; * = run by default)."""
    from phasewatch.probes import default_probes, get_probe, probe_names

    print("\nprobes (fit --probes.names [...], analyze RUN_DIR --probes ...), the tasks they measure with their "
          "default settings (* = run by default):")
    defaults = {name: default_probes(task) for name, task in tasks.items()}
    for probe in map(get_probe, probe_names()):
        on = sorted((n for n, t in tasks.items() if probe.applies_to(t)), key=lambda n: (probe.name not in defaults[n], n))
        when = "cheap: every validation" if probe.cheap else (
            f"own schedule: {probe.schedule['count']} {probe.schedule['kind']}-spaced steps" if probe.schedule
            else "on the probe schedule")
        print(f"  {probe.name:14s} {', '.join(n + ('*' if probe.name in defaults[n] else '') for n in on):58s} {when}")


def plot_command(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="phasewatch plot",
        description="Draw a run folder's curves as a PNG (and, for RASP runs, the learned-vs-compiled figure beside it).")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: the run folder's figures)")
    args = parser.parse_args(argv)
    from phasewatch.report.tracr_figure import plot_comparison
    from phasewatch.report.curves import plot_run

    try:
        print(plot_run(args.run_dir, args.out))
        comparison = plot_comparison(args.run_dir)  # RASP runs: learned vs compiled
        if comparison is not None:
            print(comparison)
    except FileNotFoundError as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    return 0


def analyze_command(argv: list[str]) -> int:
    """`analyze RUN_DIR --probes ...` (a run folder: cli/analyze.py) or `analyze FILE.pth`
    (a checkpoint of the grokking paper's code)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="phasewatch analyze",
        description="RUN_DIR --probes NAME ...: run probes over a run folder's saved checkpoints and add their "
                    "values, and the transitions found in them, to the folder (and to a W&B run of their own). "
                    "FILE.pth: print the losses and grokking progress measures of a checkpoint saved by the code "
                    "of Nanda et al. 2023.")
    parser.add_argument("target", metavar="RUN_DIR|FILE.pth",
                        help="a run folder of phasewatch fit, or a .pth file such as ../shared/reference/"
                             "progress-measures-paper/wd_10-1_mod_addition_loss_curve.pth")
    for_runs = parser.add_argument_group("for a run folder")
    for_runs.add_argument("--probes", nargs="+", help="probe names, e.g. llc (an unknown name gets the list)")
    for_runs.add_argument("--options", default=None,
                        help='JSON options per probe, on top of those in the run\'s config (probes.options), '
                             'e.g. \'{"llc": {"draws": 400}}\'')
    for_runs.add_argument("--replace", action="store_true", help="measure keys the run already has again")
    for_runs.add_argument("--device", default="auto",
                        help="where the probes run: auto (the GPU when there is one; default), cpu, cuda, cuda:N")
    for_runs.add_argument("--allow", nargs="+", metavar="MODULE",
                        help="modules whose classes the run's config may name besides phasewatch's and installed "
                             "plug-ins' (a run folder from someone else names code that would run)")
    for_runs.add_argument("--no_wandb", action="store_true",
                        help="no W&B run for this analysis (none either when the run was trained with --no_wandb)")
    args = parser.parse_args(argv)
    if Path(args.target).is_dir():
        if not args.probes:
            print("phasewatch: error: probes: analyze RUN_DIR needs the probes to run. Give e.g. --probes llc.",
                  file=sys.stderr)
            return 2
        from phasewatch.cli.analyze import analyze_run_command

        return analyze_run_command(args)
    if args.probes or args.options or args.replace or args.no_wandb or args.allow or args.device != "auto":
        print(f"phasewatch: error: {args.target} is not a run folder; --probes, --options, --replace, --device, "
              "--allow and --no_wandb apply to run folders. Give a run folder, or the .pth file alone.", file=sys.stderr)
        return 2
    return analyze_paper_checkpoint(args.target)


def analyze_paper_checkpoint(path: str) -> int:
    """`analyze FILE.pth`: the losses and grokking progress measures of a checkpoint saved by the
    code of Nanda et al. 2023 (its stored losses beside the ones its weights give)."""
    if not Path(path).is_file():
        print(f"phasewatch: error: {path} is not a file", file=sys.stderr)
        return 2
    import torch
    import torch.nn.functional as F

    from phasewatch.probes.grokking import progress_measures
    from phasewatch.models import load_progress_measures_checkpoint

    try:
        final, task = load_progress_measures_checkpoint(path)
        before, _ = load_progress_measures_checkpoint(path, before_last_step=True)
    except ValueError as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    stored = torch.load(path, map_location="cpu", weights_only=True)

    def loss(model, batch) -> float:
        with torch.no_grad():
            return F.cross_entropy(model(batch.tokens)[:, -1].double(), batch.targets[:, -1]).item()

    print(f"task: (a + b) mod {task.p}, {len(task.train_set())} training pairs, seed {task.seed}")
    for split, batch in (("train", task.train_set()), ("test", task.val_batches()[0])):
        print(f"{split} loss: stored {stored[f'{split}_loss'].item():.6e} | weights before the last step "
              f"{loss(before, batch):.6e} | final weights {loss(final, batch):.6e}")
    out = progress_measures(final, task)
    print(f"key frequencies (final weights): {sorted(out['key_freqs'])}")
    for key, value in out.items():
        if isinstance(value, float):
            print(f"  {key:28s} {value:.6g}")
    return 0


def phases_command(argv: list[str]) -> int:
    """`phases PATH`: the stages of a run (several series changing together, phases/stages.py)
    first; each series' transitions and lead/lag with `--series`."""
    import json

    args = _phases_parser().parse_args(argv)
    import phasewatch.probes  # noqa: F401  (the probes' key declarations: families, headline keys, stages)
    from phasewatch.phases.detector import DetectorConfig, detect_all
    from phasewatch.phases.stages import detect_stages
    from phasewatch.probes.keys import stage_rules

    try:
        data = _named_series(args.path, args.keys)
    except (FileNotFoundError, _NoSuchSeries) as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    rules = stage_rules()
    watched = data if args.series else {k: v for k, v in data.items() if not rules.detail(k)}
    found = detect_all(watched, DetectorConfig(log_values=args.log_values), trends=args.trends and args.series,
                       declared=None if args.log_values else rules.scale)  # the live watcher's scales (phases/scale.py)
    events = [e for e in found if e["kind"] == "transition"]
    stages = detect_stages(events, watched, rules)
    if args.json:
        for record in (found if args.series else [s.to_dict() for s in stages]):
            print(json.dumps(record))
        return 0
    _print_stages(stages, events, len(data), args.path)
    if args.series:
        _print_transitions(found, events, len(data), args.path, args.trends)
        _print_lead_lag(events, args.reference or ("val/loss" if "val/loss" in data else None), data)
    return 0


def _phases_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="phasewatch phases",
        description="The stages of a run (intervals in which several series change together, named where a probe "
                    "knows them: docs/stages.md), from the phase transitions (in log-step time) of every series of a "
                    "run folder, a metrics file (.jsonl) or a CSV file (steps from a 'step' column, else 1, 2, 3, ...).")
    parser.add_argument("path")
    parser.add_argument("--keys", nargs="*", help="only these series (default: all)")
    parser.add_argument("--series", action="store_true",
                        help="also each series' transitions and lead/lag (per-series key frequencies and heads "
                             "included, which stages leave out)")
    parser.add_argument("--log-values", action="store_true",
                        help="detect in log10 of every positive series (default: each on its own scale, as the live "
                             "watcher: losses in log10, accuracies and fractions as they are; docs/phases.md)")
    parser.add_argument("--reference", default=None,
                        help="lead/lag against this series' transitions (default: val/loss when present)")
    parser.add_argument("--json", action="store_true",
                        help="print the stages as JSON lines (with --series: the events, as the run folder's "
                             "events file has them)")
    parser.add_argument("--trends", action="store_true",
                        help="with --series, also list the steady changes that are not transitions (kind 'trend', "
                             "docs/phases.md)")
    return parser


class _NoSuchSeries(LookupError):
    """A series asked for by name that the run does not have."""


def _named_series(path: str, keys: list[str] | None) -> dict:
    """The series of a run folder, metrics file or CSV file (`keys`: only those; none
    missing)."""
    from phasewatch.rundir import load_series

    data = load_series(path)
    if not keys:
        return data
    missing = [k for k in keys if k not in data]
    if missing:
        raise _NoSuchSeries(f"no series {missing} in {path}; it has: {', '.join(sorted(data))}")
    return {k: data[k] for k in keys}


def _print_stages(stages: list, events: list[dict], n_series: int, path: str) -> None:
    in_stages = sum(len(s.members) for s in stages)
    print(f"{len(stages)} stage{'s' * (len(stages) != 1)} in {n_series} series of {path} "
          f"({in_stages} of their {len(events)} transitions; each series' with --series)")
    for stage in stages:
        print(f"  {stage.summary()}")


def _print_transitions(found: list[dict], events: list[dict], n_series: int, path: str, trends: bool) -> None:
    """Each series' transitions (and, with `trends`, its trends) as a table."""
    counted = f" (and {len(found) - len(events)} trends)" if trends else ""
    print(f"\n{len(events)} transitions{counted} in {n_series} series of {path}")
    if not found:
        return
    print(f"{'metric':34s} {'dir':4s} {'onset':>8s} {'midpoint':>9s} {'end':>8s} {'magnitude':>10s} "
          f"{'steepest':>9s} {'conf':>5s}{'  kind' if trends else ''}")
    for e in found:
        print(f"{e['metric'][:34]:34s} {e['direction']:4s} {e['onset']:8d} {e['midpoint']:9d} {e['end']:8d} "
              f"{e['magnitude']:10.4g} {e['steepest']:9d} {e['confidence']:5.2f}"
              f"{'  ' + e['kind'] if trends else ''}")


def _print_lead_lag(events: list[dict], reference: str | None, data: dict) -> None:
    """How far each series' transitions lead those of `reference` (none without one), the
    reference's principal transition marked (its rows are the report's)."""
    from phasewatch.phases.detector import lead_lag, principal

    main = principal(events, reference, *data[reference]) if reference in data else None
    current = None
    for r in (lead_lag(events, reference) if reference else []):
        if (r["reference_direction"], r["reference_midpoint"]) != current:
            current = (r["reference_direction"], r["reference_midpoint"])
            mark = ("; its principal transition (largest change on its own scale: the report's rows)"
                    if main and (main["direction"], main["midpoint"]) == current else "")
            print(f"\nlead/lag against {reference} going {current[0]} (midpoint {current[1]}){mark}; "
                  "positive = earlier:")
        print(f"  {r['metric']:32s} {r['direction']:4s} midpoint {r['midpoint']:7d}  leads by {r['lead']:6d} steps "
              f"(onset by {r['onset_lead']:6d})")


def report_command(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="phasewatch report",
                                     description="Write the run folder's self-contained HTML report and its curves "
                                                 "figure (and its checkpoint trajectory, when missing or out of date); "
                                                 "for a population's folder, the members' curves overlaid and each "
                                                 "transition's step over the seeds.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="HTML path (default: the report in the run folder)")
    args = parser.parse_args(argv)
    from phasewatch.report.curves import plot_run
    from phasewatch.report.html import write_report
    from phasewatch.report.population import is_population, write_population_report
    from phasewatch.errors import ConfigError
    from phasewatch.cli.trajectory import current_trajectory

    if is_population(args.run_dir):  # the members' curves overlaid, their transition steps as distributions
        print(write_population_report(args.run_dir, args.out))
        return 0

    try:
        current_trajectory(args.run_dir)
    except ConfigError as err:  # the report is still worth having
        print(f"phasewatch: no checkpoint trajectory in the report: {err}", file=sys.stderr)
    try:
        print(write_report(args.run_dir, args.out))
        print(plot_run(args.run_dir))
    except FileNotFoundError as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    return 0


def compile_command(argv: list[str]) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="phasewatch compile",
        description="Compile a tracr library program (cached), check the TransformerLens conversion against tracr's "
                    "own outputs, and print the compiled model's layout: what each layer writes, and each RASP "
                    "variable's residual dimensions (with the values a categorical variable's dimensions encode).")
    parser.add_argument("program")
    parser.add_argument("--vocab", default=None, help="JSON list of token values, e.g. '[1, 2, 3]'")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--cache-dir", default=None,
                        help="compiled-model cache (default: $PHASEWATCH_TRACR_CACHE or ~/.cache/phasewatch/tracr)")
    args = parser.parse_args(argv)
    from phasewatch.tasks.tracr_programs import load_program
    from phasewatch.models.compiled import compiled_reference, describe_layout

    from phasewatch.errors import ConfigError

    try:
        vocab = json.loads(args.vocab) if args.vocab else None
    except json.JSONDecodeError as err:
        raise ConfigError("vocab", f"--vocab {args.vocab!r} is not a JSON list ({err})", "Write e.g. --vocab '[1, 2, 3]'.")
    if vocab is not None and not isinstance(vocab, list):
        raise ConfigError("vocab", f"--vocab {args.vocab!r} is not a list", "Write e.g. --vocab '[1, 2, 3]'.")
    program = load_program(args.program, vocab, args.max_seq_len)
    _, layout = compiled_reference(program, cache_dir=args.cache_dir)
    head, *rest = describe_layout(layout)
    print(f"{program.name}: vocab {list(program.vocab)}, max_seq_len {program.max_seq_len}; {head}")
    print("\n".join(rest))
    return 0


#: command -> (module, function(argv) -> exit status), imported only when the command runs
COMMANDS = {
    "plot": (__name__, "plot_command"),
    "analyze": (__name__, "analyze_command"),
    "phases": (__name__, "phases_command"),
    "report": (__name__, "report_command"),
    "compile": (__name__, "compile_command"),
    "sweep": ("phasewatch.cli.sweep", "sweep_command"),
    "compare": ("phasewatch.report.cross_run", "compare_command"),
    "trajectory": ("phasewatch.cli.trajectory", "trajectory_command"),
    "diff": ("phasewatch.cli.diff", "diff_command"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one command (argv without the program name); its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    from phasewatch.errors import ConfigError

    try:
        if argv[0] in ("fit", "validate"):
            return _lightning_cli(argv)
        elif argv[0] == "tasks":
            list_tasks()
        elif argv[0] in COMMANDS:
            module, function = COMMANDS[argv[0]]
            return getattr(importlib.import_module(module), function)(argv[1:])
        else:
            print(f"phasewatch: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
            return 2
    except ConfigError as err:
        print(f"phasewatch: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a fit's training loop (fit's own: _lightning_cli)
        print("phasewatch: interrupted", file=sys.stderr)
        return 130
    return 0


def console_main() -> None:
    """The `phasewatch` program: `main`, and output cut short by the reader (`phasewatch tasks |
    head`) ending quietly with the status a shell gives a command killed by SIGPIPE."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        code = 141
    sys.exit(code)


if __name__ == "__main__":
    console_main()

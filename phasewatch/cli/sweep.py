"""`phasewatch sweep`: run a W&B sweep file on this machine, without a W&B server.

    phasewatch sweep sweeps/grokking.yaml [--count N] [--parallel J] [--out DIR] [--dry-run] [--no-pack]

The file is the one `wandb sweep` takes (parameter names are `phasewatch fit` flags; its command
runs `phasewatch fit`). W&B's search engine (the `sweeps` package: grid, random, bayes) proposes
each configuration and W&B's expansion of `${args}` builds its command, so a file behaves as under
`wandb agent`. Each run is a run folder `DIR/<name>-NNN` with an offline W&B run grouped under the
sweep's name; in a grid over `seed_everything` the points that differ only in that seed train as
one population `DIR/<name>-pack-NNN` (`packable`). Up to `--parallel` processes at once; the
folder's state file records every run, so the same command resumes an interrupted sweep.

Public: `sweep_command` (the CLI), `LocalSweep`, `load_sweep_file`, `command_for`, `packable`.
Refused (ConfigError): a file W&B would refuse, a command that is not `phasewatch fit`, random or
bayes without `--count`, a folder of another sweep or in use by a live one. README, "Sweeps".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from phasewatch.rundir import (
    RUNS,
    RunFolder,
    SweepFolder,
    flatten_config,
    member_name,
    pid_alive,
)
from phasewatch.errors import ConfigError

#: the sweep parameter that a population varies (packing)
SEED = "seed_everything"
#: the one install line that works, from the repository root: the engine's requirements (pyproject.toml's
#: `sweep` extra), then the engine without its own, whose numpy<2 pin clashes with jax and torch
INSTALL_HINT = 'pip install -e ".[sweep]" && pip install --no-deps sweeps==0.3.0'


def load_sweep_file(path: str | os.PathLike) -> dict[str, Any]:
    """The sweep file's dict, checked against W&B's schema and phasewatch's command."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("sweep", f"{path} is not a file", "Give a sweep YAML, e.g. sweeps/grokking.yaml.")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError("sweep", f"{path} is not valid YAML ({err})", "Fix the file's syntax.") from err
    if not isinstance(config, dict) or not isinstance(config.get("parameters"), dict) or not config["parameters"]:
        raise ConfigError("sweep", f"{path} has no parameters section",
                          "Write W&B's sweep schema: method, parameters (phasewatch fit flags), command.")
    sweeps = _sweeps()
    problems = sweeps.schema_violations_from_proposed_config(config)
    if problems:
        raise ConfigError("sweep", f"{path} is not a valid W&B sweep ({'; '.join(map(str, problems))})",
                          "See https://docs.wandb.ai/guides/sweeps/sweep-config-keys.")
    command_for(config, {k: _first_value(v) for k, v in config["parameters"].items()}, path)
    return config


def command_for(config: dict[str, Any], params: dict[str, Any], source: str | os.PathLike = "sweep") -> list[str]:
    """The command `wandb agent` would run for these parameter values (W&B's expansion of
    `${env}`, `${interpreter}`, `${program}`, `${args}`, ...), with `phasewatch` replaced
    by this Python's `-m phasewatch` so that it runs this installation."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    template = config.get("command") or ["${env}", "${interpreter}", "${program}", "${args}"]
    variables = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    variables.update(env=[], interpreter=[sys.executable], program=[str(config.get("program", ""))])
    out: list[str] = []
    for part in map(str, template):
        if part.startswith("${") and part.endswith("}"):
            out += [str(x) for x in variables.get(part[2:-1]) or []]
        else:
            out.append(part)
    at = out.index("phasewatch") if "phasewatch" in out else -1
    if at < 0 or out[at + 1:at + 2] != ["fit"]:
        raise ConfigError("sweep", f"{source}: its command {template} does not run `phasewatch fit`",
                          "Use command: [${env}, phasewatch, fit, --config, configs/<x>.yaml, ${args}].")
    out[at:at + 1] = [sys.executable, "-m", "phasewatch"]
    return out


class LocalSweep:
    """One sweep folder: its state file, the search, and the runs it starts."""

    def __init__(self, file: str | os.PathLike, out: str | os.PathLike | None = None,
                 count: int | None = None, parallel: int = 1, pack: bool | None = None):
        self.file = Path(file)
        self.config = load_sweep_file(self.file)
        if pack and not packable(self.config):
            raise ConfigError("pack", "only a grid sweep over several seed_everything values packs into populations, "
                                      f"and only when it sets none of {', '.join(UNPACKABLE)} (a population refuses them)",
                              "Leave out --pack, or add seed_everything: {values: [0, 1, 2]} to a grid sweep.")
        self.pack = packable(self.config) if pack is None else pack
        self.name = str(self.config.get("name") or self.file.stem)
        self.root = Path(out) if out is not None else RUNS / f"sweep-{self.name}"
        self.sweep_folder = SweepFolder(self.root)
        self.count, self.parallel = count, parallel
        self._new, self._exhausted = 0, False  # this invocation's new runs; whether the search is done
        if parallel < 1:
            raise ConfigError("parallel", f"--parallel {parallel} is below 1", "Use --parallel 1 or more.")
        if count is not None and count < 1:
            raise ConfigError("count", f"--count {count} is below 1", "Use --count 1 or more.")
        method = self.config.get("method")
        if method in ("random", "bayes") and count is None and self.config.get("run_cap") is None:
            raise ConfigError("count", f"a {method} search has no end",
                              "Pass --count N (or set run_cap in the sweep file).")
        self.state = self._load_state()

    # state file -------------------------------------------------------------------------
    def _load_state(self) -> dict[str, Any]:
        if not self.sweep_folder.is_sweep():
            return {"name": self.name, "file": str(self.file), "config": self.config, "pid": None, "runs": []}
        state = self.sweep_folder.read_state()
        if state.get("config") != self.config:
            raise ConfigError("out", f"{self.root} holds the sweep of another file ({state.get('file')}) "
                                     "or of an earlier version of this one",
                              "Pass --out with a new folder for this sweep.")
        pid = state.get("pid")
        if pid and pid != os.getpid() and pid_alive(pid):
            raise ConfigError("out", f"another phasewatch sweep (pid {pid}) is running {self.root}",
                              "Wait for it to end or stop it; then run the same command to resume.")
        return state

    def _save(self) -> None:
        self.sweep_folder.write_state(self.state)

    # search -----------------------------------------------------------------------------
    def _sweep_runs(self) -> list:
        sweeps = _sweeps()
        states = {"finished": "finished", "failed": "failed"}
        return [sweeps.SweepRun(name=r["name"], state=states.get(r["state"], "running"),
                                config={k: {"value": v} for k, v in r["params"].items()},
                                summary_metrics=r.get("summary") or {})
                for r in self.state["runs"]]

    def _propose(self) -> dict[str, Any] | None:
        cap = self.config.get("run_cap")
        if cap is not None and len(self.state["runs"]) >= cap:
            return None
        suggestion = _sweeps().next_run(self.config, self._sweep_runs())
        if suggestion is None:
            return None
        params = {k: _plain(v["value"]) for k, v in suggestion.config.items()}
        run = {"name": f"{self.name}-{len(self.state['runs']):03d}", "params": params, "state": "pending"}
        self.state["runs"].append(run)
        return run

    def planned(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The configurations a run would start, without starting or recording them."""
        saved = json.loads(json.dumps(self.state["runs"]))
        try:
            out = []
            while limit is None or len(out) < limit:
                run = self._propose()
                if run is None:
                    break
                run["state"] = "running"
                out.append(run)
            return out
        finally:
            self.state["runs"] = saved

    # runs -------------------------------------------------------------------------------
    def run_dir(self, run: dict[str, Any]) -> Path:
        return self.sweep_folder.run(run).root

    def units(self, runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """The processes to start: one run each, or with packing one per group of runs that
        differ only in seed_everything (a population; each run is given its `pack` and member
        `folder` once, so that a resumed sweep finds them again)."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for run in runs:  # a run packed before stays in its pack (its folder is there), packing or not
            key = run.get("pack") or (json.dumps({k: v for k, v in run["params"].items() if k != SEED},
                                                 sort_keys=True, default=str) if self.pack else run["name"])
            groups.setdefault(key, []).append(run)
        packs = {r["pack"] for r in self.state["runs"] if r.get("pack")}
        units = []
        for unit in groups.values():
            if "pack" not in unit[0] and len(unit) > 1:
                name = f"{self.name}-pack-{len(packs):03d}"
                packs.add(name)
                for k, run in enumerate(unit):
                    run.update(pack=name, folder=f"{name}/{member_name(k)}")
            units += [unit] if unit[0].get("pack") else [[run] for run in unit]  # one seed left: a run alone
        return units

    def _run_folder(self, unit: list[dict[str, Any]]) -> RunFolder:
        """The folder the unit's process trains in: its run's, or its population's."""
        return self.sweep_folder.run(unit[0]["pack"]) if unit[0].get("pack") else self.sweep_folder.run(unit[0])

    def command(self, unit: list[dict[str, Any]]) -> list[str]:
        folder = self._run_folder(unit)
        if unit[0].get("pack"):
            params = {k: v for k, v in unit[0]["params"].items() if k != SEED}
            seeds = ",".join(f"{run['params'][SEED]}-{run['params'][SEED]}" for run in unit)  # ranges: never a count
            cmd = command_for(self.config, params, self.file) + [
                "--run_dir", str(folder.root), "--population.seeds", seeds, "--population.vary_data", "false"]
        else:
            cmd = command_for(self.config, unit[0]["params"], self.file) + ["--run_dir", str(folder.root)]
        if folder.last_checkpoint.exists():
            cmd += ["--ckpt_path", "last"]
        return cmd

    def _start(self, unit: list[dict[str, Any]]) -> subprocess.Popen:
        folder = self._run_folder(unit)
        if folder.root.exists() and not folder.last_checkpoint.exists():
            shutil.rmtree(folder.root)  # stopped before its first checkpoint: nothing to resume
        self.sweep_folder.logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("WANDB_MODE", "offline")
        env["WANDB_RUN_GROUP"] = self.name
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.parallel)))
        with open(self.sweep_folder.log(folder.root.name), "a") as log:
            proc = subprocess.Popen(self.command(unit), stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        for run in unit:
            run.update(state="running", start_time=time.time())
        self._save()
        return proc

    def _finish(self, unit: list[dict[str, Any]], code: int) -> None:
        for run in unit:
            run["returncode"] = code
            run["end_time"] = time.time()
            run["seconds"] = round(run["end_time"] - run["start_time"], 1)
            run["state"] = "finished" if code == 0 else ("stopped" if code < 0 else "failed")
            metric = (self.config.get("metric") or {}).get("name")
            series = self.sweep_folder.run(run).series()
            if metric and metric in series:
                run["summary"] = {metric: series[metric][1][-1]}
        self._save()

    def run(self) -> int:
        """Run (or resume) the sweep; 0 when every run finished, 1 when some failed, 130
        when interrupted (run the same command again to resume)."""
        self._claim()
        units = self._units_to_start()
        running: dict[str, tuple[subprocess.Popen, list[dict[str, Any]]]] = {}
        try:
            while True:
                self._fill(units, running)
                if not running:
                    break
                time.sleep(0.5)
                self._reap(running)
        except KeyboardInterrupt:
            self._stop(running)
            return 130
        return self._close()

    def _claim(self) -> None:
        """Record this process as the sweep's, and let Ctrl-C stop it gracefully."""
        # Ctrl-C / kill -INT stop the sweep gracefully even when it was started as a background
        # job, whose shell made it ignore SIGINT (its runs then get the default handling too)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.state["pid"] = os.getpid()
        self._save()

    def _wants_more(self) -> bool:
        """Whether the search may still propose a new run (not exhausted, under --count)."""
        return not self._exhausted and (self.count is None or self._new < self.count)

    def _units_to_start(self) -> list[list[dict[str, Any]]]:
        """The runs to continue (pending, running or stopped before) and, when packing, every new
        run of the grid, grouped into units; prints whether the sweep starts or resumes."""
        todo = [r for r in self.state["runs"] if r["state"] in ("pending", "running", "stopped")]
        resuming = bool(self.state["runs"])
        self._new, self._exhausted = 0, False
        if self.pack:  # the whole grid first, so that the seeds of one grid point train together
            while self._wants_more():
                run = self._propose()
                if run is None:
                    break
                todo.append(run)
                self._new += 1
            self._exhausted = True
        units = self.units(todo)
        if resuming:
            done = sum(r["state"] in ("finished", "failed") for r in self.state["runs"])
            print(f"phasewatch: resuming sweep {self.name} in {self.root}: {done} runs done, {len(todo)} to continue")
        else:
            print(f"phasewatch: sweep {self.name} ({self.config['method']}) in {self.root}")
        return units

    def _next_unit(self, units: list[list[dict[str, Any]]]) -> list[dict[str, Any]] | None:
        """The next unit to start: a planned one, else a new proposal of the search; None when
        there is neither."""
        while units or self._wants_more():
            if units:
                return units.pop(0)
            run = self._propose()
            self._exhausted = run is None
            if run is not None:
                self._new += 1
                return [run]
        return None

    def _fill(self, units: list[list[dict[str, Any]]],
              running: dict[str, tuple[subprocess.Popen, list[dict[str, Any]]]]) -> None:
        """Start units until --parallel of them run or none is left."""
        while len(running) < self.parallel and (unit := self._next_unit(units)) is not None:
            name = self._run_folder(unit).root.name
            running[name] = (self._start(unit), unit)
            print(f"  start  {name}  {_describe_unit(unit)}", flush=True)

    def _reap(self, running: dict[str, tuple[subprocess.Popen, list[dict[str, Any]]]]) -> None:
        """Record and print the units whose process has ended."""
        for name, (proc, unit) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[name]
            self._finish(unit, code)
            for run in unit:
                extra = "".join(f"  {k} {v:.4g}" for k, v in (run.get("summary") or {}).items())
                log = "" if code == 0 else f"  (exit {code}; see {self.sweep_folder.log(name)})"
                print(f"  {run['state']:8s} {run['name']}  in {run['seconds']:.0f} s{extra}{log}", flush=True)

    def _stop(self, running: dict[str, tuple[subprocess.Popen, list[dict[str, Any]]]]) -> None:
        """Interrupted: pass SIGINT on to every running unit, wait for it (30 s, then kill) and
        mark its runs stopped, so that the same command resumes them."""
        for proc, unit in running.values():
            proc.send_signal(signal.SIGINT)
        for proc, unit in running.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            for run in unit:
                run.update(state="stopped", returncode=None)
        self.state["pid"] = None
        self._save()
        print(f"phasewatch: sweep interrupted; run the same command again to resume it ({self.root})")

    def _close(self) -> int:
        """Release the sweep folder and print the tally; 1 when some run failed, else 0."""
        self.state["pid"] = None
        self._save()
        runs = self.state["runs"]
        failed = [r["name"] for r in runs if r["state"] == "failed"]
        print(f"phasewatch: sweep {self.name}: {sum(r['state'] == 'finished' for r in runs)} finished, "
              f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}. "
              f"Compare them: phasewatch compare {self.root}")
        return 1 if failed else 0


def sweep_command(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="phasewatch sweep",
        description="Run a W&B sweep file locally (no W&B server): W&B's search engine proposes each run, up to "
                    "--parallel run at once, each in its own run folder with an offline W&B run. Running the same "
                    "command again resumes an interrupted sweep.")
    parser.add_argument("file", help="sweep YAML, e.g. sweeps/grokking.yaml")
    parser.add_argument("--count", type=int, default=None,
                        help="start at most this many new runs (default: the whole grid; needed for random/bayes)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--out", default=None, help="sweep folder (default: runs/sweep-<name>)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands of the runs it would start")
    parser.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                        help="train the grid points that differ only in seed_everything as one population "
                             "(default: on for a grid over several seeds)")
    args = parser.parse_args(argv)
    sweep = LocalSweep(args.file, args.out, args.count, args.parallel, args.pack)
    if args.dry_run:
        for unit in sweep.units(sweep.planned(args.count)):
            print(" ".join(sweep.command(unit)))
        return 0
    return sweep.run()


def _sweeps():
    import warnings

    try:
        with warnings.catch_warnings():  # pydantic's notice about the package's v1-style config
            warnings.simplefilter("ignore", UserWarning)
            import sweeps
    except ImportError as err:  # the engine itself, or one of its requirements (`--no-deps` installs none)
        missing = err.name or ""
        if missing == "sweeps" or missing.startswith("sweeps."):
            problem = "W&B's sweep engine (the `sweeps` package) is not installed"
        elif isinstance(err, ModuleNotFoundError) and missing:
            problem = f"W&B's sweep engine (the `sweeps` package) cannot start: it needs the module {missing!r}, " \
                      "which is not installed"
        else:
            problem = f"W&B's sweep engine (the `sweeps` package) cannot start: {err}"
        raise ConfigError("sweep", problem,
                          f"Install it with its requirements, from the repository root: {INSTALL_HINT}") from err
    return sweeps


def _first_value(spec: Any) -> Any:
    if isinstance(spec, dict):
        if "value" in spec:
            return spec["value"]
        if spec.get("values"):
            return spec["values"][0]
        if "min" in spec:
            return spec["min"]
    return None


def _plain(value: Any) -> Any:
    """numpy scalars from the search engine as plain Python numbers."""
    return value.item() if hasattr(value, "item") else value


#: what a population refuses (training/population.py), as (setting, whether a value sets it):
#: a sweep that sets one of them does not pack
UNPACKABLE = {
    "interventions": lambda v: bool(v.get("items") if isinstance(v, dict) else v),
    "trainer.gradient_clip_val": lambda v: v is not None,
    "model.on_nonfinite": lambda v: v == "skip",
    "model.arch.seed": lambda v: v is not None,
}


def packable(config: dict[str, Any]) -> bool:
    """Whether a sweep packs into populations: a grid over several seed_everything values
    whose parameters, command flags and config file set nothing a population refuses."""
    spec = config["parameters"].get(SEED)
    if not (config.get("method") == "grid" and isinstance(spec, dict) and len(spec.get("values") or []) > 1):
        return False
    command = [str(part) for part in config.get("command") or []]
    settings: dict[str, Any] = {}
    for flag, path in zip(command, command[1:]):  # the config files the runs start from
        if flag in ("--config", "-c") and Path(path).is_file():
            loaded = yaml.safe_load(Path(path).read_text())
            if isinstance(loaded, dict):
                settings |= flatten_config(loaded, fold_init_args=True, whole=("interventions",))
    for i, part in enumerate(command):  # flags given in the command: --name=value or --name value
        if part.startswith("--"):
            name, _, value = part[2:].partition("=")
            settings[name] = yaml.safe_load(value or (command[i + 1] if i + 1 < len(command) else "") or "null")
    settings |= {name: _first_value(spec) for name, spec in config["parameters"].items()}
    # jsonargparse's class_path/init_args form names the same settings (model.arch.init_args.seed)
    return not any(_refused(name.replace(".init_args", ""), value) for name, value in settings.items())


def _refused(name: str, value: Any) -> bool:
    if name.startswith("interventions."):  # e.g. the flag --interventions.items=[...]
        return bool(value)
    return name in UNPACKABLE and UNPACKABLE[name](value)


def _describe_unit(unit: list[dict[str, Any]]) -> str:
    if not unit[0].get("pack"):
        return _describe(unit[0]["params"])
    rest = {k: v for k, v in unit[0]["params"].items() if k != SEED}
    seeds = ",".join(str(run["params"][SEED]) for run in unit)
    return f"population of {len(unit)}: {SEED}={seeds} {_describe(rest)}".rstrip()


def _describe(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())

"""`python -m phasewatch ARGS` as a real child process that starts warm.

Tests that need a separate process (one to SIGKILL or SIGTERM mid-run) would each pay the
~15 s of imports of a cold `python -m phasewatch`. `start` forks the child from a
multiprocessing forkserver that imported phasewatch, torch, Lightning and TransformerLens
once per test session and computed nothing (forking after torch has run OpenMP code can
hang; after importing it, it cannot). The child then runs the same `console_main` as
`python -m phasewatch`, with its own environment, working directory, stdout and stderr (one
file), its own pid for signals, and exit statuses as `subprocess` gives them (a status, or
minus the signal that killed it). `ensure_server` starts the server early (tests/conftest.py
does at collection), so its imports overlap other tests.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from pathlib import Path

#: what `phasewatch fit` imports before it trains (and its report after), imported by the server. Not
#: W&B (~2 s): it makes a staging folder when imported, which each process must have to itself
PRELOAD = ["phasewatch.cli.main", "phasewatch.cli.console", "phasewatch.training.lightning_cli",
           "phasewatch.loggers.wandb_logger", "phasewatch.report.html", "matplotlib.pyplot", "transformer_lens",
           "transformer_lens.model_bridge"]

_context = multiprocessing.get_context("forkserver")


def ensure_server() -> None:
    """Start the forkserver (its imports run in the background) unless it runs already."""
    _context.set_forkserver_preload([*PRELOAD, __name__])
    multiprocessing.forkserver.ensure_running()


def _child(args: list[str], output: str, env: dict[str, str], append: bool, new_session: bool) -> None:
    """In the forked child: what `python -m phasewatch ARGS > output 2>&1` (`>>` when appending) does."""
    if new_session:
        os.setsid()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read when torch loads, in the server: set it as a new process would
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["phasewatch", *args]
    from phasewatch.cli.main import console_main

    atexit._clear()  # the server's exit handlers are the server's (they would remove what its imports made)
    try:
        console_main()
    finally:  # this process's, as the interpreter's exit runs them (W&B ends its service there)
        atexit._run_exitfuncs()


class WarmProcess:
    """A running `python -m phasewatch ARGS`, with Popen's poll/send_signal/wait and its output."""

    def __init__(self, args: list[str], output: Path, env: dict[str, str] | None = None, append: bool = False,
                 new_session: bool = False):
        ensure_server()
        self.output_path = Path(output)
        self._process = _context.Process(target=_child, args=([str(a) for a in args], str(output),
                                                               dict(os.environ if env is None else env), append,
                                                               new_session))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode if not self._process.is_alive() else None

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"phasewatch child {self.pid}", timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> str:
        """What the child wrote to stdout and stderr so far."""
        return self.output_path.read_text() if self.output_path.exists() else ""


def start(args: list[str], output: Path, env: dict[str, str] | None = None) -> WarmProcess:
    """`python -m phasewatch ARGS`, stdout and stderr into `output`, in this process's working
    directory and environment (or `env`)."""
    return WarmProcess(args, output, env)


def popen(real_popen):
    """A stand-in for `subprocess.Popen` that starts `[sys.executable, "-m", "phasewatch", ...]`
    with stdout a file and stderr into it (as `phasewatch sweep` starts its runs) warm, and
    anything else with `real_popen`."""
    def start_process(cmd, *, stdout=None, stderr=None, env=None, start_new_session=False, **kwargs):
        if (list(cmd[:3]) != [sys.executable, "-m", "phasewatch"] or kwargs or stderr != subprocess.STDOUT
                or not hasattr(stdout, "name")):
            return real_popen(cmd, stdout=stdout, stderr=stderr, env=env, start_new_session=start_new_session,
                              **kwargs)
        stdout.flush()
        return WarmProcess(list(cmd[3:]), Path(stdout.name), env, append=True, new_session=start_new_session)

    return start_process

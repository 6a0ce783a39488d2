"""Config fuzzing: invalid values and types for every field of every task, of the model,
the data module, the checkpoints and the probes stop before training with a clear error
(a one-line ConfigError or the parser's usage error, exit status 2), never a traceback
from deep inside torch, and write nothing."""

import inspect

import pytest

from phasewatch.callbacks.checkpoints import ScheduledCheckpoints
from phasewatch.models import ModelConfig
from phasewatch.tasks import DigitAddition, Induction, ModularAddition, RaspTask
from phasewatch.cli.main import main

BAD_VALUES = ["-1", "abc", "[]", "1.5e300"]  # 1.5e300 is only "too large" where sizes are concerned


def fields(cls, skip=()):
    return [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", *skip)]


CASES = []
for task in (ModularAddition, DigitAddition, Induction, RaspTask):
    for name in fields(task):
        CASES += [(["--data.task", task.__name__, f"--data.task.{name}", v], f"{task.__name__}.{name}") for v in BAD_VALUES]
for name in (f.name for f in __import__("dataclasses").fields(ModelConfig)):
    CASES += [([f"--model.arch.{name}", v], f"arch.{name}") for v in BAD_VALUES]
for name in ("lr", "weight_decay", "betas", "warmup_steps", "loss_dtype", "on_nonfinite"):
    CASES += [([f"--model.{name}", v], f"model.{name}") for v in BAD_VALUES if not (name == "lr" and v == "1.5e300")]
CASES += [(["--data.batch_size", v], "data.batch_size") for v in BAD_VALUES]
for name in fields(ScheduledCheckpoints, skip=("dirpath",)):
    CASES += [([f"--checkpoints.{name}", v], f"checkpoints.{name}") for v in BAD_VALUES]
CASES += [(["--checkpoints.schedule.kind", v], "schedule.kind") for v in BAD_VALUES]
CASES += [(["--checkpoints.schedule.count", v], "schedule.count") for v in BAD_VALUES]
CASES += [(["--probes.names", v], "probes.names") for v in ("[abc]", "-1")]


@pytest.mark.parametrize("args,label", CASES, ids=[f"{label}={a[-1]}" for a, label in CASES])
def test_invalid_value_stops_cleanly(tmp_path, capsys, args, label):
    run = tmp_path / "run"
    try:
        code = main(["fit", *args, "--run_dir", str(run), "--no_wandb", "--trainer.max_steps", "1"])
    except SystemExit as exit_:  # the parser's usage error
        code = exit_.code
    err = capsys.readouterr().err
    if code == 0:
        pytest.fail(f"{label} accepted {args[-1]!r}")
    assert code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(("phasewatch: error:", "error:")) or "error:" in err
    assert not run.exists()

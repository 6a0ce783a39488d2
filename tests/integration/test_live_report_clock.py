"""The live report (`LiveReport`) is rewritten at its validations only once `min_seconds` of wall time
have passed since the fit began or since its last rewrite (an open page reloads every 30 s: a
rewrite sooner is not seen), and always once at the end, without the reload: a run shorter than
that writes it at the end only; `min_seconds 0` rewrites it at every `every_n_validations`-th
validation, as before."""

from types import SimpleNamespace

import pytest

import phasewatch.callbacks.live_report as live_report
from phasewatch.cli.main import main
from phasewatch.report.html import REFRESH_SECONDS

ARGS = ["--data.task", "Induction", "--data.task.vocab_size", "10", "--data.task.seq_len", "13",
        "--data.task.max_len", "6", "--data.task.batch_size", "8", "--data.task.n_val", "16",
        "--model.arch.d_model", "16", "--model.arch.n_heads", "2", "--model.arch.d_head", "8", "--model.arch.d_mlp", "32",
        "--trainer.max_steps", "30", "--trainer.val_check_interval", "10", "--probes.names", "[]",
        "--report.every_n_validations", "1", "--trainer.enable_progress_bar", "false", "--no_wandb"]


class _Clock:
    """The live report's clock (`time.monotonic` as `live_report` reads it): `step` seconds
    pass between two readings, whatever the machine's speed."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize("flags, seconds, live_writes",
                         [([], 0.0, 0), ([], 31.0, 3), (["--report.min_seconds", "0"], 0.0, 3)],
                         ids=["within-the-reload-period", "past-the-reload-period", "min_seconds-0"])
def test_the_live_report_waits_for_its_clock_and_the_final_one_is_always_written(tmp_path, monkeypatch, flags,
                                                                                  seconds, live_writes):
    written: list[bool] = []  # each rewrite's `live`, in order (the writes themselves happen)
    write = live_report.write_report

    def recorded(run_dir, *args, live=False, **kwargs):
        written.append(live)
        return write(run_dir, *args, live=live, **kwargs)

    monkeypatch.setattr(live_report, "write_report", recorded)
    monkeypatch.setattr(live_report, "time", SimpleNamespace(monotonic=_Clock(seconds).monotonic))
    assert main(["fit", *ARGS, *flags, "--run_dir", str(tmp_path / "run")]) == 0
    assert written == [True] * live_writes + [False]
    report = (tmp_path / "run" / "report.html").read_text()
    assert 'http-equiv="refresh"' not in report  # the final report


def test_the_live_report_waits_for_the_pages_own_reload_period_by_default():
    assert live_report.LiveReport().min_seconds == REFRESH_SECONDS == 30

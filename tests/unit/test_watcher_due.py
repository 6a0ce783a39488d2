"""`TransitionWatcher.due_at` laid out by `plan` (one set lookup a step) says what the rule it
stands for says (the look grid, and the steps around those logged early only), at every step."""

import pytest

from phasewatch.callbacks.transitions import TransitionWatcher


@pytest.mark.parametrize("max_steps, every, per_doubling", [
    (3000, 10, 0), (3000, 10, 16), (3000, 50, 16), (500, 7, 3), (100000, 10, 16), (40, 10, 16), (3000, 1, 16)])
def test_due_at_laid_out_is_the_rule_at_every_step(max_steps, every, per_doubling):
    watcher = TransitionWatcher(logs_per_doubling=per_doubling)
    watcher._log_every = every if per_doubling else 0  # as `setup` sets it from the trainer
    watcher.plan(max_steps)
    assert watcher._acts is not None
    rule = [s in watcher._look_grid or watcher._early(s + 1) or watcher._early(s) for s in range(max_steps + 2)]
    assert [watcher.due_at(s) for s in range(max_steps + 2)] == rule
    assert any(rule)


def test_dense_now_is_dense_metrics_at_every_step():
    watcher = TransitionWatcher()
    watcher.plan(3000)
    watcher.pending = [{"metric": "val/loss", "direction": "down", "onset": 90, "detected_at": 100}]
    said = [watcher.dense_now(s) for s in range(3001)]
    assert said == [bool(watcher.dense_metrics(s)) for s in range(3001)] and any(said) and not all(said)

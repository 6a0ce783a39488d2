"""The headline experiments, end to end (minutes on CPU: run with --runslow)."""

import pytest

from phasewatch.cli.main import main
from phasewatch.rundir import read_jsonl

pytestmark = pytest.mark.slow


def first_step(records, key, condition):
    return next(r["step"] for r in records if r.get(key) is not None and condition(r[key]))


def test_quickstart_groks_with_the_papers_ordering(tmp_path):
    run = tmp_path / "quickstart"
    assert main(["fit", "--config", "configs/quickstart.yaml", "--run_dir", str(run), "--no_wandb",
                 "--trainer.enable_progress_bar", "false"]) == 0
    rs = list(read_jsonl(run / "metrics.jsonl"))
    memorised = first_step(rs, "train/acc", lambda v: v >= 0.99)
    restricted = first_step(rs, "grok/restricted_loss", lambda v: v < 0.1)
    test_drop = first_step(rs, "val/loss", lambda v: v < 1)
    grokked = first_step(rs, "val/acc", lambda v: v >= 0.99)
    assert memorised < restricted < test_drop <= grokked < 3000
    excluded = [r["grok/excluded_loss"] for r in rs if "grok/excluded_loss" in r and 200 <= r["step"] <= test_drop]
    assert max(excluded) > 3 * excluded[0]  # rises during circuit formation
    gini = {r["step"]: r["grok/gini_neuron_logit"] for r in rs if "grok/gini_neuron_logit" in r}
    assert gini[max(gini)] > gini[min(s for s in gini if s >= test_drop)] + 0.1  # rises at clean-up


def test_two_layers_form_an_induction_circuit_one_layer_does_not(tmp_path):
    runs = {}
    for layers in (1, 2):
        run = tmp_path / f"induction_{layers}l"
        assert main(["fit", "--config", f"configs/induction_{layers}l.yaml", "--run_dir", str(run), "--no_wandb",
                     "--trainer.enable_progress_bar", "false"]) == 0
        runs[layers] = [r for r in read_jsonl(run / "metrics.jsonl") if "heads/induction/max" in r]
    two, one = runs[2], runs[1]
    start = first_step(two, "heads/induction/max", lambda v: v > 0.2)
    done = first_step(two, "heads/induction/max", lambda v: v > 0.5)
    assert done - start <= 600  # a short window
    at = {r["step"]: r for r in two}
    assert at[done]["heads/prev_token/max"] > 1.5 * at[start - 200]["heads/prev_token/max"]
    assert at[done]["icl/second_copy_loss"] < at[start - 200]["icl/second_copy_loss"] - 1.0
    assert at[done]["comp/k/max"] > 1.5 * at[done]["comp/baseline"]
    assert max(r["heads/induction/max"] for r in one) < 0.3

"""A researcher's own probe and task, from a package of their own, installed with pip: they run
in `fit`, `analyze` and the report without editing phasewatch (entry points, and a dotted name)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phasewatch.rundir import RunFolder
from phasewatch.cli.main import main

PLUGIN = Path(__file__).parent / "plugin_package"
TINY = ["--model.arch.d_model", "16", "--model.arch.n_heads", "2", "--model.arch.d_head", "8",
        "--model.arch.d_mlp", "32", "--trainer.enable_progress_bar", "false", "--no_wandb"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The plug-in package installed by pip into a folder of its own, put on the path."""
    root = tmp_path_factory.mktemp("plugin")
    source, target = root / "src", root / "site"
    shutil.copytree(PLUGIN, source)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True)
    assert (target / "mylab_phasewatch_plugin-0.1.dist-info" / "entry_points.txt").exists()
    from phasewatch import plugins
    from phasewatch.probes import keys, registry
    from phasewatch.tasks import base

    saved = dict(registry._PROBES), dict(keys._FAMILIES), dict(base._REGISTRY), set(plugins._LOADED)
    sys.path.insert(0, str(target))
    yield target
    # the plug-in was installed for these tests only: forget it again
    sys.path.remove(str(target))
    for name in ("mylab_probes", "mylab_tasks", "mylab_extra"):
        sys.modules.pop(name, None)
    for registered, before in zip((registry._PROBES, keys._FAMILIES, base._REGISTRY, plugins._LOADED), saved):
        registered.clear()
        registered.update(before)


def test_a_plugin_probe_and_task_run_end_to_end(site, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["fit", "--data.task", "mylab_subtraction", "--data.task.p", "11",
                 "--probes.names", "[attention_entropy, mylab_extra:top_logit]",
                 "--run_dir", str(run), "--trainer.max_steps", "30", "--trainer.val_check_interval", "5", *TINY])
    assert code == 0
    folder = RunFolder(run)
    config = folder.read_config()
    assert config["data"]["task"]["class_path"] == "mylab_tasks.ModularSubtraction"
    assert config["probes"]["names"] == ["attention_entropy", "mylab_extra:top_logit"]

    series = folder.series()
    steps, entropy = series["attn_entropy/mean"]
    assert steps[0] == 0 and len(steps) >= 6  # a cheap probe: at step 0 and at every validation
    # 3 positions, causal: the entropy of each query's pattern lies between 0 and log(3)
    assert all(0.0 <= e <= math.log(3) + 1e-9 for e in entropy)
    arch = config["model"]["arch"]
    heads = {f"attn_entropy/L{layer}H{h}" for layer in range(arch["n_layers"]) for h in range(arch["n_heads"])}
    assert heads == {k for k in series if k.startswith("attn_entropy/L")}
    assert "mylab/top_logit" in series
    # the task is the plug-in's: (a - b) mod 11 on the held-out pairs the model was validated on
    module_task = __import__("mylab_tasks").ModularSubtraction(p=11)
    batch = module_task.val_batches()[0]
    assert bool(((batch.tokens[:, 0] - batch.tokens[:, 1]) % 11 == batch.targets[:, -1]).all())

    # the report draws the plug-in's declared panel; its per-head detail is not watched live
    report = folder.report.read_text()
    assert "attention entropy (plug-in)" in report
    assert not [e for e in folder.read_events() if e["metric"].startswith("attn_entropy/L")]

    # analyze rebuilds the plug-in task from the run's config and runs the dotted-name probe again
    capsys.readouterr()
    assert main(["analyze", str(run), "--probes", "mylab_extra:top_logit", "--replace", "--device", "cpu",
                 "--no_wandb"]) == 0
    (analysis,) = [json.loads(line) for line in folder.analyses.read_text().splitlines()]
    assert analysis["probes"] == ["top_logit"] and analysis["steps"] == list(folder.checkpoint_steps())
    assert folder.series()["mylab/top_logit"][0] == list(folder.checkpoint_steps())


def test_a_fresh_process_lists_the_installed_plugins(site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "phasewatch", "tasks"], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert "mylab_subtraction" in out and "mylab_tasks.ModularSubtraction" in out
    assert "attention_entropy" in out


def test_a_dotted_name_that_does_not_import_is_one_line(tmp_path, capsys):
    code = main(["fit", "--data.task", "ModularAddition", "--data.task.p", "11", "--probes.names", "[nolab.probes:x]",
                 "--run_dir", str(tmp_path / "run"), "--trainer.max_steps", "5", *TINY])
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("phasewatch:")]
    assert code == 2 and error.startswith("phasewatch: error: probes.names: cannot import 'nolab.probes'")
    assert not (tmp_path / "run").exists()


def test_a_plugin_named_like_a_builtin_is_never_swapped_for_it(site, tmp_path, capsys):
    """`mylab_extra:top_logit` is the plug-in's; a dotted task path is the user's class, even
    when its class name is one of phasewatch's."""
    (tmp_path / "clash.py").write_text("def heads(model, task):\n    return {'clash/x': 1.0}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["fit", "--data.task", "ModularAddition", "--data.task.p", "11", "--probes.names", "[clash:heads]",
                     "--run_dir", str(tmp_path / "run"), "--trainer.max_steps", "5", *TINY])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("clash", None)
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("phasewatch:")]
    assert code == 2 and "the name 'heads' is taken by the probe of phasewatch.probes.heads" in error

"""On a CUDA GPU (skipped without one): training and every probe give on the device what
they give on the CPU. CI has no GPU; run these on a machine with one:

    python -m pytest -q tests/integration/test_gpu.py
"""

import numpy as np
import pytest
import torch

from phasewatch.callbacks.probes import measure
from phasewatch.probes import get_probe
from phasewatch.probes.llc import estimate_llc
from phasewatch.probes.registry import probe_names
from phasewatch.cli.analyze import load_run_module, load_weights
from phasewatch.rundir import read_jsonl

from .test_fit import TASKS, fit

#: the device compared with the CPU
DEVICE = "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _trained(tmp_path, task):
    """The module of a 12-step CPU run of `task`, with its last weights."""
    run = tmp_path / "run"
    assert fit(run, *TASKS[task], "--probes.names", "[]") == 0
    module = load_run_module(run)
    return load_weights(module, run / "checkpoints" / "last.ckpt")


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_probe_gives_the_cpu_values_on_the_device(tmp_path, task):
    module = _trained(tmp_path, task)
    names = [n for n in probe_names() if get_probe(n).applies_to(module.task) and n != "llc"]
    probes = [get_probe(n) for n in names]
    on_cpu = measure(module.model, module.task, probes, {})
    module.to(DEVICE)
    on_device = measure(module.model, module.task, probes, {})
    assert on_device.keys() == on_cpu.keys() == set(names)
    for name in names:
        assert on_device[name].keys() == on_cpu[name].keys(), name
        for key, cpu in on_cpu[name].items():
            got, want = _plain(on_device[name][key]), _plain(cpu)
            if isinstance(want, float):
                assert got == pytest.approx(want, rel=1e-3, abs=1e-4), (name, key)
            elif isinstance(want, np.ndarray) and want.dtype.kind == "f":
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"{name} {key}")
            else:  # labels (heads, pairs, frequencies) and counts
                assert np.array_equal(np.asarray(got), np.asarray(want)), (name, key)


def test_llc_on_the_device_gives_the_known_answer_and_puts_the_weights_back(trained_small_model):
    """The estimator on the device: a d-dimensional quadratic has LLC d/2 (tests/unit/test_llc.py's
    known answer). The probe on a model near a minimum of its training loss (the LLC assumes
    one; a model 12 steps into training is not there, and its estimate can be below 0): finite
    and positive, the same with the chains side by side (the default on a GPU) as one after
    the other, and the weights exactly as before."""
    d = 10
    w = torch.zeros(d, dtype=torch.float64, device=DEVICE)
    out = estimate_llc(lambda t: (w ** 2).sum(), [w], n=1000, chains=4, draws=3000, burn_in=1000,
                       step_size=2e-4, gamma=1.0)
    assert out["llc"] == pytest.approx(d / 2, rel=0.1)
    assert torch.equal(w, torch.zeros(d, dtype=torch.float64, device=DEVICE))

    model, task = trained_small_model
    model.to(DEVICE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimates = []
    for side_by_side in (True, False):
        options = {"llc": {"chains": 2, "draws": 50, "burn_in": 50, "step_size": 1e-4, "gamma": 300.0,
                           "side_by_side": side_by_side}}
        values = measure(model, task, [get_probe("llc")], options)["llc"]
        assert values["llc/converged"] == 1.0 and 0 < values["llc/estimate"] < sum(p.numel() for p in before.values())
        assert _plain(values["trace"]).shape == (2, 100)
        estimates.append(values["llc/estimate"])
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    assert estimates[0] == pytest.approx(estimates[1], rel=1e-3)


def test_training_on_the_device_follows_the_cpu_run(tmp_path):
    """The same 12 steps on the CPU and on the device (fused AdamW, the deferred
    non-finite check, device-resident batches): the same losses up to float error, and
    the probes ran inside the device run."""
    accelerator = {"cuda": "gpu"}.get(DEVICE, DEVICE)
    runs = {"cpu": tmp_path / "cpu", "device": tmp_path / "device"}
    for name, where in (("cpu", "cpu"), ("device", accelerator)):
        assert fit(runs[name], *TASKS["modular_addition"], "--trainer.accelerator", where,
                   "--trainer.devices", "1") == 0

    def series(run, key):
        return {r["step"]: r[key] for r in read_jsonl(run / "metrics.jsonl") if key in r}

    for key in ("train/loss", "val/loss", "grok/restricted_loss"):
        cpu, device = series(runs["cpu"], key), series(runs["device"], key)
        assert cpu and device.keys() == cpu.keys(), key
        assert list(device.values()) == pytest.approx(list(cpu.values()), rel=1e-2, abs=1e-3), key


@pytest.mark.parametrize("task", ["induction", "rasp"])
def test_a_population_on_the_device_trains_each_member_as_on_the_cpu(tmp_path, task):
    """Population training on the GPU (fused AdamW over the stack, the non-finite check at
    logging steps only): every member's metrics match the same population on the CPU."""
    from phasewatch.cli.main import main

    from .test_population import ARGS, _values

    for device in ("cpu", DEVICE):
        assert main(["fit", *TASKS[task], *ARGS, "--trainer.max_steps", "12", "--trainer.accelerator",
                     "gpu" if device == "cuda" else "cpu", "--run_dir", str(tmp_path / device),
                     "--population.seeds", "0-2", "--probes.names", "[]"]) == 0
    for member in ("m00", "m01", "m02"):
        cpu, gpu = _values(tmp_path / "cpu" / member), _values(tmp_path / DEVICE / member)
        assert cpu.keys() == gpu.keys()
        for key, value in cpu.items():
            assert gpu[key] == pytest.approx(value, rel=1e-3, abs=1e-4), (member, key)


def test_chunked_steps_on_the_device_follow_one_step_at_a_time(tmp_path, monkeypatch):
    """Several optimisation steps per Lightning step on the device (new pinned batches every
    step, the deferred non-finite check): the same losses and weights as one step per Lightning
    step on the device, up to float error (a GPU's kernels need not round alike from run to run)."""
    from . import test_step_chunks as chunks

    accelerator = ["--trainer.accelerator", {"cuda": "gpu"}.get(DEVICE, DEVICE), "--trainer.devices", "1"]
    plain = chunks.fit(tmp_path / "plain", False, monkeypatch, *accelerator)
    chunked = chunks.fit(tmp_path / "chunked", True, monkeypatch, *accelerator)
    assert plain == [1] * chunks.STEPS and sum(chunked) == chunks.STEPS and max(chunked) > 1
    rows = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("plain", "chunked")}
    assert [sorted(r) for r in rows["chunked"]] == [sorted(r) for r in rows["plain"]]
    for got, want in zip(rows["chunked"], rows["plain"]):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (want.get("step"), key)
    saved = {name: torch.load(tmp_path / name / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
             for name in ("plain", "chunked")}
    assert saved["chunked"]["global_step"] == saved["plain"]["global_step"] == chunks.STEPS
    for key, value in saved["plain"]["state_dict"].items():
        torch.testing.assert_close(saved["chunked"]["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=key)

"""Test tiers: unit/ (fast, known answers), integration/ (real Trainer), slow/ (--runslow)."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = REPO.parent / "shared" / "reference"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# compiled tracr references: one cache for the session (also for runs started in subprocesses)
TRACR_CACHE = Path(tempfile.mkdtemp(prefix="phasewatch-tracr-"))
atexit.register(shutil.rmtree, TRACR_CACHE, True)
os.environ["PHASEWATCH_TRACR_CACHE"] = str(TRACR_CACHE)

#: output-capturing fixtures whose stream is closed after their test
CAPTURING = {"capsys", "capsysbinary", "capfd", "capfdbinary"}


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    # Lightning gives its loggers a handler on sys.stderr when it is first imported. The CLI
    # imports it lazily, so the first test to run a command under a capturing fixture would leave
    # that handler on a stream closed after the test: every later command's "Seed set to 0" would
    # print a logging traceback into the stderr the hardening tests read. So it is imported here,
    # before any test runs, when a test that runs commands or captures output is collected (not
    # for a lone unit test, e.g. test_browser_fixture's pytest in a subprocess: ~8 s saved).
    if any(not item.nodeid.startswith("tests/unit/") or CAPTURING & set(getattr(item, "fixturenames", ()))
           for item in items):
        import lightning.pytorch  # noqa: F401
    runslow = config.getoption("--runslow")
    if not runslow:
        skip = pytest.mark.skip(reason="slow: pass --runslow to run")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    # the forkserver of warm `phasewatch` processes imports in the background while other tests run
    if any("warm_phasewatch" in getattr(item, "fixturenames", ()) and (runslow or "slow" not in item.keywords)
           for item in items):
        from integration import warm

        warm.ensure_server()


def in_ci() -> bool:
    """Whether the tests run in CI: the environment variable CI is set (.ci/run sets it, as CI
    services do) to anything but "", "0" or "false"."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


@pytest.fixture(scope="session")
def chromium():
    """Debian's headless `chromium` (the path of its program). Where it is missing the browser
    tests are skipped, except in CI (`in_ci`), where they fail: there a browser that did not
    install must not pass as a green run."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing = "no chromium on PATH (install it: apt-get install -y chromium)"
        if in_ci():
            pytest.fail(f"{missing}; CI is set, so the browser tests must run here, not be skipped", pytrace=False)
        pytest.skip(missing)
    return path


@pytest.fixture
def reference_dir():
    path = SHARED_REFERENCE / "progress-measures-paper"
    if not path.is_dir():
        pytest.skip(f"published reference data not found at {path} (../shared/reference beside the repository)")
    return path


@pytest.fixture(scope="session")
def tracr_cache():
    """One disk cache of compiled tracr references for the whole test session."""
    return TRACR_CACHE


@pytest.fixture(scope="session")
def reverse(tracr_cache):
    """make_reverse for vocab {1, 2, 3} and lengths 1-5, compiled, converted and checked
    against tracr on every input (compiled_reference raises if they disagree)."""
    from phasewatch.models.compiled import compiled_reference
    from phasewatch.tasks.tracr_programs import load_program

    program = load_program("reverse", [1, 2, 3], 5)
    bridge, layout = compiled_reference(program, cache_dir=str(tracr_cache))
    return program, bridge, layout, tracr_cache


@pytest.fixture(scope="module")
def trained_small_model():
    """A small modular-addition model trained near a minimum of its training loss (300 Adam
    steps on the CPU; the LLC assumes a minimum) and its task. One per test module: a module
    may move it to another device."""
    import torch

    from phasewatch.models import ModelConfig, build_model
    from phasewatch.tasks import make_task

    torch.manual_seed(0)
    task = make_task("modular_addition", p=13, frac_train=0.5)
    model = build_model(ModelConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32), task)
    batch = task.train_set()
    opt = torch.optim.Adam(model.original_model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(model.original_model(batch.tokens)[:, -1], batch.targets[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, task


@pytest.fixture(scope="session")
def warm_phasewatch():
    """tests/integration/warm.py: `python -m phasewatch ARGS` as child processes forked from a
    server that imported phasewatch and its libraries once (started at collection)."""
    from integration import warm

    warm.ensure_server()
    return warm

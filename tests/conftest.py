"""Test tiers: unit/ (fast, known answers), integration/ (real Trainer), slow/ (--runslow)."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = REPO.parent / "shared" / "reference"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def reference_dir():
    path = SHARED_REFERENCE / "progress-measures-paper"
    if not path.is_dir():
        pytest.skip(f"published reference data not found at {path} (../shared/reference beside the repository)")
    return path

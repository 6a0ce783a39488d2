"""The `chromium` fixture (tests/conftest.py): browser tests skip without the browser only
outside CI; in CI (CI set, as .ci/run does) a missing browser fails them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_fixture_gives_the_browser(chromium):
    assert Path(chromium).is_file() and os.access(chromium, os.X_OK)


@pytest.mark.parametrize("ci, outcome", [("true", "1 error"), ("false", "1 skipped")])
def test_without_a_browser_ci_fails_and_elsewhere_skips(tmp_path, ci, outcome):
    env = {**os.environ, "PATH": str(tmp_path), "CI": ci}  # a PATH on which no chromium is found
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rsE",
                           f"{__file__}::test_the_fixture_gives_the_browser"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert outcome in proc.stdout, proc.stdout[-2000:]
    assert "no chromium on PATH (install it: apt-get install -y chromium)" in proc.stdout
    if outcome == "1 error":
        assert proc.returncode != 0 and "CI is set, so the browser tests must run here" in proc.stdout

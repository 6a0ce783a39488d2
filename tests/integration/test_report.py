"""The HTML report in a real headless Chromium (Debian's `chromium`; skipped without it)."""

import shutil
import subprocess

import pytest
from PIL import Image

from phasewatch.trainers.cli import main

from .test_fit import TASKS, fit

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install -y chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--window-size=1200,3200"]


def screenshot(page, png, tmp_path, fragment=""):
    proc = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
                           page.resolve().as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert png.exists(), proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if "CONSOLE" in line]


def blue_pixels(png):
    """Pixels of the first series colour (#1f77b4): drawn lines, not empty panels."""
    img = Image.open(png).convert("RGB")
    return sum(1 for r, g, b in img.getdata() if abs(r - 31) < 25 and abs(g - 119) < 25 and abs(b - 180) < 25)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "run"
    assert fit(run, *TASKS["induction"], steps=24) == 0
    assert main(["report", str(run)]) == 0
    return run / "report.html"


def test_report_is_self_contained(report):
    text = report.read_text()
    assert "http://" not in text and "https://" not in text  # nothing to fetch
    assert "composition/k" in text and "heads/induction" in text


def test_report_renders_without_console_errors(report, tmp_path):
    png = tmp_path / "page.png"
    console = screenshot(report, png, tmp_path)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    assert blue_pixels(png) > 500  # plots drawn

    # the check above can fail: a broken copy of the page logs an error
    broken = tmp_path / "broken.html"
    broken.write_text(report.read_text().replace("D.panels.forEach(drawPanel)", "D.panels.forEach(drawPanl)"))
    console = screenshot(broken, tmp_path / "broken.png", tmp_path)
    assert any("drawPanl" in line for line in console)


def test_slider_changes_the_heatmap(report, tmp_path):
    first, last = tmp_path / "first.png", tmp_path / "last.png"
    screenshot(report, first, tmp_path, "#checkpoint=0")
    screenshot(report, last, tmp_path)
    a, b = Image.open(first).convert("RGB"), Image.open(last).convert("RGB")
    assert a.size == b.size and a.tobytes() != b.tobytes()

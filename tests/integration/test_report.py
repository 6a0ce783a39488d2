"""The HTML report in a real headless Chromium (Debian's `chromium`: the `chromium` fixture,
skipped without it outside CI, failing without it in CI).

What the page shows is read from the page itself: a copy of the report gets two scripts of
the test's own, one before the page's script that records what each canvas draws (text and
where, since its last clear), one after it that, once the page has loaded, reads each heatmap
(the step it says it shows, its drawn labels, the colour of the pixel where a column label
and a row label meet, what pointing there shows) before and after moving its slider to the
last checkpoint, and writes all that into the DOM, which `chromium --dump-dom` prints. The
page's Content-Security-Policy runs only the scripts it names by hash, so a changed copy names
its own (`run_own_scripts`).
"""

import csv
import html
import json
import math
import re
import subprocess

import numpy as np
import pytest
from PIL import Image

from phasewatch.report.page import script_hash
from phasewatch.rundir import RunFolder
from phasewatch.cli.main import main

from .test_fit import TASKS, fit

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--window-size=1200,3200"]

RECORD = """<script>
window.DRAWN = new Map();  // canvas -> what it drew since its last full clear
const clearRect = CanvasRenderingContext2D.prototype.clearRect, fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.clearRect = function (...a) { DRAWN.set(this.canvas, []); return clearRect.apply(this, a); };
CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
  const m = this.getTransform(), p = new DOMPoint(x, y).matrixTransform(m);
  if (!DRAWN.has(this.canvas)) DRAWN.set(this.canvas, []);
  DRAWN.get(this.canvas).push({text: String(text), x: p.x, y: p.y, angle: Math.round(Math.atan2(m.b, m.a) * 180 / Math.PI)});
  return fillText.call(this, text, x, y, ...rest);
};
</script>"""

READ = """<pre id="seen"></pre><script>
function view(cv) {  // what one heatmap shows now
  const texts = DRAWN.get(cv) || [], g = cv.getContext("2d"), r = cv.getBoundingClientRect();
  const notes = cv.parentNode.querySelectorAll(".note"), cells = {};
  for (const c of texts.filter(t => t.angle === 90)) for (const w of texts.filter(t => t.angle === 0)) {
    const x = Math.floor(c.x), y = Math.floor(w.y);
    if (x < 0 || y < 0 || x >= cv.width || y >= cv.height) continue;
    cv.dispatchEvent(new MouseEvent("mousemove", {clientX: r.left + (x + 0.5) * r.width / cv.width,
                                                  clientY: r.top + (y + 0.5) * r.height / cv.height}));
    cells[c.text + "|" + w.text] = {rgb: Array.from(g.getImageData(x, y, 1, 1).data.slice(0, 3)), readout: notes[1].textContent};
  }
  return {label: notes[0].textContent, texts: texts.map(t => [t.text, t.angle]), cells};
}
window.addEventListener("load", () => {
  const seen = {arrays: {}, trajectory: Array.from(document.images).map(i => [i.alt, i.naturalWidth])};
  for (const cv of document.querySelectorAll("canvas[data-array]")) {
    const slider = cv.parentNode.querySelector("input[type=range]"), first = view(cv);
    slider.value = slider.max; slider.dispatchEvent(new Event("input"));
    seen.arrays[cv.dataset.array] = [first, view(cv)];
  }
  document.getElementById("seen").textContent = JSON.stringify(seen);
});
</script>"""


def run_own_scripts(text):
    """A changed copy of a page whose policy runs its scripts as they now are (the test's own
    among them): every inline script's hash in place of the page's."""
    sources = "script-src " + " ".join(script_hash(s) for s in re.findall(r"<script>(.*?)</script>", text, re.S))
    if "script-src " in text:
        return re.sub(r"script-src [^;\"]*", lambda m: sources, text, count=1)
    assert "default-src 'none'" in text, "the page has no Content-Security-Policy"
    return text.replace("default-src 'none'", f"default-src 'none'; {sources}", 1)  # a page without scripts


def open_page(chromium, page, tmp_path, fragment=""):
    """(console lines, the page's DOM after load) from headless Chromium."""
    proc = subprocess.run([chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                           page.resolve().as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if "CONSOLE" in line], proc.stdout


def what_the_page_shows(chromium, report, tmp_path, fragment=""):
    """The report opened (with `fragment`) in Chromium and read by READ: {"arrays": {name:
    [view as opened, view at the last checkpoint]}, "trajectory": [[alt, width] per image]}."""
    page = tmp_path / "read.html"
    text = report.read_text()
    page.write_text(run_own_scripts(text.replace("</title>", "</title>" + RECORD, 1)
                                    .replace("</body>", READ + "</body>", 1)))
    console, dom = open_page(chromium, page, tmp_path, fragment)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    match = re.search(r'<pre id="seen">(.*?)</pre>', dom, re.S)
    assert match and match.group(1), dom[-2000:]
    return json.loads(html.unescape(match.group(1)))


def screenshot(chromium, page, png, tmp_path, fragment=""):
    proc = subprocess.run([chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
                           page.resolve().as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert png.exists(), proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if "CONSOLE" in line]


def blue_pixels(png):
    """Pixels of the first series colour (#1f77b4): drawn lines, not empty panels."""
    img = Image.open(png).convert("RGB")
    return sum(1 for r, g, b in img.getdata() if abs(r - 31) < 25 and abs(g - 119) < 25 and abs(b - 180) < 25)


def heat_rgb(v, lo, hi):
    """The report's colour of a value in the colour range [lo, hi] (#eee: no value)."""
    if v is None or math.isnan(v):
        return [238, 238, 238]
    f = (v - lo) / (hi - lo) if hi > lo else 0.5
    return [255 * min(1, 2 * f), 255 * (1 - abs(f - 0.5) * 2) * 0.85, 255 * min(1, 2 * (1 - f))]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A real 2-layer induction run (24 steps) and its report, written by `phasewatch report` only."""
    run = tmp_path_factory.mktemp("report") / "run"
    assert fit(run, *TASKS["induction"], steps=24) == 0
    assert main(["report", str(run)]) == 0
    return run / "report.html"


def test_report_is_self_contained(report):
    text = report.read_text()
    assert "http://" not in text and "https://" not in text  # nothing to fetch
    assert "composition/k" in text and "heads/induction" in text


def test_report_renders_without_console_errors(report, tmp_path, chromium):
    png = tmp_path / "page.png"
    console = screenshot(chromium, report, png, tmp_path)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    assert blue_pixels(png) > 500  # plots drawn

    # the check above can fail: a broken copy of the page logs an error
    broken = tmp_path / "broken.html"
    broken.write_text(run_own_scripts(report.read_text().replace("D.panels.forEach(drawPanel)",
                                                                 "D.panels.forEach(drawPanl)")))
    console = screenshot(chromium, broken, tmp_path / "broken.png", tmp_path)
    assert any("drawPanl" in line for line in console)


def drawn(view, angle):
    return [text for text, a in view["texts"] if a == angle]


def test_heatmap_axes_name_the_heads(report, tmp_path, chromium):
    seen = what_the_page_shows(chromium, report, tmp_path)["arrays"]
    heads = ["L0H0", "L0H1", "L1H0", "L1H1"]  # 2 layers of 2 heads
    for kind in "qkv":
        view = seen[f"composition/{kind}"][0]
        assert drawn(view, 0)[:4] == heads and drawn(view, 90) == heads  # row labels, then column labels
        assert drawn(view, -90) == ["writing head (earlier layer)"]  # the rows' title
        assert drawn(view, 0)[4:] == ["reading head (later layer)"]  # the columns' title
        # the cell where L0H1's row meets L1H0's column says so when pointed at
        assert view["cells"]["L1H0|L0H1"]["readout"].startswith(
            "writing head (earlier layer) L0H1, reading head (later layer) L1H0: ")
    for kind in ("prev_token", "induction", "duplicate", "copying"):
        view = seen[f"heads/{kind}"][0]
        assert drawn(view, 0) == ["L0", "L1", "head"] and drawn(view, 90) == ["H0", "H1"]
        assert drawn(view, -90) == ["layer"]
        assert view["cells"]["H1|L0"]["readout"].startswith("layer L0, head H1: ")


def test_slider_shows_each_checkpoints_values(report, tmp_path, chromium):
    folder = RunFolder(report.parent)
    seen = what_the_page_shows(chromium, report, tmp_path, "#checkpoint=0")["arrays"]
    heads = ["L0H0", "L0H1", "L1H0", "L1H1"]
    # (row name, column name, index) of the cells to read: every head score; composition of a layer-0 head into a layer-1 head
    cells = {("heads", "induction"): [(f"L{l}", f"H{h}", (l, h)) for l in (0, 1) for h in (0, 1)],
             ("composition", "k"): [(heads[w], heads[r], (0, w, 1, r - 2)) for w in (0, 1) for r in (2, 3)]}
    for (probe, key), where in cells.items():
        files = folder.array_files(probe, key)
        steps = [s for s, _ in files]
        data = [np.round(np.load(f), 5) for _, f in files]  # as the page holds them
        lo, hi = np.nanmin(data), np.nanmax(data)  # one colour range over all checkpoints
        first, last = seen[f"{probe}/{key}"]
        for view, k in ((first, 0), (last, len(steps) - 1)):  # opened at checkpoint 0, then the slider at the end
            assert view["label"].startswith(f"step {steps[k]} (checkpoint {k + 1} of {len(steps)})")
            for row, col, index in where:
                value, cell = float(data[k][index]), view["cells"][f"{col}|{row}"]
                assert np.allclose(cell["rgb"], heat_rgb(value, lo, hi), atol=1.01), (probe, key, k, row, col)
                assert float(cell["readout"].rsplit(": ", 1)[1]) == pytest.approx(value, rel=1e-3, abs=1e-6)
        assert not np.allclose(data[0], data[-1], equal_nan=True)  # the run changed: so must the page
        assert first["cells"] != last["cells"]


def test_report_shows_the_trajectory_without_a_trajectory_command(report, tmp_path, chromium):
    folder = RunFolder(report.parent)
    steps = list(folder.checkpoint_steps())
    assert len(steps) >= 3 and folder.figure("trajectory").exists()
    for kind in ("logits", "weights"):
        assert np.load(folder.trajectory_pca(kind))[:, 0].tolist() == steps
    images = what_the_page_shows(chromium, report, tmp_path)["trajectory"]
    assert [width > 500 for alt, width in images if "PCA paths of the checkpoints" in alt] == [True]


def test_head_catalogue_panel_and_file(report, tmp_path, chromium):
    """heads.csv, written with the report, and its heads x scores panel: the rows name the
    heads, the columns the scores; pointing at a cell reads heads.csv's value at the slider's
    step, and its colour is the value within that score's own range over the run."""
    with open(report.parent / "heads.csv") as f:
        rows = list(csv.DictReader(f))
    heads = ["L0H0", "L0H1", "L1H0", "L1H1"]
    steps = sorted({int(r["step"]) for r in rows})
    assert [r["head"] for r in rows if int(r["step"]) == steps[-1]] == heads
    assert {"heads/induction", "heads/prev_token", "comp/k/out", "comp/k/in"} <= set(rows[0])
    first, last = what_the_page_shows(chromium, report, tmp_path, "#checkpoint=0")["arrays"]["head catalogue (heads.csv)"]
    for score in ("heads/induction", "heads/prev_token"):
        values = [float(r[score]) for r in rows if r[score]]
        lo, hi = min(values), max(values)
        for view, step in ((first, steps[0]), (last, steps[-1])):
            assert view["label"].startswith(f"step {step} (checkpoint")
            for head in heads:
                value = float(next(r[score] for r in rows if int(r["step"]) == step and r["head"] == head))
                cell = view["cells"][f"{score}|{head}"]
                assert float(cell["readout"].rsplit(": ", 1)[1]) == pytest.approx(value, rel=1e-3, abs=1e-5)
                assert np.allclose(cell["rgb"], heat_rgb((value - lo) / (hi - lo), 0, 1), atol=2.01), (score, head)

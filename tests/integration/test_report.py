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
import shutil
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
window.DRAWN = new Map();  // canvas -> what it drew since its last full clear: texts, and rectangles (RECTS)
window.RECTS = new Map();
const clearRect = CanvasRenderingContext2D.prototype.clearRect, fillText = CanvasRenderingContext2D.prototype.fillText;
const fillRect = CanvasRenderingContext2D.prototype.fillRect;
CanvasRenderingContext2D.prototype.clearRect = function (...a) { DRAWN.set(this.canvas, []); RECTS.set(this.canvas, []); return clearRect.apply(this, a); };
CanvasRenderingContext2D.prototype.fillRect = function (x, y, w, h) {
  if (!RECTS.has(this.canvas)) RECTS.set(this.canvas, []);
  RECTS.get(this.canvas).push({x, y, w, h, style: String(this.fillStyle)});
  return fillRect.call(this, x, y, w, h);
};
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


# --- readability (issue 44): header, ticks, band legend, tables, colour bars, names -----------------

READ_DRAWN = """<pre id="drawn"></pre><script>
window.addEventListener("load", () => {  // what each panel and colour bar drew
  const out = {panels: {}, colorbars: {}};
  for (const cv of document.querySelectorAll("canvas[data-title]")) out.panels[cv.dataset.title] = (DRAWN.get(cv) || []).map(t => [t.text, t.x, t.y]);
  for (const cv of document.querySelectorAll("canvas[data-colorbar]")) { const g = cv.getContext("2d");
    out.colorbars[cv.dataset.colorbar] = (DRAWN.get(cv) || []).map(t => [t.text, Array.from(g.getImageData(15, Math.round(t.y - 3), 1, 1).data.slice(0, 3))]); }
  document.getElementById("drawn").textContent = JSON.stringify(out);
});
</script>"""

SUPERSCRIPT = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")
TICK = re.compile(r"-?\d+(\.\d+)?|(\d+(\.\d+)?×)?10[⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+")


def tick_value(text):
    """A tick label's value: a plain number, or m×10ⁿ / 10ⁿ."""
    if "10" in text and text.translate(SUPERSCRIPT) != text:
        mantissa, _, power = text.rpartition("10")
        return float(mantissa.rstrip("×") or 1) * 10 ** int(power.translate(SUPERSCRIPT))
    return float(text)


def payload_of(page):
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page.read_text(), re.S).group(1))


def page_drawn(chromium, report, tmp_path, fragment=""):
    """(what the canvases drew, the DOM) of the report in Chromium."""
    page = tmp_path / "drawn.html"
    page.write_text(run_own_scripts(report.read_text().replace("</title>", "</title>" + RECORD, 1)
                                    .replace("</body>", READ_DRAWN + "</body>", 1)))
    console, dom = open_page(chromium, page, tmp_path, fragment)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    return json.loads(html.unescape(re.search(r'<pre id="drawn">(.*?)</pre>', dom, re.S).group(1))), dom


def texts_of(dom, element_id):
    """The text of the element with `element_id` (tags dropped), or None."""
    match = re.search(rf'<(\w+) id="{element_id}"[^>]*>(.*?)</\1>', dom, re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", match.group(2))) if match else None


@pytest.fixture(scope="module")
def edited(report, tmp_path_factory):
    """The report's run with hand-built transitions (two of val/loss, one of val/acc together
    with both, a small one of train/loss), two stages (the first, named, of val/loss's fall,
    val/acc's rise and train/loss's small fall; the second, unnamed, of val/loss's rise), and a
    compiled head's attention match."""
    from phasewatch.phases.stages import Stage, write_stages
    from phasewatch.rundir import append_jsonl, load_series

    run = tmp_path_factory.mktemp("edited") / "run"
    shutil.copytree(report.parent, run)
    folder = RunFolder(run)
    series = load_series(run)
    span = {k: float(np.ptp(series[k][1])) for k in ("val/loss", "val/acc", "train/loss")}
    events = [{"metric": "val/loss", "direction": "down", "onset": 4, "midpoint": 8, "end": 12, "magnitude": -0.5 * span["val/loss"]},
              {"metric": "val/loss", "direction": "up", "onset": 16, "midpoint": 18, "end": 20, "magnitude": 0.3 * span["val/loss"]},
              {"metric": "train/loss", "direction": "down", "onset": 4, "midpoint": 10, "end": 16, "magnitude": -0.02 * span["train/loss"]},
              {"metric": "val/acc", "direction": "up", "onset": 6, "midpoint": 7, "end": 9, "magnitude": 0.4 * span["val/acc"]}]
    folder.rewrite(folder.events, events)
    member = lambda i: dict(events[i], series=events[i]["metric"])
    write_stages(folder, [Stage(1, 4, 8, 16, [member(3), member(0), dict(member(2), size=0.02)], "val/acc", "induction"),
                          Stage(2, 16, 18, 20, [member(1)], "val/loss", under_way_at_end=True)])
    for step in (8, 16, 24):
        append_jsonl(folder.metrics, {"step": step, "tracr/attn_match/L1H0": step / 24})
    assert main(["report", str(run)]) == 0
    return folder.report


def test_header_says_the_runs_state_its_config_and_links_its_files(edited, tmp_path, chromium):
    from phasewatch.rundir import flatten_config

    folder = RunFolder(edited.parent)
    _, dom = page_drawn(chromium, edited, tmp_path)
    last = max(r["step"] for r in folder.read_metrics())
    config = flatten_config(folder.read_config(), fold_init_args=True)
    assert texts_of(dom, "state").startswith(f"step {last} of {config['trainer.max_steps']}, finished; last update 20")
    fields = texts_of(dom, "config")
    for key in ("model.arch.n_layers", "model.arch.d_model", "model.lr", "trainer.max_steps", "seed_everything"):
        short = key.rsplit(".", 1)[-1]
        assert f"{short}  {config[key]}" in fields, (key, fields)
    links = re.findall(r'<a href="([^"]+)"', re.search(r'<div id="files".*?</div>', dom, re.S).group(0))
    assert {"config.yaml", "metrics.jsonl", "events.jsonl", "stages.jsonl", "checkpoints"} <= set(links)
    assert all((folder.root / link).exists() for link in links)


def test_tick_labels_are_round_numbers_or_powers_of_ten_within_the_data(edited, tmp_path, chromium):
    drawn, _ = page_drawn(chromium, edited, tmp_path)
    data = payload_of(edited)
    checked = 0
    for panel in data["panels"]:
        texts = drawn["panels"].get(panel["title"], [])
        ys = [tick_value(t) for t, x, _ in texts if x == 48]  # right-aligned at the value axis
        xs = [tick_value(t) for t, _, y in texts if y == 212]  # under the step axis
        for text, x, y in texts:
            if x == 48 or y == 212:
                assert TICK.fullmatch(text) and "e" not in text, (panel["title"], text)
        pairs = [(s, v) for k in panel["keys"] if k in data["series"] for s, v in zip(*data["series"][k])
                 if s >= 1 and (v > 0 or not panel["log_y"])]
        if not pairs or len({v for _, v in pairs}) < 2:
            continue
        steps, values = [s for s, _ in pairs], [v for _, v in pairs]
        assert len(ys) >= 2 and len(xs) >= 1, (panel["title"], texts)
        slack = 1e-6 * (max(values) - min(values))
        assert all(min(values) - slack <= v <= max(values) + slack for v in ys), (panel["title"], ys, min(values), max(values))
        assert all(min(steps) <= s <= max(steps) for s in xs), (panel["title"], xs)
        if not panel["log_y"]:  # round steps: equally spaced
            assert len({round(b - a, 9) for a, b in zip(ys, ys[1:])}) == 1, ys
        checked += 1
    assert checked >= 3


def test_band_legend_tables_and_names_follow_the_events(edited, tmp_path, chromium):
    from phasewatch.phases.detector import lead_lag

    _, dom = page_drawn(chromium, edited, tmp_path, "#stage=all")  # every transition's band, as a link asks
    legends = {title: html.unescape(re.sub(r"<[^>]+>", " ", body)) for title, body in
               re.findall(r'<div class="bands" data-bands="([^"]+)">(.*?)</div>', dom, re.S)}
    squash = lambda text: re.sub(r"\s+", " ", text).strip()
    assert squash(legends["loss"]) == ("shaded: ■ val/loss ↓down, steps 4–12 ■ val/loss ↑up, steps 16–20 (1 small change, "
                                       "under 10% of the series' range, not shaded: see the table)")
    assert squash(legends["accuracy"]) == "shaded: ■ val/acc ↑up, steps 6–9"
    rows = lambda element: [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", element)][1:]
    main_rows = rows(re.search(r'<table id="transitions">.*?</table>', dom, re.S).group(0))
    assert [(r[0], r[3], r[6]) for r in main_rows] == [("val/acc", "7", "40%"), ("val/loss", "8", "50%"), ("val/loss", "18", "30%")]
    folded = re.search(r'<details id="small-transitions">.*?</details>', dom, re.S).group(0)
    assert "1 small transition" in folded and [(r[0], r[6]) for r in rows(folded)] == [("train/loss", "2%")]
    events = RunFolder(edited.parent).transitions()
    assert [r["metric"] for r in lead_lag(events, "val/loss")].count("val/acc") == 2  # the detector pairs it with both
    leadlag = [r[1] for r in rows(re.search(r'<table id="leadlag">.*?</table>', dom, re.S).group(0))]
    assert sorted(leadlag) == ["train/loss", "val/acc"]  # each series once
    spans = re.findall(r"<span[^>]*>(■ [^<]*)</span>", dom)
    assert "■ tracr/attn_match/compiled-L1H0" in spans and "■ tracr/attn_match/L1H0" not in spans
    assert "■ train/loss (smoothed; raw points faint)" in spans and "■ val/loss" in spans


def test_heatmaps_have_colour_bars_for_their_values(edited, tmp_path, chromium):
    drawn, _ = page_drawn(chromium, edited, tmp_path)
    arrays = payload_of(edited)["arrays"]
    for name in ("composition/k", "heads/induction"):
        values = [v for m in arrays[name]["data"] for row in m for v in row if v is not None]
        lo, hi = min(values), max(values)
        ticks = drawn["colorbars"][name]
        assert len(ticks) >= 2, (name, ticks)
        for text, rgb in ticks:
            assert TICK.fullmatch(text), text
            v = tick_value(text)
            assert lo - 1e-9 <= v <= hi + 1e-9, (name, v, lo, hi)
            assert np.allclose(rgb, heat_rgb(v, lo, hi), atol=6), (name, text, rgb)  # the bar's colour at the tick
    assert [t for t, _ in drawn["colorbars"]["head catalogue (heads.csv)"]] == ["column min", "column max"]
    assert set(drawn["colorbars"]) == set(arrays)  # every heatmap has one


# --- issue 43: the stage timeline and table; the stages over every panel; a stage's bands on demand --

READ_BANDS = """<pre id="bands"></pre><script>
window.addEventListener("load", () => {  // what the panels draw as opened, then after each of the reader's clicks
  const seen = [], tick = key => document.querySelector(`input[data-stage="${key}"]`).click();
  const legend = div => div && Array.from(div.querySelectorAll("span")).filter(s => !s.children.length).map(s => s.textContent).join(" ");
  const snap = what => {
    const panels = {};
    for (const cv of document.querySelectorAll("canvas[data-title]")) panels[cv.dataset.title] = {
      rects: RECTS.get(cv) || [], texts: (DRAWN.get(cv) || []).map(t => [t.text, t.x, t.y]),
      legend: legend(document.querySelector(`div[data-bands="${cv.dataset.title}"]`))};
    const ticked = Array.from(document.querySelectorAll("input[data-stage]")).filter(c => c.checked).map(c => c.dataset.stage);
    const timeline = (DRAWN.get(document.getElementById("stage-timeline")) || []).map(t => t.text);
    seen.push({what, panels, ticked, hash: location.hash, timeline});
  };
  snap("opened");
  tick(1); snap("stage 1 ticked");
  tick(1); snap("stage 1 unticked");
  tick(2); snap("stage 2 ticked");
  const cv = document.getElementById("stage-timeline"), r = cv.getBoundingClientRect();  // stage 1's row: y 6 to 28
  cv.dispatchEvent(new MouseEvent("click", {clientX: r.left + 100, clientY: r.top + 17 * r.height / cv.height}));
  snap("stage 1's row clicked");
  tick("all"); snap("every transition ticked");
  tick("all"); snap("every transition unticked");
  document.getElementById("bands").textContent = JSON.stringify(seen);
});
</script>"""

BAND = re.compile(r"rgba\((214, 39, 40|44, 160, 44), [\d.]+\)")


def step_axis(texts):
    """The panel's step axis as drawn, from its tick labels (under the plot, centred on their
    steps): step -> canvas x."""
    ticks = [(math.log10(tick_value(text)), x) for text, x, y in texts if y == 212]
    (l0, x0), (l1, x1) = min(ticks), max(ticks)
    return lambda step: x0 + (math.log10(step) - l0) / (l1 - l0) * (x1 - x0)


def bands_drawn(panel):
    """The per-series bands a panel drew: {(direction, onset x, end x)} (red: down, green: up)."""
    return {("down" if "214" in r["style"] else "up", round(r["x"]), round(r["x"] + r["w"]))
            for r in panel["rects"] if BAND.fullmatch(r["style"])}


def test_stage_timeline_and_each_stages_series_bands_on_demand(edited, tmp_path, chromium):
    """The stage timeline and table: one row per stage (span, name or "unnamed", lead, what
    moved; a stage under way at the end of the data marked so). As opened, every panel shades each stage's span and names it, and no series' band; ticking a
    stage shades exactly its members' transitions on their panels (stage 1: val/loss down 4-12 and
    train/loss's small fall 4-16 on the loss panel, val/acc up 6-9 on the accuracy panel; stage 2:
    val/loss up 16-20), unticking
    removes them, a click on the stage's timeline row does what ticking does, and "every series'
    transitions" shades all but the small one (train/loss, 2% of its range)."""
    page = tmp_path / "bands.html"
    page.write_text(run_own_scripts(edited.read_text().replace("</title>", "</title>" + RECORD, 1)
                                    .replace("</body>", READ_BANDS + "</body>", 1)))
    console, dom = open_page(chromium, page, tmp_path)
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    seen = {s["what"]: s for s in json.loads(html.unescape(re.search(r'<pre id="bands">(.*?)</pre>', dom, re.S).group(1)))}
    rows = [t for t in seen["opened"]["timeline"] if t.startswith("stage ")]
    assert rows == ["stage 1 induction: steps 4–16, led by val/acc", "stage 2 (unnamed): steps 16–20+, led by val/loss"]
    table = re.search(r'<table id="stage-table">.*?</table>', dom, re.S).group(0)
    cells = [re.findall(r"<td>([^<]*)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table)][1:]
    assert cells == [["1", "induction", "4–16", "8", "val/acc", "", "val/acc up, val/loss down, train/loss down"],
                     ["2", "unnamed", "16–20 (under way at the end)", "18", "val/loss", "", "val/loss up"]]
    data = payload_of(edited)
    panels = {p["title"]: p["keys"] for p in data["panels"]}
    stage_1 = {"val/loss": {("down", 4, 12)}, "train/loss": {("down", 4, 16)}, "val/acc": {("up", 6, 9)}}
    stage_2 = {"val/loss": {("up", 16, 20)}}
    expected = {"opened": {}, "stage 1 ticked": stage_1, "stage 1 unticked": {}, "stage 2 ticked": stage_2,
                "stage 1's row clicked": {**stage_1, "val/loss": stage_1["val/loss"] | stage_2["val/loss"]},
                "every transition ticked": {"val/loss": stage_1["val/loss"] | stage_2["val/loss"], "val/acc": stage_1["val/acc"]},
                "every transition unticked": {}}
    assert list(seen) == list(expected)
    for what, bands in expected.items():
        drawn = seen[what]["panels"]
        assert set(drawn) == set(panels)
        for title, panel in drawn.items():
            X = step_axis(panel["texts"])
            want = {(d, round(X(a)), round(X(b))) for key in panels[title] for d, a, b in bands.get(key, ())}
            got = bands_drawn(panel)
            assert len(got) == len(want) and all(any(g[0] == w[0] and abs(g[1] - w[1]) <= 1 and abs(g[2] - w[2]) <= 1
                                                     for g in got) for w in want), (what, title, got, want)
            if not want:
                assert panel["legend"] is None, (what, title)
        if what == "opened":  # each stage's span over every panel (within the steps it covers), named above it
            for title, panel in drawn.items():
                X = step_axis(panel["texts"])
                steps = [s for k in panels[title] if k in data["series"] for s in data["series"][k][0] if s >= 1]
                names = [t for t, _, _ in panel["texts"]]
                assert "1 induction" in names and "2 unnamed" in names, (title, names)
                for onset, end in ((4, 16), (16, 20)):
                    onset, end = max(onset, min(steps)), min(end, max(steps))
                    assert any(abs(r["x"] - X(onset)) <= 1 and abs(r["x"] + r["w"] - X(end)) <= 1 and r["h"] > 100
                               and not BAND.fullmatch(r["style"]) for r in panel["rects"]), (title, onset, end)
    loss, acc = next(t for t, k in panels.items() if "val/loss" in k), next(t for t, k in panels.items() if "val/acc" in k)
    assert seen["stage 1 ticked"]["panels"][loss]["legend"] == ("stage 1 induction: ■ val/loss ↓down, steps 4–12 ■ train/loss "
                                                                "↓down, steps 4–16 (small: under 10% of its range)")
    assert seen["stage 1 ticked"]["panels"][acc]["legend"] == "stage 1 induction: ■ val/acc ↑up, steps 6–9"
    assert seen["stage 2 ticked"]["panels"][loss]["legend"] == "stage 2 unnamed: ■ val/loss ↑up, steps 16–20"
    assert [(s["ticked"], s["hash"]) for s in seen.values()] == [
        ([], ""), (["1"], "#stage=1"), ([], ""), (["2"], "#stage=2"), (["1", "2"], "#stage=2,1"),
        (["all"], "#stage=all"), ([], "")]  # the address keeps what is shown (a link, a reload)

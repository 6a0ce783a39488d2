"""`phasewatch report RUN_DIR`: one self-contained HTML file (no network needed).

What it shows: every series on a log-step axis in panels by family (losses, accuracy,
grokking measures, head scores, composition, ...), the detected transitions as shaded
bands (from the run's events, or detected now when the run has none), the lead/lag summary
against val/loss, and the array measurements (composition [L,H,L,H] tensors, head-score
[L,H] matrices, the grokking spectrum) as heatmaps with a slider over checkpoints (one
colour range over all checkpoints; log10 for positive values spanning over three decades).
Heatmap axes name what they index: heads (`L0H1`) for arrays shaped by the run's model
(composition rows: the writing head, columns: the reading head in a later layer; head scores:
layer by head), else the names a probe saves beside the array (`<key>_labels`); pointing at a
cell shows its names and value. The checkpoint trajectory figure is shown when the run folder
has one (`phasewatch report` draws it first: cli/trajectory.py). The data are embedded as
JSON and drawn by a small script on <canvas>; nothing is fetched. Every string from the run
folder (metric keys, event fields, labels, names) is shown as text, never read as markup, and
the page's Content-Security-Policy runs its own script only (report/page.py). Opening it as
`report.html#checkpoint=K` puts every slider at checkpoint K. `live=True` adds a meta refresh,
for the copy a running training rewrites.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import numpy as np

from phasewatch.models import head_label
from phasewatch.probes.keys import declared_scale, is_detail
from phasewatch.phases.detector import detect_all, lead_lag
from phasewatch.report.curves import panel_layout
from phasewatch.report.heads import catalogue_array, head_catalogue, write_head_catalogue
from phasewatch.report.page import load_array, policy, script_json
from phasewatch.rundir import RunFolder, load_series, read_csv

REFRESH_SECONDS = 30
#: arrays drawn as one line per row (over their columns) instead of as a heatmap
LINES = {"trace"}  # the LLC's SGLD chains: loss per sampling step


def _arrays(folder: RunFolder) -> dict[str, dict]:
    """The run's arrays of numeric matrices -> {"<probe>/<key>": {steps, data, rows/cols: names,
    row_title/col_title}}: names from a sibling `<key>_labels` array, else head names for
    arrays shaped by the model's heads (`_head_axes`)."""
    out: dict[str, dict] = {}
    heads = _model_heads(folder)
    for probe, key in folder.array_keys():
        mats, steps, shape = [], [], None
        for step, f in folder.array_files(probe, key):
            a = load_array(f)
            if a.dtype.kind not in "fiu" or a.ndim not in (1, 2, 3, 4) or a.size == 0:
                break
            shape = a.shape
            if a.ndim == 4:  # [layer, head, layer, head] -> (layer*head) x (layer*head)
                a = a.reshape(a.shape[0] * a.shape[1], a.shape[2] * a.shape[3])
            if a.ndim == 3:  # e.g. [reference head, layer, head] -> reference head x (layer*head)
                a = a.reshape(a.shape[0], -1)
            if a.ndim == 1:
                a = a[None, :]
            finite = np.isfinite(a)
            cells = np.round(np.where(finite, a, 0.0).astype(float), 5).astype(object)
            cells[~finite] = None  # JSON has no NaN (e.g. composition pairs with l1 >= l2)
            mats.append(cells.tolist())
            steps.append(step)
        if mats and all(np.shape(m) == np.shape(mats[0]) for m in mats):
            axes = _labels(folder, probe, key, mats[0]) or _head_axes(shape, heads)
            out[f"{probe}/{key}"] = {"steps": steps, "data": mats, **axes, "lines": key in LINES}
    return out


def _model_heads(folder: RunFolder) -> tuple[int, int] | None:
    """(layers, heads) of the run's model, from its config (None when it does not say)."""
    try:
        arch = (folder.read_config().get("model") or {}).get("arch") or {}
    except Exception:  # noqa: BLE001 - no config, or not one phasewatch wrote: no head names
        return None
    n_layers, n_heads = arch.get("n_layers"), arch.get("n_heads")
    return (n_layers, n_heads) if isinstance(n_layers, int) and isinstance(n_heads, int) else None


def _head_axes(shape: tuple[int, ...], heads: tuple[int, int] | None) -> dict:
    """Axis names of an array shaped by the model's heads: [layer, head, layer, head]
    (composition: the writing head, whose W_V W_O output is read, then the reading head, in a
    later layer), [layer, head] (a score per head), [row, layer, head] (columns: heads)."""
    if heads is None:
        return {}
    names = [head_label(layer, head) for layer in range(heads[0]) for head in range(heads[1])]
    if shape == (*heads, *heads):
        return {"rows": names, "cols": names, "row_title": "writing head (earlier layer)",
                "col_title": "reading head (later layer)"}
    if shape == heads:
        return {"rows": [f"L{layer}" for layer in range(heads[0])], "cols": [f"H{head}" for head in range(heads[1])],
                "row_title": "layer", "col_title": "head"}
    if len(shape) == 3 and shape[1:] == heads:
        return {"cols": names, "col_title": "head"}
    return {}


def _labels(folder: RunFolder, probe: str, key: str, matrix: list) -> dict:
    """Row and column names from a sibling `<key>_labels` array (rows first), if any."""
    files = folder.array_files(probe, f"{key}_labels")
    if not files:
        return {}
    names = [str(x) for x in load_array(files[-1][1]).tolist()]
    rows, cols = len(matrix), len(matrix[0])
    return {"rows": names[:rows], "cols": names[rows:rows + cols]} if len(names) == rows + cols else {}


def build_report(run_dir: str | Path, live: bool = False,
                 catalogue: tuple[list[str], list[dict]] | None = None) -> str:
    """The report's HTML; `catalogue`: the run's per-head catalogue when already read
    (`head_catalogue`; read here otherwise)."""
    folder = RunFolder(run_dir)
    series = load_series(folder.root)
    watched = {k: v for k, v in series.items() if not is_detail(k)}
    events = folder.transitions() or detect_all(watched, declared=declared_scale)  # bands on the watcher's scale
    panels = [{"title": t, "keys": k, "log_y": y == "log"} for t, k, y in panel_layout(series) if k]
    reference = "val/loss" if "val/loss" in series else None
    payload = {
        "name": folder.root.name,
        "series": {k: [list(map(float, s)), list(map(float, v))] for k, (s, v) in series.items()},
        "panels": panels,
        "events": events,
        "leadlag": lead_lag(events, reference) if reference else [],
        "arrays": _arrays(folder) | _catalogue(catalogue or head_catalogue(folder)),
        "interventions": folder.read_interventions(),
        "diffs": _diffs(folder),
    }
    data = script_json(payload)
    trajectory = folder.figure("trajectory")
    figure = (f'<h2>Checkpoint trajectory</h2><img alt="PCA paths of the checkpoints (phasewatch trajectory)" '
              f'style="max-width:100%" src="data:image/png;base64,{base64.b64encode(trajectory.read_bytes()).decode()}">'
              if trajectory.exists() else "")
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if live else ""
    fields = {"POLICY": policy(SCRIPT), "REFRESH": refresh, "TITLE": html.escape(folder.root.name),
              "TRAJECTORY": figure, "DATA": data, "SCRIPT": SCRIPT}
    # in one pass: a run named "%DATA%" stays its name
    return re.sub(r"%(POLICY|REFRESH|TITLE|TRAJECTORY|DATA|SCRIPT)%", lambda m: fields[m.group(1)], TEMPLATE)


#: the diff columns the report shows (all are in diff/<name>.csv)
DIFF_COLUMNS = ("weight_rel", "qk_rel", "ov_rel", "act_rel", "dla_a", "dla_b", "patch_b_into_a", "patch_a_into_b")


def _diffs(folder: RunFolder) -> list[dict]:
    """The run's `phasewatch diff` tables: per diff its name, component rows (numbers or None)
    and the inputs whose loss changed most."""
    out = []
    for name in folder.diff_names():
        table, inputs = folder.diff_tables(name)
        rows = [{"component": r["component"], "kind": r["kind"],
                 **{c: float(r[c]) if r.get(c) else None for c in DIFF_COLUMNS}} for r in read_csv(table)
                if r.get("kind") not in ("resid", "bias")]
        out.append({"name": name, "columns": list(DIFF_COLUMNS), "rows": rows, "inputs": read_csv(inputs)[:5]})
    return out


def _catalogue(catalogue: tuple[list[str], list[dict]]) -> dict[str, dict]:
    """The per-head catalogue as one more array panel (report/heads.py), when probes scored heads."""
    columns, rows = catalogue
    drawn = catalogue_array(columns, rows) if rows else None
    return {"head catalogue (heads.csv)": drawn} if drawn else {}


def write_report(run_dir: str | Path, out: str | Path | None = None, live: bool = False) -> Path:
    """Write the report (default: the run folder's report) atomically, and the run's per-head
    catalogue (`heads.csv`, report/heads.py) beside it; returns the report's path."""
    folder = RunFolder(run_dir)
    folder.require_metrics()
    catalogue = head_catalogue(folder)
    write_head_catalogue(folder, catalogue)
    return folder.write_atomic(Path(out) if out else folder.report, build_report(folder.root, live, catalogue))


TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
%POLICY%%REFRESH%
<title>phasewatch: %TITLE%</title>
<style>
body{font-family:system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:4px 0 12px} h2{font-size:15px;margin:18px 0 6px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px;margin:8px 0;display:inline-block;vertical-align:top}
.legend span{display:inline-block;margin-right:10px;font-size:12px} table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left} .note{color:#666;font-size:12px}
</style></head><body>
<h1>phasewatch report: %TITLE%</h1>
<div class="note">Every series on a log-step axis; shaded bands are detected phase transitions.</div>
<div id="panels"></div>
<h2>Transitions and lead/lag</h2><div id="events"></div>
<h2>Arrays over checkpoints</h2><div id="arrays"></div>
%TRAJECTORY%
<div id="diffs"></div>
<script id="data" type="application/json">%DATA%</script>
<script>%SCRIPT%</script></body></html>
"""

#: the page's one script (its SHA-256 is in the page's policy): it shows every string with
#: textContent or on a canvas, never as markup
SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const COLORS = ["#1f77b4","#ff7f0e","#2ca02c","#d62728","#9467bd","#8c564b","#e377c2","#7f7f7f","#bcbd22","#17becf"];
const W = 560, H = 220, M = {l: 52, r: 10, t: 10, b: 26};
function el(tag, attrs, parent) { const e = document.createElement(tag); Object.assign(e, attrs || {}); if (parent) parent.appendChild(e); return e; }
function table(parent, headers, rows) {  // every cell is text (a run folder's strings are never markup)
  const t = el("table", {}, parent), head = el("tr", {}, t);
  for (const h of headers) el("th", {textContent: h}, head);
  for (const r of rows) { const tr = el("tr", {}, t); for (const v of r) el("td", {textContent: v ?? ""}, tr); }
  return t;
}
function extent(a) { let lo = Infinity, hi = -Infinity; for (const v of a) { if (v < lo) lo = v; if (v > hi) hi = v; } return [lo, hi]; }
function drawPanel(panel) {
  const box = el("div", {className: "panel"}, document.getElementById("panels"));
  el("div", {textContent: panel.title, style: "font-weight:600;font-size:13px"}, box);
  const cv = el("canvas", {width: W, height: H}, box); cv.dataset.title = panel.title;
  const g = cv.getContext("2d");
  const pts = panel.keys.map(k => D.series[k]).filter(Boolean);
  const xs = [].concat(...pts.map(p => p[0].filter(s => s >= 1).map(Math.log10)));
  let ys = [].concat(...pts.map(p => p[1]));
  if (panel.log_y) ys = ys.filter(v => v > 0).map(Math.log10);
  if (!xs.length || !ys.length) return;
  let [x0, x1] = extent(xs), [y0, y1] = extent(ys);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 = y0 + 1; y0 -= 1; }
  const X = x => M.l + (x - x0) / (x1 - x0) * (W - M.l - M.r);
  const Y = y => H - M.b - (y - y0) / (y1 - y0) * (H - M.t - M.b);
  for (const ev of D.events) {
    if (!panel.keys.includes(ev.metric) || ev.onset < 1) continue;
    g.fillStyle = ev.direction === "down" ? "rgba(214,39,40,0.12)" : "rgba(44,160,44,0.12)";
    const a = X(Math.log10(ev.onset)), b = X(Math.log10(Math.max(ev.end, ev.onset)));
    g.fillRect(a, M.t, Math.max(b - a, 2), H - M.t - M.b);
  }
  for (const iv of D.interventions) {  // interventions: grey bands (windows) or lines (reinit)
    const a = Math.max(iv.start ?? iv.step, 1), b = Math.max(iv.end ?? iv.step, 1);
    const xa = X(Math.log10(a)), xb = X(Math.log10(b));
    g.fillStyle = "rgba(90,90,90,0.13)"; g.fillRect(xa, M.t, Math.max(xb - xa, 2), H - M.t - M.b);
    g.fillStyle = "#444"; g.font = "10px sans-serif"; g.fillText(`${iv.kind} ${iv.component}`, xa + 3, M.t + 11);
  }
  g.strokeStyle = "#999"; g.strokeRect(M.l, M.t, W - M.l - M.r, H - M.t - M.b);
  g.fillStyle = "#555"; g.font = "11px sans-serif";
  for (let d = Math.ceil(x0); d <= Math.floor(x1); d++) g.fillText("1e" + d, X(d) - 8, H - 8);
  for (const f of [0, 0.5, 1]) { const v = y0 + f * (y1 - y0); g.fillText(panel.log_y ? "1e" + v.toFixed(1) : v.toPrecision(3), 2, Y(v) + 4); }
  const legend = el("div", {className: "legend"}, box);
  panel.keys.forEach((k, i) => {
    const p = D.series[k]; if (!p) return;
    const c = COLORS[i % COLORS.length]; g.strokeStyle = c; g.lineWidth = 1.4; g.beginPath();
    let started = false;
    p[0].forEach((s, j) => { let v = p[1][j]; if (s < 1 || (panel.log_y && !(v > 0))) return; if (panel.log_y) v = Math.log10(v);
      const px = X(Math.log10(s)), py = Y(v); if (started) g.lineTo(px, py); else { g.moveTo(px, py); started = true; } });
    g.stroke(); el("span", {textContent: "\u25A0 " + k, style: "color:" + c}, legend);
  });
}
function drawEvents() {
  const box = document.getElementById("events");
  if (!D.events.length) { box.textContent = "No transitions detected."; return; }
  table(box, ["metric", "direction", "onset", "midpoint", "end", "magnitude", "detected at"],
    D.events.map(e => [e.metric, e.direction, e.onset, e.midpoint, e.end, (+e.magnitude).toPrecision(3), e.detected_at]));
  if (D.leadlag.length) {
    el("h2", {textContent: "Lead/lag against val/loss (positive: earlier)"}, box);
    table(box, ["val/loss transition (midpoint)", "metric", "direction", "midpoint", "leads by (steps)"],
      D.leadlag.map(r => [`${r.reference_direction} (${r.reference_midpoint})`, r.metric, r.direction, r.midpoint, r.lead]));
  }
}
function heatColor(v, lo, hi) {
  if (v === null || Number.isNaN(v)) return "#eee";
  const f = hi > lo ? (v - lo) / (hi - lo) : 0.5;
  return `rgb(${Math.round(255 * Math.min(1, 2 * f))},${Math.round(255 * (1 - Math.abs(f - 0.5) * 2) * 0.85)},${Math.round(255 * Math.min(1, 2 * (1 - f)))})`;
}
function arrayPanel(name, A, title, width, height) {  // a panel: title, canvas, caption, slider over checkpoints
  const box = el("div", {className: "panel"}, document.getElementById("arrays"));
  el("div", {textContent: title, style: "font-weight:600;font-size:13px"}, box);
  const cv = el("canvas", {width, height}, box); cv.dataset.array = name;
  const label = el("div", {className: "note"}, box);
  const slider = el("input", {type: "range", min: 0, max: A.steps.length - 1, value: A.steps.length - 1, style: "width:300px"}, box);
  slider.dataset.array = name;
  return {cv, label, slider};
}
function drawLines(name, A) {  // one line per row (e.g. an SGLD chain's loss per step), per checkpoint
  const {cv, label, slider} = arrayPanel(name, A, name + " (one line per row; dashed: llc/loss_star)", 420, 240);
  const star = D.series["llc/loss_star"];
  function render() {
    const m = A.data[+slider.value], g = cv.getContext("2d"), step = A.steps[+slider.value];
    const ref = star ? star[1][star[0].indexOf(step)] : undefined;
    const vals = [].concat(...m).filter(v => v !== null);
    let [lo, hi] = extent(ref === undefined ? vals : vals.concat([ref]));
    if (!(hi > lo)) { hi = lo + 1; }
    const n = m[0].length, L = 52, B = 20, X = j => L + j / Math.max(n - 1, 1) * (cv.width - L - 8), Y = v => cv.height - B - (v - lo) / (hi - lo) * (cv.height - B - 8);
    g.clearRect(0, 0, cv.width, cv.height); g.strokeStyle = "#999"; g.strokeRect(L, 8, cv.width - L - 8, cv.height - B - 8);
    m.forEach((row, i) => { g.strokeStyle = COLORS[i % COLORS.length]; g.lineWidth = 1; g.beginPath();
      row.forEach((v, j) => { if (v === null) return; if (j) g.lineTo(X(j), Y(v)); else g.moveTo(X(j), Y(v)); }); g.stroke(); });
    if (ref !== undefined) { g.setLineDash([4, 3]); g.strokeStyle = "#333"; g.beginPath(); g.moveTo(L, Y(ref)); g.lineTo(cv.width - 8, Y(ref)); g.stroke(); g.setLineDash([]); }
    g.fillStyle = "#555"; g.font = "11px sans-serif";
    for (const f of [0, 0.5, 1]) { const v = lo + f * (hi - lo); g.fillText(v.toPrecision(3), 2, Y(v) + 4); }
    g.fillText("0", L, cv.height - 6); g.fillText(String(n - 1), cv.width - 30, cv.height - 6);
    label.textContent = `step ${step} (checkpoint ${+slider.value + 1} of ${A.steps.length}); ${m.length} rows of ${n}`;
  }
  slider.addEventListener("input", render); render();
}
function drawArray(name, A) {
  if (A.lines) return drawLines(name, A);
  const longest = names => Math.max(...names.map(t => t.length));  // margins for row and column names and axis titles
  const ml = (A.rows ? 6 * longest(A.rows) + 10 : 0) + (A.row_title ? 16 : 0);
  const mb = (A.cols ? 6 * longest(A.cols) + 10 : 0) + (A.col_title ? 16 : 0);
  const {cv, label, slider} = arrayPanel(name, A, name, 320 + ml, 240 + mb);
  // the readout wraps within the canvas' width: a wider panel could move to the next line under the pointer
  const readout = el("div", {className: "note", textContent: "\u00a0", style: `max-width:${cv.width}px`}, cv.parentNode);
  const S = A.shade || A.data;  // colours from A.shade when given (the head catalogue: each score's own range)
  const flat = [].concat(...S.map(m => [].concat(...m))).filter(v => v !== null && !Number.isNaN(v));
  const [lo, hi] = extent(flat.length ? flat : [0, 1]);
  // positive values over more than three decades (e.g. a Fourier spectrum): colour by log10
  const logScale = lo > 0 && hi / lo > 1e3, c = v => (logScale && v !== null && v > 0 ? Math.log10(v) : v);
  const rows = A.data[0].length, cols = A.data[0][0].length, cw = (cv.width - ml) / cols, ch = (cv.height - mb) / rows;
  let hover = null;  // the cell under the pointer: its names and value at the slider's checkpoint
  function show() {
    if (!hover) { readout.textContent = "\u00a0"; return; }
    const [i, j] = hover, v = A.data[+slider.value][i][j];
    const where = [A.rows && `${A.row_title || "row"} ${A.rows[i]}`, A.cols && `${A.col_title || "column"} ${A.cols[j]}`];
    readout.textContent = `${where.filter(Boolean).join(", ") || `cell ${i}, ${j}`}: ${v === null ? "none" : (+v).toPrecision(4)}`;
  }
  function render() {
    const m = S[+slider.value], g = cv.getContext("2d");
    g.clearRect(0, 0, cv.width, cv.height);
    m.forEach((row, i) => row.forEach((v, j) => { g.fillStyle = heatColor(c(v), c(lo), c(hi)); g.fillRect(ml + j * cw, i * ch, Math.ceil(cw), Math.ceil(ch)); }));
    g.fillStyle = "#333"; g.font = "10px sans-serif";
    if (A.rows) { g.textAlign = "right"; A.rows.forEach((t, i) => g.fillText(t, ml - 4, i * ch + ch / 2 + 3)); }
    if (A.cols) A.cols.forEach((t, j) => { g.save(); g.translate(ml + j * cw + cw / 2 + 3, cv.height - mb + 4); g.rotate(Math.PI / 2); g.textAlign = "left"; g.fillText(t, 0, 0); g.restore(); });
    g.font = "11px sans-serif"; g.textAlign = "center";  // axis titles, in the margins' outer 16 px
    if (A.row_title) { g.save(); g.translate(12, (cv.height - mb) / 2); g.rotate(-Math.PI / 2); g.fillText(A.row_title, 0, 0); g.restore(); }
    if (A.col_title) g.fillText(A.col_title, ml + (cv.width - ml) / 2, cv.height - 4);
    g.textAlign = "left";
    label.textContent = `step ${A.steps[+slider.value]} (checkpoint ${+slider.value + 1} of ${A.steps.length}); ${A.shade ? "colour: each column's own range" : `colour range ${lo.toPrecision(3)} to ${hi.toPrecision(3)}${logScale ? " (log scale)" : ""}`}`;
    show();
  }
  cv.addEventListener("mousemove", e => {
    const r = cv.getBoundingClientRect(), x = (e.clientX - r.left) * cv.width / r.width - ml, y = (e.clientY - r.top) * cv.height / r.height;
    hover = x >= 0 && y >= 0 && y < cv.height - mb ? [Math.min(rows - 1, Math.floor(y / ch)), Math.min(cols - 1, Math.floor(x / cw))] : null;
    show();
  });
  cv.addEventListener("mouseleave", () => { hover = null; show(); });
  slider.addEventListener("input", render); render();
}
function drawDiffs() {  // phasewatch diff's tables: each column shaded by its largest magnitude
  const box = document.getElementById("diffs");
  if (!D.diffs.length) return;
  el("h2", {textContent: "Model diffs (phasewatch diff)"}, box);
  for (const d of D.diffs) {
    el("div", {textContent: d.name.replace("_vs_", " \u2192 "), style: "font-weight:600;font-size:13px;margin-top:8px"}, box);
    const t = el("table", {}, box), head = el("tr", {}, t);
    for (const c of ["component", ...d.columns]) el("th", {textContent: c}, head);
    const top = Object.fromEntries(d.columns.map(c => [c, Math.max(1e-12, ...d.rows.map(r => Math.abs(r[c] ?? 0)))]));
    for (const r of d.rows) {
      const tr = el("tr", {}, t); el("td", {textContent: r.component}, tr);
      for (const c of d.columns) {
        const v = r[c], td = el("td", {textContent: v === null ? "" : (+v).toPrecision(3)}, tr);
        if (v !== null) td.style.background = `rgba(${v < 0 ? "31,119,180" : "214,39,40"},${(0.45 * Math.abs(v) / top[c]).toFixed(3)})`;
      }
    }
    if (d.inputs.length) table(box, ["input whose loss changed most", "loss A", "loss B"],
      d.inputs.map(e => [e.tokens, (+e.loss_a).toPrecision(3), (+e.loss_b).toPrecision(3)]));
  }
}
D.panels.forEach(drawPanel); drawEvents(); drawDiffs();
const names = Object.keys(D.arrays);
if (!names.length) document.getElementById("arrays").textContent = "No array measurements in this run.";
names.forEach(n => drawArray(n, D.arrays[n]));
// "#checkpoint=K" opens every slider at checkpoint K (links, and the browser test)
const wanted = /checkpoint=(\d+)/.exec(location.hash);
if (wanted) document.querySelectorAll("input[type=range]").forEach(s => {
  s.value = Math.min(+wanted[1], +s.max); s.dispatchEvent(new Event("input")); });
"""

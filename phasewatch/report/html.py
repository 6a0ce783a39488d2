"""`phasewatch report RUN_DIR`: one self-contained HTML file (no network needed).

It shows a header (the run's state: step N of M, running or finished, last update; the config's
key fields; links to the folder's files), the stages (a timeline and a table, one row each), every
series on a log-step axis in panels by family (minibatch `train/` series smoothed, raw points
faint) with each stage's span shaded and named, a stage's per-series transitions as bands when the
reader ticks it (every transition's without stages), the transitions table by midpoint
(small changes folded), lead/lag against val/loss's principal transition (a row per series), and array
measurements as heatmaps with axis names, a colour bar and a slider over checkpoints. Data are
embedded as JSON and drawn by the page's one script; every string from the run folder is shown
as text, never markup, under a Content-Security-Policy that runs only that script
(report/page.py). `report.html#checkpoint=K` opens every slider at checkpoint K; `live=True`
adds a meta refresh (the copy a running training rewrites). docs/report.md: what each part shows.
"""

from __future__ import annotations

import base64
import datetime
import html
import os
import re
from pathlib import Path
from urllib.parse import quote

import numpy as np

from phasewatch.models import head_label
from phasewatch.probes.keys import declared_scale, is_detail
from phasewatch.phases.detector import detect_all, lead_lag, scale_change
from phasewatch.report.curves import panel_layout
from phasewatch.report.heads import catalogue_array, head_catalogue, write_head_catalogue
from phasewatch.report.page import load_array, policy, script_json
from phasewatch.phases.stages import read_stages
from phasewatch.rundir import TRAJECTORY_CHECKPOINTS, RunFolder, flatten_config, load_series, read_csv

REFRESH_SECONDS = 30
#: arrays drawn as one line per row (over their columns) instead of as a heatmap
LINES = {"trace"}  # the LLC's SGLD chains: loss per sampling step
#: a transition that changed its series by less than this fraction of the series' range is
#: listed folded ("small"; `_size`)
SMALL = 0.1
#: series measured on minibatches: drawn smoothed, with the raw points faint
MINIBATCH = ("train/",)
#: axis names of probe arrays that carry no `<key>_labels`: (row title, column title, first column index)
ARRAY_AXES = {"grokking/spectrum": (None, "Fourier frequency k (norm of W_L)", 1)}
#: config fields the header shows (dotted, `init_args` folded), when the config has them
HEADER_FIELDS = ("data.task.class_path", "data.task.p", "data.task.program", "data.task.frac_train", "model.arch.n_layers",
                 "model.arch.d_model", "model.arch.n_heads", "model.lr", "model.weight_decay", "trainer.max_steps",
                 "seed_everything")
#: the run folder's files the header links to (those it has)
HEADER_FILES = ("config", "metrics", "events", "stages", "head_catalogue", "checkpoints")


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
            out[f"{probe}/{key}"] = {"steps": steps, "data": mats, **_named_axes(f"{probe}/{key}", axes, mats[0]),
                                     "lines": key in LINES}
    return out


def _named_axes(name: str, axes: dict, matrix: list) -> dict:
    """`axes` completed so that every heatmap names its axes: a known array's names
    (`ARRAY_AXES`), else indices titled "row" and "column" (a single row stays unnamed)."""
    rows, cols = len(matrix), len(matrix[0])
    row_title, col_title, first = ARRAY_AXES.get(name, ("row", "column", 0))
    out = dict(axes)
    if "cols" not in out:
        out["cols"], out["col_title"] = [str(first + j) for j in range(cols)], col_title
    if "rows" not in out and rows > 1:
        out["rows"], out["row_title"] = [str(i) for i in range(rows)], row_title or "row"
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
                 catalogue: tuple[list[str], list[dict]] | None = None, at: str | Path | None = None) -> str:
    """The report's HTML; `catalogue`: the run's per-head catalogue when already read
    (`head_catalogue`; read here otherwise); `at`: the folder the page will be written to (its
    links to the run's files are relative to it; default: the run folder)."""
    folder = RunFolder(run_dir)
    series = load_series(folder.root)
    watched = {k: v for k, v in series.items() if not is_detail(k)}
    events = folder.transitions() or detect_all(watched, declared=declared_scale)  # bands on the watcher's scale
    events = sorted((dict(e, size=_size(e, series)) for e in events), key=lambda e: (e["midpoint"], e["metric"]))
    panels = [{"title": t, "keys": k, "log_y": y == "log"} for t, k, y in panel_layout(series) if k]
    stages = _stages(folder)
    named = {k for k in (*series, *(e["metric"] for e in events), *(m["metric"] for s in stages for m in s["members"]),
                         *(s["lead"] for s in stages)) if isinstance(k, str)}
    reference = "val/loss" if "val/loss" in series else None
    config = _config(folder)
    state = run_state(folder, series, config, live)
    payload = {
        "name": folder.root.name,
        "series": {k: [list(map(float, s)), list(map(float, v))] for k, (s, v) in series.items()},
        "labels": {k: display_name(k) for k in named if display_name(k) != k},
        "smooth": [k for k in series if k.startswith(MINIBATCH)],
        "panels": panels,
        "events": events,
        "small": SMALL,
        "state": state,
        "leadlag": lead_lag(events, reference, series[reference]) if reference else [],
        "stages": stages,
        "arrays": _arrays(folder) | _catalogue(catalogue or head_catalogue(folder)),
        "interventions": folder.read_interventions(),
        "diffs": _diffs(folder),
    }
    data = script_json(payload)
    trajectory = folder.figure("trajectory")
    figure = (f'<h2>Checkpoint trajectory</h2><img alt="PCA paths of the checkpoints (phasewatch trajectory)" '
              f'style="max-width:100%" src="data:image/png;base64,{base64.b64encode(trajectory.read_bytes()).decode()}">'
              if trajectory.exists() else "")
    if (not figure and not live and config.get("model.vectorised")
            and len(folder.checkpoint_steps()) >= TRAJECTORY_CHECKPOINTS):
        # a population's member (its config's mark): fit leaves its trajectory to be drawn on demand
        figure = ('<h2>Checkpoint trajectory</h2><p id="trajectory-not-drawn">Not drawn after the fit (a population\'s '
                  f'members get theirs on demand): <code>phasewatch report {html.escape(str(folder.root))}</code> '
                  'draws it into this page.</p>')
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if live else ""
    fields = {"POLICY": policy(SCRIPT), "REFRESH": refresh, "TITLE": html.escape(folder.root.name),
              "HEADER": header(folder, state, config, Path(at) if at is not None else folder.root), "TRAJECTORY": figure, "DATA": data, "SCRIPT": SCRIPT}
    # in one pass: a run named "%DATA%" stays its name
    return re.sub(r"%(POLICY|REFRESH|TITLE|HEADER|TRAJECTORY|DATA|SCRIPT)%", lambda m: fields[m.group(1)], TEMPLATE)


def display_name(key: str) -> str:
    """How the report names a series: a compiled tracr head's attention match says "compiled"
    (`tracr/attn_match/L3H0` -> `tracr/attn_match/compiled-L3H0`), so that it cannot be read
    as the learned model's head L3H0; every other key as it is."""
    return re.sub(r"^(tracr/attn_match/)(L\d+H\d+)(/|$)", r"\1compiled-\2\3", key)


def _size(event: dict, series: dict) -> float | None:
    """The change as a fraction of its series' range: its change on its own scale
    (`scale_change`: `magnitude` in the series' units, or for an event watched on a log scale
    the change in log10 between the values at its onset and end) over the range of the values
    (of log10 of the values). None when the series or the magnitude is missing."""
    data = series.get(event.get("metric"))
    if data is None or not isinstance(event.get("magnitude"), (int, float)):
        return None
    values = np.asarray(data[1], dtype=float)
    values = values[np.isfinite(values) & ((values > 0) if event.get("scale") == "log" else True)]
    span = float(np.ptp(np.log10(values) if event.get("scale") == "log" else values)) if len(values) else 0.0
    return round(scale_change(event, *data) / span, 4) if span > 0 else None


def _config(folder: RunFolder) -> dict:
    """The run's config flattened to dotted keys ({} without a readable one)."""
    try:
        return flatten_config(folder.read_config(), fold_init_args=True)
    except Exception:  # noqa: BLE001 - no config, or not one phasewatch wrote: a header without it
        return {}


def run_state(folder: RunFolder, series: dict, config: dict, live: bool) -> dict:
    """Where the run is: its last logged step, `trainer.max_steps`, whether it is running (the
    live copy), finished (reached its last step) or stopped, and when its metrics last changed."""
    step = int(max((max(s) for s, _ in series.values() if len(s)), default=0))
    max_steps = config.get("trainer.max_steps")
    max_steps = max_steps if isinstance(max_steps, int) and max_steps > 0 else None
    status = "running" if live else "finished" if max_steps is None or step >= max_steps - 1 else "stopped"
    updated = datetime.datetime.fromtimestamp(folder.metrics.stat().st_mtime, datetime.timezone.utc)
    return {"step": step, "max_steps": max_steps, "status": status, "updated": updated.strftime("%Y-%m-%d %H:%M UTC")}


def header(folder: RunFolder, state: dict, config: dict, at: Path) -> str:
    """The header's HTML (every string escaped): state line, key config fields, and links to
    the run's files relative to `at`, the page's folder."""
    of = f" of {state['max_steps']}" if state["max_steps"] else ""
    line = f"step {state['step']}{of}, {state['status']}; last update {state['updated']}"
    fields = [("task", str(config[k]).rsplit(".", 1)[-1]) if k == "data.task.class_path" else
              (k.rsplit(".", 1)[-1], config[k]) for k in HEADER_FIELDS if k in config]
    cells = "".join(f"<span><b>{html.escape(str(k))}</b> {html.escape(str(v))}</span>" for k, v in fields)
    files = [getattr(folder, name) for name in HEADER_FILES if getattr(folder, name).exists()]
    links = "".join(f'<a href="{html.escape(quote(Path(os.path.relpath(f, at)).as_posix()))}">{html.escape(f.name)}</a>'
                    for f in files)
    return (f'<div id="state" class="state">{html.escape(line)}</div><div id="config" class="fields">{cells}</div>'
            f'<div id="files" class="fields">files: {links}</div>')


def _stages(folder: RunFolder) -> list[dict]:
    """The run's stages (phases/stages.py), for the timeline and the panels: id, name, span,
    lead, type, and its members (the per-series transitions: series key, direction, onset, end,
    size), whose bands the page draws when the reader asks for that stage's."""
    try:
        stages = read_stages(folder)
    except Exception:  # noqa: BLE001 - an unreadable stages file: no timeline, the rest of the report
        return []
    return [{"id": s.id, "name": s.name, "onset": s.onset, "midpoint": s.midpoint, "end": s.end, "lead": s.lead,
             "type": s.type, "open": s.under_way_at_end, "members": [{"metric": m.get("series", m.get("metric", "")),
                                          **{k: m.get(k) for k in ("direction", "onset", "end", "size")}}
                                         for m in s.members]}
            for s in stages]


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
    path = Path(out) if out else folder.report
    return folder.write_atomic(path, build_report(folder.root, live, catalogue, at=path.parent))


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
.state{font-size:14px;margin:2px 0} .fields{font-size:12px;color:#444;margin:2px 0} .fields span,.fields a{margin-right:12px}
.bands{font-size:11px;color:#444;max-width:560px} .bands span{display:inline-block;margin-right:10px}
summary{cursor:pointer;font-size:13px;color:#444;margin:6px 0} #stage-table td:not(:last-child){white-space:nowrap}
</style></head><body>
<h1>phasewatch report: %TITLE%</h1>
%HEADER%
<div id="stages"></div>
<div id="panels-note" class="note">Every series on a log-step axis; shaded bands are detected phase transitions (legend under each panel).</div>
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
function label(k) { return D.labels[k] ?? k; }  // a series as the report names it (compiled tracr heads say so)
// tick labels: plain numbers (0.01, 1, 1000) or powers of ten (10\u207b\u2075), never 1e-0.6
const SUP = {"-": "\u207b", "0": "\u2070", "1": "\u00b9", "2": "\u00b2", "3": "\u00b3", "4": "\u2074", "5": "\u2075", "6": "\u2076", "7": "\u2077", "8": "\u2078", "9": "\u2079"};
function power(m, d) {  // m x 10^d (m: 1, 2 or 5) as people write it
  if (d >= -3 && d <= 4) return (m * 10 ** d).toFixed(Math.max(0, -d));
  return (m === 1 ? "" : m + "\u00d7") + "10" + String(d).split("").map(c => SUP[c]).join("");
}
function logTicks(lo, hi) {  // [log10 position, label] within [lo, hi] (log10 units): decades, else 1-2-5 steps, else the ends
  const eps = 1e-9; let out = [];
  for (let d = Math.ceil(lo - eps); d <= Math.floor(hi + eps); d++) out.push([d, power(1, d)]);
  if (out.length > 6) { const k = Math.ceil(out.length / 6); out = out.filter(t => t[0] % k === 0); }
  if (out.length >= 2) return out;
  out = [];
  for (let d = Math.floor(lo); d <= Math.ceil(hi); d++) for (const m of [1, 2, 5]) {
    const x = d + Math.log10(m); if (x >= lo - eps && x <= hi + eps) out.push([x, power(m, d), m]);
  }
  if (out.length > 6) out = out.filter(t => t[2] !== 2);
  if (out.length >= 2) return out;  // a narrow range within a decade: round values, at their log positions
  return linearTicks(10 ** lo, 10 ** hi).filter(t => t[0] > 0).map(([v, text]) => [Math.log10(v), text]);
}
function linearTicks(lo, hi) {  // [value, label] at the widest round step (1, 2 or 5 x 10^k) that leaves 3 ticks in [lo, hi]
  const count = st => Math.floor(hi / st + 1e-9) - Math.ceil(lo / st - 1e-9) + 1;
  let step = null;
  for (let st = 10 ** Math.floor(Math.log10(hi - lo)) / 100, i = 0; i < 12; st *= [2, 2.5, 2][i % 3], i++) {
    if (count(st) >= 3) step = st; else if (step !== null) break;
  }
  if (step === null) return [[lo, plainValue(lo)], [hi, plainValue(hi)]];
  const digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9)), out = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) out.push([i * step, (i * step).toFixed(digits).replace(/^-(0\.?0*)$/, "$1")]);
  return out;
}
function plainValue(v) {  // one value, 3 significant digits, without exponent notation where it reads plainly
  if (v === 0 || !Number.isFinite(v)) return String(v);
  const d = Math.floor(Math.log10(Math.abs(v)));
  if (d < -3 || d > 5) return (+(v / 10 ** d).toPrecision(3)) + "\u00d7" + power(1, d);
  return String(+v.toPrecision(3));
}
function smoothed(xs, ys, half) {  // the mean of the points within +-half (log10 steps) of each point
  const out = []; let a = 0, b = 0, sum = 0;
  for (let i = 0; i < xs.length; i++) {
    while (b < xs.length && xs[b] <= xs[i] + half) sum += ys[b++];
    while (xs[a] < xs[i] - half) sum -= ys[a++];
    out.push(sum / (b - a));
  }
  return out;
}
// What the panels shade besides the stages' spans: the ids of the stages whose members' bands
// the reader asked for, or "all" (every transition's band; the default of a run without stages)
const SHOWN = new Set(D.stages.length ? [] : ["all"]), PANELS = [];
//: a stage's colour (never red or green: those are a band's direction)
const STAGE_COLORS = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"], LANE = 12;
function stageColor(i, alpha) {
  const c = STAGE_COLORS[i % STAGE_COLORS.length], n = j => parseInt(c.slice(j, j + 2), 16);
  return `rgba(${n(1)},${n(3)},${n(5)},${alpha})`;
}
function stageTag(s) { return `${s.id} ${s.name ?? "unnamed"}`; }
function bandsOf(panel) {  // the per-series bands the panel shows now: [{ev, stage}] (stage null: every transition's)
  const here = ev => panel.keys.includes(ev.metric) && ev.onset >= 1 && ev.end != null;
  if (SHOWN.has("all")) return D.events.filter(ev => here(ev) && !small(ev)).map(ev => ({ev, stage: null}));  // small: table only
  return D.stages.filter(s => SHOWN.has(s.id)).flatMap(s => s.members.filter(here).map(ev => ({ev, stage: s})));
}
function stageSpans(g, X, lo, hi) {  // each stage within [lo, hi] (canvas x): its span, and the first lane free for its name
  const ends = [], out = [];
  g.font = "10px sans-serif";
  D.stages.map((s, i) => [s, i]).sort((p, q) => p[0].onset - q[0].onset).forEach(([s, i]) => {
    const a = X(Math.log10(Math.max(s.onset, 1))), b = X(Math.log10(Math.max(s.end, s.onset, 1)));
    if (b < lo || a > hi) return;
    const sp = {i, text: stageTag(s), a: Math.max(a, lo)}, width = g.measureText(sp.text).width;
    sp.b = Math.max(Math.min(b, hi), sp.a + 2); sp.x = Math.max(Math.min(sp.a + 2, W - width - 2), 0);
    sp.lane = ends.findIndex(e => e <= sp.a); if (sp.lane < 0) sp.lane = ends.push(0) - 1;
    ends[sp.lane] = Math.max(sp.b, sp.x + width + 6); out.push(sp);
  });
  return out;
}
function drawPanel(panel) {
  const box = el("div", {className: "panel"}, document.getElementById("panels"));
  PANELS.push([panel, box]); renderPanel(panel, box);
}
function renderPanel(panel, box) {  // (re)draws the panel: stages' spans, the bands asked for, series, legends
  box.replaceChildren();
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
  const spans = stageSpans(g, X, M.l, W - M.r), top = Math.max(M.t, 4 + LANE * Math.max(0, ...spans.map(sp => sp.lane + 1)));
  const Y = y => H - M.b - (y - y0) / (y1 - y0) * (H - top - M.b), inside = x => Math.min(Math.max(x, M.l), W - M.r);
  for (const sp of spans) {  // every stage's span over the plot, its name in a lane above it
    g.fillStyle = stageColor(sp.i, 0.08); g.fillRect(sp.a, top, sp.b - sp.a, H - top - M.b);
    g.fillStyle = stageColor(sp.i, 0.45); g.fillRect(sp.a, 2 + sp.lane * LANE, sp.b - sp.a, LANE - 2);
    g.fillStyle = "#222"; g.textAlign = "left"; g.fillText(sp.text, sp.x, 2 + sp.lane * LANE + 9);
  }
  for (const {ev} of bandsOf(panel)) {  // green: up, red: down
    g.fillStyle = ev.direction === "down" ? "rgba(214,39,40,0.15)" : "rgba(44,160,44,0.15)";
    const a = inside(X(Math.log10(ev.onset))), b = inside(X(Math.log10(Math.max(ev.end, ev.onset))));
    g.fillRect(a, top, Math.max(b - a, 2), H - top - M.b);
  }
  for (const iv of D.interventions) {  // interventions: grey bands (windows) or lines (reinit)
    const a = Math.max(iv.start ?? iv.step, 1), b = Math.max(iv.end ?? iv.step, 1);
    const xa = X(Math.log10(a)), xb = X(Math.log10(b));
    g.fillStyle = "rgba(90,90,90,0.13)"; g.fillRect(xa, top, Math.max(xb - xa, 2), H - top - M.b);
    g.fillStyle = "#444"; g.font = "10px sans-serif"; g.fillText(`${iv.kind} ${iv.component}`, xa + 3, top + 11);
  }
  g.strokeStyle = "#999"; g.strokeRect(M.l, top, W - M.l - M.r, H - top - M.b);
  g.fillStyle = "#555"; g.font = "11px sans-serif";  // x: steps at decades; y: round values, or decades on a log axis
  for (const [x, text] of logTicks(x0, x1)) { g.textAlign = "center"; g.fillText(text, X(x), H - 8); }
  g.textAlign = "right";
  for (const [y, text] of (panel.log_y ? logTicks(y0, y1) : linearTicks(y0, y1))) g.fillText(text, M.l - 4, Y(y) + 4);
  g.textAlign = "left";
  const legend = el("div", {className: "legend"}, box);
  panel.keys.forEach((k, i) => {
    const p = D.series[k]; if (!p) return;
    const xs = [], ys = [];
    p[0].forEach((s, j) => { const v = p[1][j]; if (s < 1 || (panel.log_y && !(v > 0))) return; xs.push(Math.log10(s)); ys.push(panel.log_y ? Math.log10(v) : v); });
    const smooth = D.smooth.includes(k), c = COLORS[i % COLORS.length];
    const line = (vs, alpha) => { g.globalAlpha = alpha; g.strokeStyle = c; g.lineWidth = 1.4; g.beginPath();
      vs.forEach((v, j) => j ? g.lineTo(X(xs[j]), Y(v)) : g.moveTo(X(xs[j]), Y(v))); g.stroke(); g.globalAlpha = 1; };
    if (smooth) { line(ys, 0.25); line(smoothed(xs, ys, 0.03), 1); } else line(ys, 1);
    el("span", {textContent: "\u25A0 " + label(k) + (smooth ? " (smoothed; raw points faint)" : ""), style: "color:" + c}, legend);
  });
  bandLegend(box, panel);
}
function small(ev) { return ev.size != null && ev.size < D.small; }  // under D.small of its series' range
function bandLegend(box, panel) {  // which series each shaded band is, and its direction (none: no legend)
  const bands = bandsOf(panel), every = SHOWN.has("all");
  const mine = every ? D.events.filter(ev => panel.keys.includes(ev.metric) && ev.onset >= 1) : bands;
  if (!mine.length) return;
  const div = el("div", {className: "bands"}, box); div.dataset.bands = panel.title;
  if (every) el("span", {textContent: bands.length ? "shaded:" : "no band:"}, div);
  let stage = null;
  for (const {ev, stage: s} of bands) {
    if (s && s !== stage) { stage = s; el("span", {textContent: `stage ${stageTag(s)}:`, style: "font-weight:600"}, div); }
    const up = ev.direction === "up", span = el("span", {}, div);
    el("span", {textContent: "\u25A0", style: `color:${up ? "rgba(44,160,44,0.5)" : "rgba(214,39,40,0.5)"};margin:0 3px 0 0`}, span);
    el("span", {textContent: `${label(ev.metric)} ${up ? "\u2191" : ev.direction === "down" ? "\u2193" : ""}${ev.direction}, steps ${ev.onset}\u2013${ev.end}` +
      (s && small(ev) ? ` (small: under ${100 * D.small}% of its range)` : "")}, span);  // a stage's member, however small
  }
  const unshaded = mine.length - bands.length;
  if (unshaded) el("span", {textContent: `(${unshaded} small change${unshaded > 1 ? "s" : ""}, under ${100 * D.small}% of the series' range, not shaded: see the table)`}, div);
}
function drawEvents() {  // by midpoint; changes under D.small of their series' range folded
  const box = document.getElementById("events"), st = D.state;
  if (!D.events.length) {
    const where = st.status === "running" ? `yet (step ${st.step}${st.max_steps ? " of " + st.max_steps : ""}, running)`
      : `: the run ${st.status === "finished" ? "ended" : "stopped"} at step ${st.step}${st.max_steps ? " of " + st.max_steps : ""}; ` +
        "a change that comes later needs a longer run (--trainer.max_steps)";
    box.textContent = "No transitions detected " + where + ".";
    return;
  }
  const headers = ["metric", "direction", "onset", "midpoint", "end", "magnitude", "of its range", "detected at"];
  const row = e => [label(e.metric), e.direction, e.onset, e.midpoint, e.end, (+e.magnitude).toPrecision(3),
                    e.size == null ? "" : Math.round(100 * e.size) + "%", e.detected_at];
  const big = D.events.filter(e => !small(e)), folded = D.events.filter(small);
  if (big.length) table(box, headers, big.map(row)).id = "transitions";
  else el("div", {className: "note", textContent: `No transition changed its series by ${100 * D.small}% of its range or more.`}, box);
  if (folded.length) {
    const details = el("details", {id: "small-transitions"}, box);
    el("summary", {textContent: `${folded.length} small transition${folded.length > 1 ? "s" : ""} (under ${100 * D.small}% of their series' range): show`}, details);
    table(details, headers, folded.map(row));
  }
  if (D.leadlag.length) {
    el("h2", {textContent: "Lead/lag against val/loss's largest change (positive: earlier)"}, box);
    table(box, ["val/loss transition (midpoint)", "metric", "direction", "midpoint", "leads by (steps)"],
      D.leadlag.map(r => [`${r.reference_direction} (${r.reference_midpoint})`, label(r.metric), r.direction, r.midpoint, r.lead])).id = "leadlag";
  }
}
function drawStages() {  // the stage timeline (one row per stage on the run's log-step axis) and its table
  const box = document.getElementById("stages"), note = document.getElementById("panels-note");
  if (!D.stages.length) return;
  note.textContent = "Every series on a log-step axis; shaded: each stage's span (its name above the plot). Tick a stage " +
    "above (or click its row in the timeline) to see the transitions of the series that moved in it as bands (green: up, " +
    "red: down; legend under each panel); untick it to hide them.";
  el("h2", {textContent: "Stages (several series changing together)"}, box);
  const cv = el("canvas", {width: 900, height: 28 + 22 * D.stages.length}, box); cv.id = "stage-timeline";
  cv.style.cursor = "pointer";
  cv.addEventListener("click", e => {  // a click on a stage's row shows its series' bands, or hides them
    const r = cv.getBoundingClientRect(), i = Math.floor(((e.clientY - r.top) * cv.height / r.height - 6) / 22);
    if (i >= 0 && i < D.stages.length) show(D.stages[i].id, !SHOWN.has(D.stages[i].id));
  });
  const t = el("table", {id: "stage-table"}, box), head = el("tr", {}, t);
  for (const h of ["bands", "stage", "name", "steps", "midpoint", "led by", "type", "what moved"]) el("th", {textContent: h}, head);
  const toggle = (parent, key, title) => {
    const c = el("input", {type: "checkbox", title}, parent); c.dataset.stage = key;
    c.addEventListener("change", () => show(key, c.checked));
  };
  for (const s of D.stages) {
    const tr = el("tr", {}, t);
    toggle(el("td", {}, tr), s.id, "show the bands of the series that moved in this stage on the panels");
    const lead = m => m.metric !== s.lead;  // what moved: the lead first, each series and direction once
    const moved = [...new Set([...s.members].sort((a, b) => lead(a) - lead(b) || (a.onset ?? 0) - (b.onset ?? 0))
      .map(m => `${label(m.metric)} ${m.direction ?? ""}`.trim()))];
    for (const v of [s.id, s.name ?? "unnamed", `${s.onset}\u2013${s.end}${s.open ? " (under way at the end)" : ""}`, s.midpoint, label(s.lead), s.type ?? "", moved.join(", ")])
      el("td", {textContent: v ?? ""}, tr);
  }
  const every = el("label", {className: "note"}, box);
  toggle(every, "all", "shade every series' transitions, in a stage or not");
  el("span", {textContent: ` every series' transitions, in a stage or not (${D.events.filter(ev => !small(ev)).length} bands)`}, every);
}
function renderTimeline() {
  const cv = document.getElementById("stage-timeline"); if (!cv) return;
  const L = 330, R = 20, row = 22, top = 6, Wd = cv.width, Hd = cv.height, g = cv.getContext("2d");
  const last = Math.max(D.state.max_steps || 0, D.state.step, ...D.stages.map(s => s.end), 10);
  const X = s => L + Math.log10(Math.max(s, 1)) / Math.log10(last) * (Wd - L - R);
  g.clearRect(0, 0, Wd, Hd); g.font = "12px sans-serif";
  D.stages.forEach((s, i) => {
    const y = top + i * row;
    g.fillStyle = SHOWN.has(s.id) ? "#fdf3c4" : i % 2 ? "#fff" : "#f3f3f3"; g.fillRect(0, y, Wd, row);
    g.fillStyle = STAGE_COLORS[i % STAGE_COLORS.length]; g.fillRect(X(s.onset), y + 5, Math.max(X(s.end) - X(s.onset), 2), row - 10);
    g.fillStyle = "#000"; g.fillRect(X(s.midpoint) - 1, y + 2, 2, row - 4);
    g.fillStyle = "#222"; g.textAlign = "left";
    g.fillText(`stage ${s.id} ${s.name ?? "(unnamed)"}: steps ${s.onset}\u2013${s.end}${s.open ? "+" : ""}, led by ${label(s.lead)}`, 4, y + 15);
  });
  g.fillStyle = "#555"; g.font = "11px sans-serif"; g.textAlign = "center";
  for (const [x, text] of logTicks(0, Math.log10(last))) g.fillText(text, L + x / Math.log10(last) * (Wd - L - R), Hd - 6);
  g.textAlign = "left";
}
function show(key, on) {  // shade a stage's members' bands ("all": every transition's) on the panels, or stop
  if (on && key === "all") SHOWN.clear(); else if (on) SHOWN.delete("all");
  if (on) SHOWN.add(key); else SHOWN.delete(key);
  PANELS.forEach(([panel, box]) => renderPanel(panel, box)); showControls();
  const rest = location.hash.slice(1).split("&").filter(p => p && !p.startsWith("stage="));  // a link (and a reload) keeps it
  const hash = [...rest, ...(SHOWN.size ? ["stage=" + [...SHOWN].join(",")] : [])].join("&");
  try { history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search); } catch (e) { /* a page that may not: no link */ }
}
function showControls() {  // the toggles and the timeline as SHOWN says
  document.querySelectorAll("input[data-stage]").forEach(c => { c.checked = SHOWN.has(c.dataset.stage === "all" ? "all" : +c.dataset.stage); });
  renderTimeline();
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
  colourBar(cv, name, A.shade ? null : [c(lo), c(hi)], logScale, cv.height - mb);
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
function colourBar(cv, name, range, logScale, height) {  // beside a heatmap: its colours and the values they stand for
  const bar = el("canvas", {width: 92, height: cv.height}); cv.after(bar); bar.dataset.colorbar = name;
  const g = bar.getContext("2d"), top = 6, bottom = height - 6, x = 8, w = 14;
  const [lo, hi] = range || [0, 1], Y = v => bottom - (v - lo) / ((hi - lo) || 1) * (bottom - top);
  for (let y = top; y <= bottom; y++) { g.fillStyle = heatColor(lo + (bottom - y) / (bottom - top) * (hi - lo), lo, hi); g.fillRect(x, y, w, 1); }
  g.strokeStyle = "#999"; g.strokeRect(x, top, w, bottom - top);
  g.fillStyle = "#333"; g.font = "10px sans-serif";
  const ticks = !range ? [[0, "column min"], [1, "column max"]] : hi === lo ? [[lo, plainValue(lo)]]
    : logScale ? logTicks(lo, hi) : linearTicks(lo, hi);
  for (const [v, text] of ticks) { g.fillRect(x + w, Y(v), 3, 1); g.fillText(text, x + w + 5, Y(v) + 3); }
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
// "#stage=1,3" opens with those stages' bands shown ("#stage=all": every transition's)
const asked = /stage=([\w,]+)/.exec(location.hash);
if (asked && D.stages.length) { SHOWN.clear(); asked[1].split(",").forEach(k => SHOWN.add(k === "all" ? "all" : +k)); }
drawStages(); D.panels.forEach(drawPanel); drawEvents(); drawDiffs();
showControls();
const names = Object.keys(D.arrays);
if (!names.length) document.getElementById("arrays").textContent = "No array measurements in this run.";
names.forEach(n => drawArray(n, D.arrays[n]));
// "#checkpoint=K" opens every slider at checkpoint K (links, and the browser test)
const wanted = /checkpoint=(\d+)/.exec(location.hash);
if (wanted) document.querySelectorAll("input[type=range]").forEach(s => {
  s.value = Math.min(+wanted[1], +s.max); s.dispatchEvent(new Event("input")); });
"""

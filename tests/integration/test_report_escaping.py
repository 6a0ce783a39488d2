"""Every string a page shows from a run folder is text, never markup (issue 41, point 2), on
every page the project writes: the run report (report/html.py, also in its live form) and the
population page (report/population.py). `phasewatch compare` (sweeps, populations) writes a
CSV and a PNG, no page.

A real run (a short induction fit) is given hostile strings where a run folder holds strings: a
metric key, an event's metric and direction (the events and lead/lag tables), a stage's name,
lead and type (the stage table), a probe's array
folder and its `<key>_labels`, a head score column, an intervention, a diff's component and
inputs, a config value, and the folder's own name. Each page is opened in headless Chromium
(the `chromium` fixture) and its DOM, as the browser holds it after load, is read back: no
payload ran (each would mark the document), and each string is there as text, where it belongs.

The pages also carry a Content-Security-Policy that runs only their own script: markup slipped
into a copy of a page does not run. And a run folder whose arrays hold pickled objects gives one
line naming the file, never a traceback, and the pickle is never loaded. The figures (PNG) show
the same strings literally: a `$...$` in a key, a folder's name or a config value is not mathtext.
"""

import html
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import numpy as np
import pytest

from phasewatch.phases.stages import Stage, write_stages
from phasewatch.report.html import write_report
from phasewatch.report.population import write_population_report
from phasewatch.rundir import RunFolder, append_jsonl, write_csv
from phasewatch.cli.main import main

from .test_report import open_page

MARK = "data-pwned"


def payload(where: str) -> str:
    """Markup that, if a page ever parsed it, would mark the document with `where` (no slash:
    it can be a folder's name)."""
    return f"<img src=x onerror=\"document.documentElement.setAttribute('{MARK}','{where}')\">"


SCRIPT = f"<script>document.documentElement.setAttribute('{MARK}','script tag')</script>"
#: closes the JSON's <script> block, or opens a comment in it that would swallow the page's own script
BREAKOUT = "</script><!--<script>"

RUN_NAME = payload("run folder name")
KEY = "plugin/" + payload("metric key")  # a plug-in probe's key
KEY_SCRIPT = "plugin/" + SCRIPT
KEY_BREAKOUT = "plugin/" + BREAKOUT
HEAD_KEY = payload("head score column") + "/L0H1"  # a head score: a column of the head catalogue
EVENT_METRIC = payload("event metric")
DIRECTION = payload("event direction")
REFERENCE_DIRECTION = payload("lead/lag reference direction")
PROBE, ARRAY_KEY = payload("probe folder"), payload("array key")
LABELS = [payload("row label"), payload("column label 0"), payload("column label 1")]
INTERVENTION = payload("intervention")
COMPONENT, TOKENS, DIFF_NAME = payload("diff component"), payload("diff input"), payload("diff name")
SEED = payload("config value")
STAGE_NAME, STAGE_LEAD, STAGE_TYPE = payload("stage name"), payload("stage lead"), payload("stage type")
#: mathtext matplotlib cannot typeset: drawn as mathtext, it ends the figure with a parse error
MATH = r"$\undefinedcmd{x}$"
KEY_MATH = "plugin/" + MATH


class Texts(HTMLParser):
    """The text of every element of a page (by tag), its attributes, and its links."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.text, self.attrs, self.links = [], {}, [], []

    def handle_starttag(self, tag, attrs):
        self.attrs.append((tag, dict(attrs)))
        if tag == "a":
            self.links.append(dict(attrs).get("href"))
        if tag not in ("img", "meta", "br", "input", "link", "hr"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack.pop() != tag:
                pass

    def handle_data(self, data):
        for tag in set(self.stack):
            self.text.setdefault(tag, []).append(data)

    def has(self, tag: str, string: str) -> bool:
        return any(string in t for t in self.text.get(tag, []))


def read_dom(dom: str) -> Texts:
    parsed = Texts()
    parsed.feed(dom)
    return parsed


def loaded(chromium, page: Path, tmp_path: Path) -> tuple[list[str], str, Texts]:
    console, dom = open_page(chromium, page, tmp_path)
    return console, dom, read_dom(dom)


def assert_nothing_ran(console, dom, parsed):
    marks = [a.get(MARK) for _, a in parsed.attrs if MARK in a]
    assert not marks, f"markup from the run folder ran: {marks}"
    assert not [a for t, a in parsed.attrs if t == "img" and a.get("src") == "x"], "a payload became an element"
    errors = [line for line in console if "rror" in line or "Uncaught" in line or "Refused" in line
              or "Content Security Policy" in line]
    assert not errors, errors


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory, tiny_runs):
    """A real 12-step induction run whose folder holds hostile strings wherever it holds strings."""
    base = tmp_path_factory.mktemp("escaping")
    run = base / RUN_NAME
    shutil.copytree(tiny_runs("induction"), run)  # fit(run, *TASKS["induction"]) (conftest.py)
    folder = RunFolder(run)
    for step in (2, 4, 8, 12):
        append_jsonl(folder.metrics, {"step": step, KEY: 1.0 / step, KEY_SCRIPT: 0.5, KEY_BREAKOUT: step / 10,
                                      HEAD_KEY: step / 12, KEY_MATH: step / 2})
    events = [{"metric": "val/loss", "direction": REFERENCE_DIRECTION, "onset": 4, "midpoint": 6, "end": 8,
               "magnitude": -1.0},
              {"metric": EVENT_METRIC, "direction": DIRECTION, "onset": 2, "midpoint": 4, "end": 8,
               "magnitude": 0.5},
              {"metric": KEY, "direction": BREAKOUT, "onset": 2, "midpoint": 5, "end": 12, "magnitude": 0.2}]
    for event in events:
        append_jsonl(folder.events, event)
    write_stages(folder, [Stage(1, 2, 5, 12, [dict(events[2], series=KEY)], STAGE_LEAD, STAGE_NAME, STAGE_TYPE)])
    for step in (4, 12):
        folder.save_array(PROBE, ARRAY_KEY, step, np.array([[0.1, 0.2 * step]]))
        folder.save_array(PROBE, f"{ARRAY_KEY}_labels", step, np.array(LABELS))
    append_jsonl(folder.interventions, {"kind": INTERVENTION, "component": INTERVENTION, "start": 2, "end": 6})
    table, inputs = folder.diff_tables(DIFF_NAME)
    table.parent.mkdir(exist_ok=True)
    write_csv(["component", "kind", "weight_rel"], [{"component": COMPONENT, "kind": "attn", "weight_rel": 0.5}], table)
    write_csv(["tokens", "loss_a", "loss_b"], [{"tokens": TOKENS, "loss_a": 1.0, "loss_b": 2.0}], inputs)
    config = folder.config.read_text()
    folder.config.write_text(config.replace("seed_everything: 0", f"seed_everything: {json.dumps(SEED)}", 1))
    assert folder.read_config()["seed_everything"] == SEED
    return run


def assert_report_shows_text(parsed: Texts):
    assert parsed.has("h1", RUN_NAME) and parsed.has("title", RUN_NAME)
    rows = [t for t in parsed.text.get("td", [])]
    for string in (EVENT_METRIC, DIRECTION, KEY, BREAKOUT, REFERENCE_DIRECTION, COMPONENT, TOKENS,
                   STAGE_NAME, STAGE_LEAD, STAGE_TYPE, f"{KEY} {BREAKOUT}"):  # the stage table: what moved
        assert string in rows, f"{string!r} is not a table cell's text"
    legend = parsed.text.get("span", [])
    for key in (KEY, KEY_SCRIPT, KEY_BREAKOUT):
        assert "\u25a0 " + key in legend, f"{key!r} is not in a legend"
    assert parsed.has("div", f"{PROBE}/{ARRAY_KEY}")  # the array panel's title
    assert parsed.has("div", DIFF_NAME)


@pytest.mark.parametrize("live", [False, True], ids=["report", "live report"])
def test_run_report_shows_run_folder_strings_as_text(hostile_run, tmp_path, chromium, live):
    page = write_report(hostile_run, tmp_path / "report.html", live=live)
    text = page.read_text()
    assert ("http-equiv=\"refresh\"" in text) == live  # the live copy still reloads itself
    console, dom, parsed = loaded(chromium, page, tmp_path)
    assert_nothing_ran(console, dom, parsed)
    assert_report_shows_text(parsed)
    # the page's script ran to its end: the arrays were drawn (their sliders are there)
    assert sum(t == "input" and a.get("type") == "range" for t, a in parsed.attrs) >= 2


def test_population_page_shows_member_strings_as_text(hostile_run, tmp_path, chromium):
    pop = tmp_path / "population"
    names = [payload("member name"), "javascript:document.documentElement.setAttribute('data-pwned','link')"]
    for name in names:
        shutil.copytree(hostile_run, pop / name)
    page = write_population_report(pop)
    console, dom, parsed = loaded(chromium, page, tmp_path)
    assert_nothing_ran(console, dom, parsed)
    for name in names:
        assert parsed.has("li", name) and parsed.has("a", name)
    assert parsed.has("li", f"seed {SEED}")
    base = page.resolve().as_uri()
    # every link opens a member's own report, however the member is named (never a javascript: URL)
    targets = sorted(unquote(urlparse(urljoin(base, href)).path) for href in parsed.links)
    assert [urlparse(urljoin(base, href)).scheme for href in parsed.links] == ["file", "file"]
    assert targets == sorted(str((pop / n / "report.html").resolve()) for n in names)


def csp_of(text: str) -> str:
    match = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', text)
    assert match, "no Content-Security-Policy"
    return html.unescape(match.group(1))


def test_pages_run_only_their_own_script(hostile_run, tmp_path, chromium):
    """The policy of each page: nothing loads from anywhere, and the only script that runs is
    the page's own (by its hash): markup slipped into a copy of the page does not run."""
    pop = tmp_path / "population"
    shutil.copytree(hostile_run, pop / "m00")
    for page in (write_report(hostile_run, tmp_path / "report.html"), write_population_report(pop)):
        text = page.read_text()
        policy = csp_of(text)
        assert "default-src 'none'" in policy and "unsafe-inline" not in policy.split("script-src")[-1].split(";")[0]
        slipped = page.with_name("slipped.html")
        slipped.write_text(text.replace("<body>", "<body>" + payload("slipped in") + SCRIPT, 1))
        console, dom = open_page(chromium, slipped, tmp_path)
        parsed = read_dom(dom)
        assert not [a.get(MARK) for _, a in parsed.attrs if MARK in a]
        assert any("Content Security Policy" in line for line in console), console  # refused, and said so


class Touch:
    """An object whose unpickling creates a file: a pickle that runs code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_pickled_arrays_are_one_line_and_never_loaded(hostile_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(hostile_run, run)
    marker = tmp_path / "unpickled"
    bad = RunFolder(run).array_folder("evil", "objects") / "step=00000004.npy"
    bad.parent.mkdir(parents=True)
    np.save(bad, np.array([Touch(marker)], dtype=object), allow_pickle=True)
    bad = RunFolder(run).array_files("evil", "objects")[0][1]
    proc = subprocess.run([sys.executable, "-m", "phasewatch", "report", str(run)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("phasewatch:") or "Error" in line
             or line.startswith((" ", "Traceback"))]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("phasewatch: error: ") and str(bad) in lines[0] and "pickle" in lines[0]
    assert not marker.exists()


def test_figures_show_strings_literally(hostile_run, tmp_path):
    """`$...$` in a metric key, a run's or a member's name, or a config value is drawn as it is
    in every figure: the run's curves (`phasewatch report`), the population's members and the
    cross-run comparison (`phasewatch compare`)."""
    run = tmp_path / f"run {MATH}"
    shutil.copytree(hostile_run, run)
    assert main(["report", str(run)]) == 0
    assert (run / "figures" / "curves.png").stat().st_size > 10_000

    pop = tmp_path / "population"
    for name in (f"m00 {MATH}", "m01"):
        shutil.copytree(hostile_run, pop / name)
    write_population_report(pop)
    assert (pop / "figures" / "members.png").exists()

    other = tmp_path / "other"
    shutil.copytree(hostile_run, other)
    config = RunFolder(other).config
    config.write_text(config.read_text().replace("max_steps: 12", f"max_steps: {json.dumps(MATH)}", 1))
    assert main(["compare", str(run), str(other), "--out", str(tmp_path / "compare")]) == 0
    assert (tmp_path / "compare.png").exists()

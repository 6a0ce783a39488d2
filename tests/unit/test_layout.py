"""The package's layering: one module spells the run folder's file names, imports point down."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "phasewatch"
#: names of the run folder's files (and the sweep folder's), wherever code spells them (`?_step=` is W&B's rewind, not a file name)
RUN_FOLDER_FILES = re.compile(
    r"metrics\.jsonl|events\.jsonl|interventions\.jsonl|analyses\.jsonl|config\.yaml|last\.ckpt|report\.html"
    r"|sweep\.json|pca\.npy|(?<!_)step=|(^|/)(checkpoints|arrays|figures|logs|wandb)/")
#: names of its folders and id files: flagged where they join a path (`x / "arrays"`, os.path.join)
#: and not as configuration keys (`--checkpoints.schedule`, `config.get("wandb")`)
RUN_FOLDER_PARTS = {"checkpoints", "arrays", "figures", "logs", "wandb", "wandb_id", "wandb_group", ".lock"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (module, class and function docstrings say where things are)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _path_parts(tree: ast.AST) -> set[int]:
    """ids of the constants that join a path: operands of `/`, arguments of a `join`/`joinpath` call."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            out |= {id(node.left), id(node.right)}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("join", "joinpath"):
            out |= {id(a) for a in node.args}
    return out


def spelled_run_folder_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings, joins = _docstrings(tree), _path_parts(tree)
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and (RUN_FOLDER_FILES.search(node.value) or (id(node) in joins and node.value in RUN_FOLDER_PARTS))]


def test_the_grep_finds_a_spelled_file_name(tmp_path):
    """The check itself: a module that joins a run folder path by hand is caught."""
    bad = PACKAGE / "_layout_probe.py"
    try:
        bad.write_text('"""doc mentions metrics.jsonl freely"""\nfrom pathlib import Path\n'
                       'PATH = "runs/x/" + "metrics.jsonl"\nA = Path("runs/x") / "arrays"\nB = {"wandb": False}\n')
        assert [hit.split(": ", 1)[1] for hit in spelled_run_folder_names(bad)] == ["'metrics.jsonl'", "'arrays'"]
    finally:
        bad.unlink()


def test_no_file_name_of_the_run_folder_is_spelled_outside_rundir():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if "rundir" not in path.parts
             for hit in spelled_run_folder_names(path)]
    assert not found, "run-folder names spelled outside phasewatch/rundir (ask RunFolder instead):\n" + "\n".join(found)


#: DESIGN.md's layers, lowest first: a module imports its own layer and lower ones only.
LAYERS = {"rundir": 0, "models": 0, "tasks": 0, "probes": 1, "phases": 1, "diff": 1, "callbacks": 2, "loggers": 2,
          "report": 2, "training": 3, "cli": 4}
#: third-party packages a layer must not import (anywhere in its modules, lazily included)
FORBIDDEN = {"probes": {"lightning", "wandb"}, "phases": {"lightning", "wandb", "torch"}, "tasks": {"lightning", "wandb"},
             "rundir": {"lightning", "wandb", "transformer_lens"}}


def package_imports(path: Path, package: Path = PACKAGE) -> tuple[set[str], set[str]]:
    """The modules of `package` that the file imports (dotted, `from a.b import c` as a.b.c when
    c is a module, else a.b), and the top-level names of everything else it imports."""
    name = package.name
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    here = parts[:-1]  # the package a relative import starts from
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (package.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (package.parent / Path(*sub.split(".")) / "__init__.py").exists()
                targets.append(sub if is_module else base)
        else:
            continue
        for target in targets:
            if target == name or target.startswith(name + "."):
                inside.add(target)
            else:
                outside.add(target.split(".")[0])
    return inside, outside


def layering_problems(package: Path = PACKAGE) -> list[str]:
    """Imports that run up a layer, folders with no layer, forbidden third-party imports, and
    circles of modules importing each other."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    folder = lambda module: module.split(".")[1] if module.count(".") >= 1 and \
        modules[module].parent != package else None  # noqa: E731
    problems, graph = [], {}
    for module, path in modules.items():
        inside, outside = package_imports(path, package)
        graph[module] = {m for m in inside if m in modules and m != module}
        own = folder(module)
        if own is not None and own not in LAYERS:
            problems.append(f"unplaced: {module} (give phasewatch/{own}/ a layer in LAYERS and DESIGN.md)")
            continue
        for other in sorted(graph[module]):
            theirs = folder(other)
            if own is not None and theirs in LAYERS and LAYERS[theirs] > LAYERS[own]:
                problems.append(f"up: {module} imports {other} ({own} {LAYERS[own]} < {theirs} {LAYERS[theirs]})")
        for bad in sorted(outside & FORBIDDEN.get(own, set())):
            problems.append(f"forbidden: {module} imports {bad}")
    # circles: a module that can reach itself through the graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                problems.append("circle: " + " -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return problems


def test_imports_point_down_the_layers_and_form_no_circle():
    problems = layering_problems()
    assert not problems, "\n".join(problems)


def test_the_layering_check_finds_an_up_import_a_circle_and_an_unplaced_folder(tmp_path):
    """The check itself, on a package made for it: each kind of problem is reported."""
    pkg = tmp_path / "phasewatch"
    for folder, body in {"rundir": "from phasewatch.probes import a\n", "probes": "import lightning\nfrom phasewatch.probes import b\n",
                         "callbacks": "", "extra": ""}.items():
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
        (pkg / folder / "a.py").write_text(body)
    (pkg / "__init__.py").write_text("")
    (pkg / "probes" / "b.py").write_text("from phasewatch.probes import a\n")
    problems = layering_problems(pkg)
    assert "up: phasewatch.rundir.a imports phasewatch.probes.a (rundir 0 < probes 1)" in problems
    assert "forbidden: phasewatch.probes.a imports lightning" in problems
    assert any(p.startswith("circle: ") and "phasewatch.probes.a" in p and "phasewatch.probes.b" in p for p in problems)
    assert any(p.startswith("unplaced: phasewatch.extra") for p in problems)


def test_the_shared_layering_tool_agrees_where_it_is_beside_the_repository():
    checker = PACKAGE.parents[1] / "shared" / "tools" / "check_layers.py"
    if not checker.exists():
        pytest.skip("../shared/tools/check_layers.py is not beside the repository (the in-repo check above ran)")
    out = subprocess.run([sys.executable, str(checker), str(PACKAGE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 problem(s)" in out.stdout


#: a module docstring states the module's contract (what it computes, its public names) in at
#: most this many lines; rules, reasoning and the story of particular runs belong in docs/
DOCSTRING_LINES = 15
#: modules over the limit while their docstrings are being trimmed (issue 42); take each one out
#: as it gets within the limit: the allowance is temporary, not a second limit
LONG_DOCSTRINGS_BEING_TRIMMED: set[str] = set()  # none left


def long_module_docstrings(package: Path = PACKAGE) -> dict[str, int]:
    """module path -> lines of its docstring, for the modules whose docstring is over the limit."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if len(doc.splitlines()) > DOCSTRING_LINES:
            out[str(path.relative_to(package.parent))] = len(doc.splitlines())
    return out


def test_module_docstrings_state_a_short_contract():
    long = {path: n for path, n in long_module_docstrings().items() if path not in LONG_DOCSTRINGS_BEING_TRIMMED}
    assert not long, f"module docstrings over {DOCSTRING_LINES} lines (move the rules and reasoning to docs/): {long}"


def test_the_docstring_check_counts_the_docstrings_lines(tmp_path):
    pkg = tmp_path / "phasewatch"
    pkg.mkdir()
    (pkg / "short.py").write_text('"""' + "\n".join(f"line {i}" for i in range(15)) + '\n"""\nX = 1\n')
    (pkg / "long.py").write_text('"""' + "\n".join(f"line {i}" for i in range(16)) + '\n"""\nX = """\n' + "\n" * 30 + '"""\n')
    (pkg / "none.py").write_text("X = 1\n")
    assert long_module_docstrings(pkg) == {"phasewatch/long.py": 16}

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


def test_imports_point_down_the_layers_and_form_no_circle():
    checker = PACKAGE.parents[1] / "shared" / "tools" / "check_layers.py"
    if not checker.exists():
        pytest.skip("../shared/tools/check_layers.py is not beside the repository")
    out = subprocess.run([sys.executable, str(checker), str(PACKAGE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 problem(s)" in out.stdout

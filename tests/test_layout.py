"""The architecture as the folders show it: prepare -> artifact -> runtime, with eval, bench and the
CLI as clients. Data flows one way: the runtime imports none of its clients, nor prepare."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "infinigen"
SCRIPTS = PACKAGE.parent / "benchmarks"
CLIENTS = ("infinigen.eval", "infinigen.bench", "infinigen.cli", "infinigen.prepare")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "runtime").rglob("*.py")), ids=lambda p: p.name)
def test_runtime_imports_none_of_its_clients(path):
    leaks = {name for name in imported_modules(path) if name.startswith(CLIENTS)}
    assert not leaks, f"{path.relative_to(PACKAGE)} imports {sorted(leaks)}"


@pytest.mark.parametrize(
    "path", sorted([*(PACKAGE / "eval").rglob("*.py"), *(PACKAGE / "bench").rglob("*.py")]), ids=str
)
def test_eval_and_bench_do_not_import_the_command_line(path):
    leaks = {name for name in imported_modules(path) if name.startswith("infinigen.cli")}
    assert not leaks, f"{path.relative_to(PACKAGE)} imports {sorted(leaks)}"


def test_the_checker_sees_imports_inside_functions():
    assert "infinigen.eval.decoding" in imported_modules(PACKAGE / "cli" / "evaluate.py")


def test_modules_stay_short():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, f"modules over 500 lines: {long}"


def test_config_and_command_line_start_without_torch():
    """``infinigen --version`` and the config need neither torch nor transformers."""
    code = "import sys, infinigen.cli, infinigen.runtime.config; "
    code += "print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def package_imports(path: Path) -> list[ast.ImportFrom]:
    """The ``from infinigen... import`` statements of a script: a Python file's, or those of the Python
    a shell script embeds (its lines that are such statements)."""
    text = path.read_text()
    if path.suffix == ".sh":
        text = "\n".join(line for line in text.splitlines() if line.startswith("from infinigen"))
    found = (node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom))
    return [node for node in found if (node.module or "").startswith("infinigen")]


@pytest.mark.parametrize("path", sorted([*SCRIPTS.glob("*.py"), *SCRIPTS.glob("*.sh")]), ids=lambda p: p.name)
def test_benchmark_scripts_import_names_the_package_has(path):
    """The scripts under benchmarks/ run only on a GPU: a renamed function must still fail here."""
    missing = []
    for node in package_imports(path):
        module = importlib.import_module(node.module)
        missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert not missing, f"{path.name} imports {missing}"

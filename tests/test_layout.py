"""The architecture as the folders show it: prepare -> artifact -> runtime, with eval, bench and the
CLI as clients. Data flows one way: the runtime imports none of its clients, nor prepare; inside the
runtime, rooms (its subpackages; each remaining module its own) depend one way too."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "infinigen"
SCRIPTS = PACKAGE.parent / "benchmarks"
CLIENTS = ("infinigen.eval", "infinigen.bench", "infinigen.cli", "infinigen.prepare", "infinigen.serve")


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
    "path", sorted(p for d in ("eval", "bench", "serve") for p in (PACKAGE / d).rglob("*.py")), ids=str
)
def test_eval_bench_and_serve_do_not_import_the_command_line(path):
    leaks = {name for name in imported_modules(path) if name.startswith("infinigen.cli")}
    assert not leaks, f"{path.relative_to(PACKAGE)} imports {sorted(leaks)}"


def test_the_checker_sees_imports_inside_functions():
    assert "infinigen.eval.decoding" in imported_modules(PACKAGE / "cli" / "evaluate.py")


def imported_targets(path: Path, module: str, known: set[str]) -> set[str]:
    """The ``known`` modules ``path`` (module ``module``) imports anywhere in it: at module level, under
    ``TYPE_CHECKING`` or inside functions; ``from package import name`` counts ``package.name`` where
    that is a module, else the package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {target for target in targets if target in known}


def room_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Rooms of ``package`` (at ``root``) and the rooms each imports: a subpackage is one room, every
    other module (the package's ``__init__`` included) its own."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        modules[".".join((package, *parts))] = path

    def room(module: str) -> str:
        rest = module.removeprefix(package).lstrip(".")
        first = rest.split(".")[0]
        return first if first and (root / first).is_dir() else rest or "__init__"

    graph: dict[str, set[str]] = {room(m): set() for m in modules}
    for module, path in modules.items():
        graph[room(module)] |= {room(t) for t in imported_targets(path, module, set(modules))} - {room(module)}
    return graph


def room_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of rooms (a path that returns to its start), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(room: str) -> list[str] | None:
        state[room] = "open"
        path.append(room)
        for after in sorted(graph[room]):
            if state.get(after) == "open":
                return path[path.index(after) :] + [after]
            if after not in state and (found := visit(after)):
                return found
        state[room] = "done"
        path.pop()
        return None

    return next((found for room in sorted(graph) if room not in state and (found := visit(room))), None)


def test_runtime_rooms_depend_one_way():
    graph = room_graph(PACKAGE / "runtime", "infinigen.runtime")
    assert {"kernels", "memory", "selection", "cache"} <= graph.keys()
    cycle = room_cycle(graph)
    assert cycle is None, f"rooms of the runtime import each other: {' -> '.join(cycle)}"


def test_the_room_checker_sees_a_cycle_through_any_import(tmp_path):
    """A lower room naming a higher one only for a type, or inside a function, is still a cycle."""
    for name, text in {
        "low/__init__.py": "",
        "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import b\n",
        "high/__init__.py": "",
        "high/b.py": "def f():\n    from pkg.low import a\n",
        "top.py": "from pkg import high\n",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = room_graph(tmp_path, "pkg")
    assert graph == {"low": {"high"}, "high": {"low"}, "top": {"high"}}
    assert room_cycle(graph) in (["high", "low", "high"], ["low", "high", "low"])
    (tmp_path / "low" / "a.py").write_text("")
    assert room_cycle(room_graph(tmp_path, "pkg")) is None


def test_rooms_stay_small():
    """At most ~15 modules directly in the runtime and in any of its rooms."""
    folders = [
        PACKAGE / "runtime",
        *(p for p in (PACKAGE / "runtime").rglob("*") if p.is_dir() and p.name != "__pycache__"),
    ]
    crowded = {
        str(f.relative_to(PACKAGE)): n
        for f in folders
        if (n := len(list(f.glob("*.py"))) + len([d for d in f.iterdir() if d.is_dir() and d.name != "__pycache__"]))
        > 15
    }
    assert not crowded, f"folders with over 15 modules: {crowded}"


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

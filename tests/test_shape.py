"""The package's shape: no import circle of any kind (lazy and ``TYPE_CHECKING``-only imports count), no class over 200
lines and no function over 60, measured on ruff-formatted code. (Core v5's cap of 50 classes went with #43: it turned
named types into positional tuples.)"""

import ast
import graphlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "token_mean"


def _trees() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(SRC.glob("*.py"))}


def _imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its text."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts == ["token_mean"]:
                found.update(alias.name for alias in node.names)
            elif parts[0] == "token_mean":
                found.add(parts[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("token_mean."))
    return found & modules - {name, "__init__"}


def test_no_import_circle() -> None:
    trees = _trees()
    modules = set(trees) - {"__init__"}
    graph = {name: _imports(name, trees[name], modules) for name in modules}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle


LAYERS = {"_audit", "_count_check", "callback", "fabric_monitor", "_monitor", "_measure", "_trace", "plot",
          "_fingerprint", "metrics", "sampler"}
"""What sits on top of the core: the count check, the audit, the monitors with trace and plot, fingerprints, the
validation metric and sampler. Every other module is the core's, and imports none of them (#43)."""


def test_the_core_imports_no_layer() -> None:
    trees = _trees()
    modules = set(trees) - {"__init__"}
    assert modules >= LAYERS, LAYERS - modules
    graph = {name: _imports(name, trees[name], modules) for name in modules}
    for module in sorted(modules - LAYERS):
        reached, todo = set(), [module]
        while todo:  # everything the module imports, however indirectly
            for imported in graph[todo.pop()] - reached:
                reached.add(imported)
                todo.append(imported)
        assert not reached & LAYERS, f"the core module {module} imports the layers {sorted(reached & LAYERS)}"


def test_sizes() -> None:
    too_long = []
    for module, tree in _trees().items():
        for node in ast.walk(tree):
            limit = 200 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > limit:
                    too_long.append(f"{module}.{node.name}: {size} lines")
    assert not too_long


def test_src_is_ruff_formatted() -> None:
    """The sizes above are those of ruff's formatting (120 characters a line), not of denser code."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    result = subprocess.run([ruff, "format", "--check", str(SRC)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr

"""Imports point one way: protocol at the bottom, client on top, examples above (DESIGN.md, "Layout").

Every import statement of every module is read, those inside functions too, so a lazy import that
points the wrong way fails here as well. The packages a laptop installs never import torch, and no
module imports itself back through a circle of others (imports under `if TYPE_CHECKING:` never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

# package -> the packages of ours it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "exporters": {"protocol"},
    "rollouts": {"protocol"},
    "rewards": {"protocol"},
    "server": {"protocol", "exporters"},
    "client": {"protocol", "exporters", "rollouts", "rewards"},
    "environments": {"protocol", "rollouts", "rewards"},
    "examples": {"protocol", "exporters", "rollouts", "rewards", "client", "server", "environments"},
}
OURS = set(ALLOWED) | {"tests", "bench"}
# What runs on a laptop never needs the GPU stack.
NO_TORCH = {"protocol", "exporters", "rollouts", "rewards", "client", "environments"}
TORCH_STACK = {"torch", "transformers", "peft", "accelerate", "vllm"}


def imported_roots(source: str) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import in the source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return sorted(found)


def violations(root: Path) -> list[str]:
    out = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported_roots(path.read_text()):
                where = f"{path.relative_to(root)}:{line}"
                if module in OURS and module != package and module not in allowed:
                    out.append(f"{where} imports {module}: {package} may import only "
                               f"{', '.join(sorted(allowed)) or 'nothing of ours'}")
                if package in NO_TORCH and module in TORCH_STACK:
                    out.append(f"{where} imports {module}: {package} runs on a laptop without torch")
    return out


def test_the_tree_imports_one_way():
    assert violations(ROOT) == []


def test_a_planted_wrong_import_is_caught(tmp_path):
    (tmp_path / "protocol").mkdir()
    (tmp_path / "protocol" / "ok.py").write_text("import json\n")
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "agent.py").write_text(
        "from protocol.trajectory import Trajectory\n"
        "def helper():\n    from server.chat import render  # lazy, still wrong\n"
        "import torch\n")
    found = violations(tmp_path)
    assert len(found) == 2
    assert found[0].startswith("rollouts/agent.py:3 imports server")
    assert found[1].startswith("rollouts/agent.py:4 imports torch")


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, lazy ones too, except those under `if TYPE_CHECKING:` (never run)."""
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports; `from a import b` is an edge to a.b when b is a module."""
    paths = {_module(p, root): p for package in ALLOWED for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in paths}
                continue
            module = node.module or ""
            if node.level:
                module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            edges |= {f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names}
        graph[name] = {m for m in edges if m in paths and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_in_a_circle():
    assert circles(import_graph(ROOT)) == []


def test_a_planted_circle_is_caught(tmp_path):
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "__init__.py").write_text("")
    (tmp_path / "rollouts" / "agent.py").write_text("from rollouts.env import Example\n")
    (tmp_path / "rollouts" / "env.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollouts.tools import T\n"
        "def run():\n    from . import agent  # lazy, still a circle\n")
    (tmp_path / "rollouts" / "tools.py").write_text("from rollouts import env\n")
    assert circles(import_graph(tmp_path)) == [["rollouts.agent", "rollouts.env"]]


# server/api/ is the HTTP face and the top of the server: only the process's entry points build it.
API_USERS = {"server.app", "server.cli"}


def api_importers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m, edges in graph.items()
                  if m.startswith("server.") and not m.startswith("server.api") and m not in API_USERS
                  and any(e == "server.api" or e.startswith("server.api.") for e in edges))


def test_only_the_entry_points_import_the_http_face():
    assert api_importers(import_graph(ROOT)) == []


def test_a_planted_import_of_the_http_face_is_caught():
    graph = {"server.training.jobs": {"server.api.errors"}, "server.app": {"server.api.deps"}}
    assert api_importers(graph) == ["server.training.jobs"]

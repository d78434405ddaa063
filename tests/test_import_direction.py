"""Imports point one way: protocol at the bottom, client on top, examples above (DESIGN.md, "Layout").

Every import statement of every module is read, those inside functions too, so a lazy import that
points the wrong way fails here as well. The packages a laptop installs never import torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

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

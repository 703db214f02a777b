"""The package map of docs/architecture.md holds: engine, core, worker, disagg, layers and ops
import one another in one direction only (no import circle, function-level imports included),
and the host side (engine, core) never touches torch.cuda."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import frugal

ROOT = pathlib.Path(frugal.__file__).parent
FLOORS = ("engine", "core", "worker", "disagg", "layers", "ops")


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in the file, at any depth (`from frugal import
    ops`: frugal.ops)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "frugal" and node.level == 0:
            found += [(f"frugal.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


def _edges() -> dict[str, dict[str, str]]:
    """floor -> {floor it imports: where (file:line), the first place found}."""
    edges: dict[str, dict[str, str]] = {floor: {} for floor in FLOORS}
    for floor in FLOORS:
        for path in sorted((ROOT / floor).rglob("*.py")):
            for module, line in _imports(path):
                parts = module.split(".")
                if parts[0] == "frugal" and len(parts) > 1 and parts[1] in FLOORS \
                        and parts[1] != floor:
                    edges[floor].setdefault(parts[1], f"{path.relative_to(ROOT)}:{line}")
    return edges


def test_the_floors_import_one_way():
    edges = _edges()
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(floor: str, path: list[str]) -> None:
        state[floor] = 1
        for other, where in edges[floor].items():
            if state.get(other) == 1:
                loop = path[path.index(other):] + [floor, other]
                raise AssertionError(f"import circle {' -> '.join(loop)} (last at {where})")
            if other not in state:
                visit(other, path + [floor])
        state[floor] = 2

    for floor in FLOORS:
        if floor not in state:
            visit(floor, [])
    assert edges["ops"] == {} and edges["core"] == {}, edges


def test_the_host_side_knows_no_cuda():
    for floor in ("engine", "core"):
        for path in (ROOT / floor).rglob("*.py"):
            assert "torch.cuda" not in path.read_text(), path


def test_a_circle_is_found(monkeypatch):
    """The check can fail: a made-up import from ops back into the worker is a circle."""
    real = _edges

    def with_loop() -> dict[str, dict[str, str]]:
        edges = real()
        edges["ops"]["worker"] = "ops/made_up.py:1"
        return edges

    monkeypatch.setattr(sys.modules[__name__], "_edges", with_loop)
    with pytest.raises(AssertionError, match="import circle"):
        test_the_floors_import_one_way()

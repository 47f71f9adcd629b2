"""The import graph between trl_stable's top-level subpackages (and loose top-level modules) has no cycle.

Every ``import`` statement of every module counts, deferred ones (inside a function) and ``TYPE_CHECKING`` ones
included: a cycle hidden behind a function-level import is still two packages that each need the other.
"""

import ast
import sys
from collections import defaultdict
from pathlib import Path

import trl_stable

PACKAGE = Path(trl_stable.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if not node.level:
            return [node.module or ""]
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return [".".join(base + ([node.module] if node.module else []))]
    return []


def _unit(module: str) -> str | None:
    """The top-level subpackage or loose module of a trl_stable module (None for `trl_stable` itself / others)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "trl_stable" and len(parts) > 1 else None


def import_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> ["path:line", ...] of the imports that make the edge."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _unit(module)
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _imported(node, module, path.name == "__init__.py"):
                unit = _unit(target)
                if unit is not None and unit != source:
                    graph[source][unit].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = "open"
        stack.append(unit)
        for nxt in sorted(graph.get(unit, {})):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[unit] = "done"
        return None

    for unit in sorted(graph):
        if unit not in state and (found := visit(unit)):
            return found
    return None


def test_no_import_cycle_between_subpackages():
    graph = import_graph()
    cycle = _cycle(graph)
    if cycle is not None:
        edges = [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between trl_stable packages:\n  " + "\n  ".join(edges))


def test_the_cycle_finder_finds_a_deferred_cycle(tmp_path, monkeypatch):
    """The check above cannot pass by not looking: a function-level import closing a loop is found."""
    root = tmp_path / "trl_stable"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from trl_stable.b import thing\n")
    (root / "b" / "__init__.py").write_text("thing = 1\n\n\ndef later():\n    from ..a import other\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    graph = import_graph()
    assert graph["b"]["a"] == ["trl_stable/b/__init__.py:5"]
    assert _cycle(graph) == ["a", "b", "a"]


def test_monitoring_imports_no_trainer_internals():
    graph = import_graph()
    assert not {"trainers", "integration", "trl_internals"} & set(graph.get("monitoring", {})), dict(
        graph["monitoring"]
    )


def test_no_loose_top_level_modules():
    """Every module lives in the package of its concept; the top level holds only the public entry point."""
    loose = sorted(path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    assert loose == [], loose

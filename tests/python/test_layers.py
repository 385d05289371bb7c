"""Imports run one way (DESIGN.md, "Python"): tools and integrations -> fronts -> checkpoint/ -> helpers -> _C.

Read from the source, not from sys.modules: every ``import`` a module runs (at its top or inside a function;
``if TYPE_CHECKING:`` blocks excepted, they never run) is an edge, and the graph of shardkit's modules has no
cycle, and checkpoint/ reaches no front.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "shardkit"
FRONTS = {"shardkit.ddp", "shardkit.zero", "shardkit.hooks", "shardkit.state_dict", "shardkit.strategy"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The shardkit modules ``path`` imports when it runs."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import fsdp` imports a module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths} | {"shardkit._C"}
    return {_module_name(p): _runtime_imports(p, modules) for p in paths}


def _module_edges() -> dict[str, set[str]]:
    """The graph without edges into packages' __init__ files: those import their children, and a child importing
    a sibling through its package (`from ..checkpoint import _x`) is an edge to that sibling, read as such."""
    graph = _graph()
    inits = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    return {m: {n for n in targets if n not in inits} for m, targets in graph.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_is_read():
    graph = _graph()
    assert "shardkit.checkpoint._sharded_state" in graph["shardkit.checkpoint._fsdp_state_dict"]
    assert "shardkit.ddp" in graph["shardkit.fsdp._fsdp1"]
    # A TYPE_CHECKING import is no edge: _fsdp_state_dict names the FSDP1 front only in annotations.
    assert "shardkit.fsdp._fsdp1" not in graph["shardkit.checkpoint._fsdp_state_dict"]


def test_no_import_cycle():
    edges = _module_edges()
    cycles = sorted(m for m in edges if m in _reachable(edges, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


@pytest.mark.parametrize("module", ["shardkit.checkpoint._fsdp_state_dict", "shardkit.checkpoint._fsdp_optim_state",
                                    "shardkit.checkpoint._zero_state_dict", "shardkit.checkpoint._sharded_state",
                                    "shardkit.checkpoint._load", "shardkit.checkpoint._save"])
def test_checkpoint_reaches_no_front(module):
    reached = _reachable(_module_edges(), module)
    fronts = {m for m in reached if m in FRONTS or m.startswith("shardkit.fsdp.")}
    assert not fronts, f"{module} imports the fronts {sorted(fronts)}"


def test_the_integrations_shared_module_imports_no_training_library():
    """integrations/_wrapping.py serves accelerate, the Trainer and Lightning alike: it imports the standard
    library, torch and shardkit only, so each integration needs nothing but its own library."""
    import sys

    path = PACKAGE / "integrations" / "_wrapping.py"
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots.add((node.module or "").split(".")[0])
    outside = {r for r in roots if r not in sys.stdlib_module_names and r not in ("torch", "shardkit")}
    assert not outside, outside

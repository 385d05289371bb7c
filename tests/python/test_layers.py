"""Imports run one way (DESIGN.md, "Python"): tools and integrations -> fronts -> checkpoint/ -> helpers -> _C.

Read from the source, not from sys.modules: every ``import`` a module runs (at its top or inside a function;
``if TYPE_CHECKING:`` blocks excepted, they never run) is an edge, and the graph of shardkit's modules has no
cycle, and checkpoint/ reaches no front. checkpoint/ does not even name a front for its annotations, and reads
no private attribute of what a front hands it: each front's state-dict adapter lives with the front
(fsdp/_state_dict.py, _zero_state_dict.py) and reaches checkpoint/ through its protocol (_front_protocol.py).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "shardkit"
FRONTS = {"shardkit.ddp", "shardkit.zero", "shardkit._zero_state_dict", "shardkit.hooks", "shardkit.state_dict",
          "shardkit.strategy"}
CHECKPOINT = PACKAGE / "checkpoint"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_imports(path: pathlib.Path, modules: set[str], type_checking: bool = False) -> set[str]:
    """The shardkit modules ``path`` imports when it runs (``type_checking``: and those it names for annotations
    only, under ``if TYPE_CHECKING:``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node) and not type_checking:
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
    assert "shardkit.checkpoint._sharded_state" in graph["shardkit.fsdp._state_dict"]
    assert "shardkit.fsdp._state_dict" in graph["shardkit.fsdp._fsdp1"]
    # A TYPE_CHECKING import is no edge: the FSDP1 front's adapter names the front only in annotations.
    assert "shardkit.fsdp._fsdp1" not in graph["shardkit.fsdp._state_dict"]
    assert "shardkit.fsdp._fsdp1" in _runtime_imports(PACKAGE / "fsdp" / "_state_dict.py", set(graph),
                                                      type_checking=True)


def test_no_import_cycle():
    edges = _module_edges()
    cycles = sorted(m for m in edges if m in _reachable(edges, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_fronts_import_one_another_for_no_state_dict():
    """The FSDP1 front reaches DDP's and ZeRO's state dicts through checkpoint's protocol, not by importing them;
    shardkit.state_dict likewise reaches the fronts' optimizers (it imports DDP only for its canonical names)."""
    edges = _module_edges()
    reached = _reachable(edges, "shardkit.fsdp._fsdp1")
    assert not {"shardkit.ddp", "shardkit.zero", "shardkit._zero_state_dict"} & reached
    assert "shardkit.fsdp._fsdp1" not in _reachable(edges, "shardkit.state_dict")


@pytest.mark.parametrize("module", sorted(_module_name(p) for p in sorted((PACKAGE / "checkpoint").glob("*.py"))))
def test_checkpoint_reaches_no_front(module):
    reached = _reachable(_module_edges(), module)
    fronts = {m for m in reached if m in FRONTS or m.startswith("shardkit.fsdp.")}
    assert not fronts, f"{module} imports the fronts {sorted(fronts)}"


def _checkpoint_modules() -> list[pathlib.Path]:
    return sorted(CHECKPOINT.glob("*.py"))


@pytest.mark.parametrize("path", _checkpoint_modules(), ids=lambda p: p.name)
def test_checkpoint_names_no_front(path):
    """Not even for annotations: a TYPE_CHECKING import of a front hides a circle that only the type checker
    sees, and says checkpoint/ knows the front's insides."""
    modules = set(_graph())
    named = _runtime_imports(path, modules, type_checking=True)
    fronts = {m for m in named if m in FRONTS or m.startswith("shardkit.fsdp") or m.startswith("shardkit.integrations")}
    assert not fronts, f"checkpoint/{path.name} imports the fronts {sorted(fronts)}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (imports, functions, classes, assignments; inside top-level
    ``if`` / ``try`` blocks too): what ``x`` in ``x._name`` may be for the module to be reading its own."""
    names: set[str] = set()

    def bind(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.If):
                bind(node.body)
                bind(node.orelse)
            elif isinstance(node, ast.Try):
                bind(node.body)
                for handler in node.handlers:
                    bind(handler.body)

    bind(tree.body)
    return names


def _root_name(node: ast.expr) -> str | None:
    """``a`` for ``a.b[0].c()``: whose object an attribute chain starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reads(path: pathlib.Path) -> list[str]:
    """``x._name`` and ``getattr(x, "_name")`` (hasattr, setattr too) where ``x`` is neither ``self`` / ``cls``
    nor a name of the module itself: a private attribute of an object handed in (a front's, in checkpoint/).
    Dunders are no one's private."""
    tree = ast.parse(path.read_text(), str(path))
    own = _module_level_names(tree) | {"self", "cls"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            subject = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_private(node.args[1].value)):
            subject = node.args[0]
        else:
            continue
        if _root_name(subject) not in own:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_read_check_sees_them():
    """The check itself: it flags a handed-in object's private attribute, by name and by getattr, and passes
    self's, a module's and dunders."""
    import tempfile

    source = ("import torch\nimport torch.distributed as dist\nfrom .. import _flat\n"
              "def f(model, self):\n"
              "    model._units, getattr(model, '_state_dict_type', None), model.module._inner\n"
              "    self._mine, torch._C, _flat.x, dist.group._WORLD, type(model).__name__, model.public\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "probe.py"
        path.write_text(source)
        found = _private_reads(path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "model._units", "getattr(model, '_state_dict_type', None)", "model.module._inner"], found


def test_checkpoint_reads_no_private_attribute_of_a_front():
    """checkpoint/ works on ShardedSpace / Place / Slot / PieceTensor and the fronts' protocol
    (_front_protocol.py); a front's own layout is read by the front's adapter, beside it."""
    found = [read for path in _checkpoint_modules() for read in _private_reads(path)]
    assert not found, "checkpoint/ reads private attributes of objects handed to it:\n" + "\n".join(found)


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

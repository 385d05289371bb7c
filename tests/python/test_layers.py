"""Imports run one way (docs/design.md, "Python"): tools and integrations -> fronts -> checkpoint/ -> helpers -> _C.

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
FRONTS = {"shardkit.ddp", "shardkit._ddp_join", "shardkit.zero", "shardkit._zero_state_dict", "shardkit.hooks",
          "shardkit.state_dict", "shardkit.strategy"}
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


# --- private torch names live in _torch_compat.py only ----------------------------------------------------------
# What counts as a private torch access, read from the source of every module but _torch_compat.py:
# - importing a torch module whose path has a private part (``import torch._dynamo``, ``from torch._C import x``,
#   ``from torch.distributed.fsdp._fully_shard import x``) or a private name (``from torch.x import _y``);
# - an attribute chain from a name bound to torch (an ``import torch...`` or ``from torch... import x``), through
#   attributes, calls or subscripts, with a private part (``dist._broadcast_coalesced``, ``torch._C.x``,
#   ``nn.modules.module._IncompatibleKeys``, ``TorchDDP._active_ddp_module``), string annotations included;
# - reading a private attribute of any other object (``module._forward_hooks``, ``self._compiled_call_impl`` of an
#   nn.Module subclass, ``getattr(state, "_fsdp_param_groups")``) whose name shardkit itself never defines (as a
#   function, class, module, variable, argument or stored attribute anywhere in python/shardkit): such a name is
#   someone else's. Not torch's: attributes of a module imported from another library (``os._exit``), ``self``'s
#   in a class deriving only from another library's classes (accelerate's Accelerator, Lightning's DDPStrategy,
#   transformers' Trainer), and OTHER_LIBRARIES_PRIVATES.
# Private means one leading underscore; dunders (``__call__``) are not private. A torch private that shardkit also
# defines under the same name, stored rather than read, is not seen (shardkit DDP's _divide_by_initial_world_size).
COMPAT = PACKAGE / "_torch_compat.py"
OTHER_LIBRARIES_PRIVATES = {
    ("integrations/lightning.py", "_optimizer"): "the torch optimizer a LightningOptimizer wraps",
    ("integrations/transformers.py", "_no_split_modules"): "transformers' PreTrainedModel's unsplittable blocks",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _shardkit_names() -> set[str]:
    """Every name python/shardkit defines: its modules and packages, and every function, class, variable, argument,
    stored attribute and name imported from elsewhere than torch in its source."""
    names = {p.name.split(".")[0] for p in PACKAGE.rglob("*") if "__pycache__" not in p.parts}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("torch"))
            elif isinstance(node, ast.ImportFrom) and (node.level or not (node.module or "").startswith("torch")):
                names.update(a.asname or a.name for a in node.names)
    return names


def _import_bindings(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to torch or something imported from it, names bound to other imported modules or objects,
    shardkit's own included)."""
    torch_bound, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                (torch_bound if alias.name.split(".")[0] == "torch" else other).add(bound)
        elif isinstance(node, ast.ImportFrom):
            from_torch = not node.level and (node.module or "").split(".")[0] == "torch"
            for alias in node.names:
                (torch_bound if from_torch else other).add(alias.asname or alias.name)
    return torch_bound, other


def _private_import(node: ast.AST) -> str | None:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names
                 if a.name.split(".")[0] == "torch" and any(map(_is_private, a.name.split(".")))]
        return f"import {', '.join(names)}" if names else None
    if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
        if any(map(_is_private, node.module.split("."))) or any(_is_private(a.name) for a in node.names):
            return f"from {node.module} import {', '.join(a.name for a in node.names)}"
    return None


def _chain_base(node: ast.AST, through_calls: bool) -> ast.AST:
    """The expression an attribute chain starts from: through attributes only, or through calls and subscripts
    too (``torch.empty(1)._x`` starts from torch; ``module_of(x)._y`` is no attribute of a module)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif through_calls and isinstance(node, ast.Call):
            node = node.func
        elif through_calls and isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node


def _private_torch_uses(path: pathlib.Path, source: str, own: set[str]) -> list[str]:
    """``file:line: expression (why)`` for each private torch access in ``source`` (see the rules above)."""
    relative = path.relative_to(PACKAGE).as_posix()
    tree = ast.parse(source, str(path))
    torch_bound, other = _import_bindings(tree)
    found: list[str] = []

    def name_of(node: ast.AST) -> str | None:
        return node.id if isinstance(node, ast.Name) else None

    def report(node: ast.AST, line: int, why: str) -> None:
        found.append(f"python/shardkit/{relative}:{line}: {ast.unparse(node) if isinstance(node, ast.AST) else node} "
                     f"({why})")

    def someone_elses(name: str, base: ast.AST, library_self: bool) -> bool:
        """A private attribute ``name`` read from ``base``, not from torch: whose is it?"""
        if name in own or (relative, name) in OTHER_LIBRARIES_PRIVATES:
            return False
        if name_of(base) in other:
            return False  # an attribute of another library's module or object
        return not (library_self and name_of(base) in ("self", "cls"))

    def visit(node: ast.AST, library_self: bool, line: int | None = None) -> None:
        at = line or getattr(node, "lineno", 0)
        if (text := _private_import(node)) is not None:
            report(text, at, "import of a private torch module or name")
        if isinstance(node, ast.ClassDef):
            bases = [name_of(_chain_base(b, through_calls=False)) for b in node.bases]
            library_self = bool(bases) and all(b in other and b not in torch_bound and not _is_shardkit_import(tree, b)
                                               for b in bases)
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if name_of(_chain_base(node, through_calls=True)) in torch_bound:
                report(node, at, "a private name reached from torch")
                return  # the chain is reported once, at its outermost private part
            if isinstance(node.ctx, ast.Load) and someone_elses(node.attr, _chain_base(node, through_calls=False),
                                                                 library_self):
                report(node, at, "a private attribute shardkit does not define: torch's")
                return
        if isinstance(node, ast.Call) and name_of(node.func) in ("getattr", "hasattr", "setattr", "delattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value):
            target, attribute = node.args[0], node.args[1].value
            if name_of(_chain_base(target, through_calls=True)) in torch_bound:
                report(node, at, "a private name reached from torch")
            elif someone_elses(attribute, _chain_base(target, through_calls=False), library_self):
                report(node, at, "a private attribute shardkit does not define: torch's")
        for annotation in _string_annotations(node):
            visit(ast.parse(annotation, mode="eval").body, library_self, at)
        for child in ast.iter_child_nodes(node):
            visit(child, library_self, line)

    visit(tree, False)
    return found


def _is_shardkit_import(tree: ast.AST, name: str) -> bool:
    """Whether ``name`` is bound by a relative import (one of shardkit's own modules or names)."""
    return any(isinstance(n, ast.ImportFrom) and n.level and any((a.asname or a.name) == name for a in n.names)
               for n in ast.walk(tree))


def _string_annotations(node: ast.AST) -> list[str]:
    annotations = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        annotations = [node.returns] + [a.annotation for a in (*node.args.posonlyargs, *node.args.args,
                                                                 *node.args.kwonlyargs, node.args.vararg,
                                                                 node.args.kwarg) if a is not None]
    elif isinstance(node, ast.AnnAssign):
        annotations = [node.annotation]
    return [a.value for a in annotations if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def test_private_torch_names_are_used_in_the_compat_module_only():
    """Every private torch interface shardkit relies on is one documented function or name of _torch_compat.py,
    where a torch release that changes it is met in one place (docs/design.md, "Python")."""
    own = _shardkit_names()
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT
             for use in _private_torch_uses(path, path.read_text(), own)]
    assert not found, ("private torch names used outside python/shardkit/_torch_compat.py (give each a documented "
                       "function there and call that):\n" + "\n".join(found))


def test_the_private_torch_check_sees_each_kind():
    source = '''
import torch
import torch._dynamo
import torch.distributed as dist
import os
from torch import nn
from torch.distributed.distributed_c10d import _get_default_group
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch._C import DisableTorchFunctionSubclass
from . import _C

def f(module, state, options: "dist.distributed_c10d._DistributedBackendOptions"):
    dist._broadcast_coalesced(None, [], 1, 0)
    torch.empty(1)._version
    TorchDDP._active_ddp_module = None
    state.__class__, os._exit, _C._private_of_shardkits_extension
    getattr(state, "_fsdp_param_groups", None)
    getattr(state, "_mine", None)
    return module._forward_hooks or nn.modules.module._global_forward_hooks or module._mine

class Sub(nn.Module):
    def g(self):
        self._mine = self._compiled_call_impl
'''
    path = PACKAGE / "example.py"
    found = [use.split(": ", 1)[1].rsplit(" (", 1)[0] for use in _private_torch_uses(path, source, {"_mine"})]
    assert found == ["import torch._dynamo", "from torch.distributed.distributed_c10d import _get_default_group",
                     "from torch._C import DisableTorchFunctionSubclass",
                     "dist.distributed_c10d._DistributedBackendOptions",
                     "dist._broadcast_coalesced", "torch.empty(1)._version", "TorchDDP._active_ddp_module",
                     "getattr(state, '_fsdp_param_groups', None)", "module._forward_hooks",
                     "nn.modules.module._global_forward_hooks", "self._compiled_call_impl"], found


def test_every_compat_function_says_what_it_wraps():
    tree = ast.parse(COMPAT.read_text(), str(COMPAT))
    undocumented = [node.name for node in tree.body
                    if isinstance(node, ast.FunctionDef) and not ast.get_docstring(node)]
    assert not undocumented, f"_torch_compat.py functions without a docstring: {undocumented}"

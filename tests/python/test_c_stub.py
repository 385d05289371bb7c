"""python/shardkit/_C.pyi, the types of the extension module, says what the module binds: the same top-level names
as the built ``shardkit._C`` and as csrc/bindings.cpp (whose CUDA-only names a CPU build lacks), the same members
of each class, and the same parameter names, in order, with defaults in the same places.

What each test can catch: a binding added, removed or renamed in bindings.cpp without the stub (type checkers and
editors would then trust a stub that lies), a stub entry for nothing, a ``py::arg`` renamed or given a default.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUB = REPO / "python" / "shardkit" / "_C.pyi"
BINDINGS = REPO / "csrc" / "bindings.cpp"
PYBIND_INTERNALS = {"_pybind11_conduit_v1_"}  # what pybind11 adds to every class it makes


# --- the stub, read with ast ----------------------------------------------------------------------------------
def _stub() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _stub_names(tree: ast.Module) -> dict[str, ast.AST]:
    """The stub's public names: its classes, functions and annotated values (not what it imports)."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _stub_members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            members[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = node
    return members


def _stub_parameters(function: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter but ``self``, in order."""
    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    listed = list(zip([a.arg for a in positional], defaults))
    listed += [(a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [(name, has_default) for name, has_default in listed if name != "self"]


# --- the module, introspected ---------------------------------------------------------------------------------
def _module():
    from shardkit import _C

    return _C


def _module_names(module) -> dict[str, object]:
    return {name: value for name, value in vars(module).items() if not name.startswith("__")}


def _bound_signature(function) -> str | None:
    """The first line of a pybind11 function's docstring, ``name(self: ..., a: T = d) -> R``: its signature."""
    doc = (getattr(function, "__doc__", None) or "").strip()
    name = getattr(function, "__name__", "")
    first = doc.splitlines()[0] if doc else ""
    return first if name and first.startswith(f"{name}(") else None


def _module_members(cls: type) -> dict[str, object]:
    """A class's own members as bound: its methods, properties and attributes, and the dunders bindings.cpp
    defines (``__init__``, ``__repr__``: those carry a pybind11 signature; a class without a constructor keeps
    pybind11's, which does not)."""
    members = {}
    for name, value in vars(cls).items():
        if name in PYBIND_INTERNALS:
            continue
        if name.startswith("__") and name.endswith("__") and _bound_signature(value) is None:
            continue
        members[name] = value
    return members


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _bound_parameters(function) -> list[tuple[str, bool]] | None:
    """(name, has a default) of each parameter but ``self`` of a pybind11 function, from its signature line."""
    signature = _bound_signature(function)
    if signature is None:
        return None
    inside = signature[signature.index("(") + 1:signature.rindex(") -> ")]
    parameters = [(p.split(":", 1)[0].strip(), " = " in p) for p in _split_top_level(inside)]
    return [(name, has_default) for name, has_default in parameters if name != "self"]


# --- bindings.cpp ---------------------------------------------------------------------------------------------
def _bound_in_source() -> tuple[set[str], set[str]]:
    """(every top-level name bindings.cpp binds, those bound only under SHARDKIT_WITH_CUDA)."""
    source = BINDINGS.read_text()
    body = source[source.index("PYBIND11_MODULE("):]
    pattern = re.compile(r'm\.(?:def|attr)\(\s*"(\w+)"|py::class_<.*?>\(m, "(\w+)"', re.S)

    def names(text: str) -> set[str]:
        return {a or b for a, b in pattern.findall(text)}

    cuda_begin = body.index("#ifdef SHARDKIT_WITH_CUDA")
    cpu_begin = body.index("#else", cuda_begin)
    cuda_block, cpu_block = body[cuda_begin:cpu_begin], body[cpu_begin:body.index("#endif", cpu_begin)]
    return names(body), names(cuda_block) - names(cpu_block)


# --- the tests ------------------------------------------------------------------------------------------------
def test_the_stub_names_what_bindings_cpp_binds():
    everything, _ = _bound_in_source()
    stubbed = set(_stub_names(_stub()))
    assert not everything - stubbed, f"bound in csrc/bindings.cpp, missing from _C.pyi: {sorted(everything - stubbed)}"
    assert not stubbed - everything, f"in _C.pyi, not bound in csrc/bindings.cpp: {sorted(stubbed - everything)}"


def test_the_stub_names_what_the_built_module_has():
    module = _module()
    _, cuda_only = _bound_in_source()
    expected = set(_stub_names(_stub()))
    if not module.with_cuda:
        expected -= cuda_only
    present = set(_module_names(module))
    assert not present - expected, f"shardkit._C has, _C.pyi lacks: {sorted(present - expected)}"
    assert not expected - present, f"_C.pyi names, shardkit._C lacks: {sorted(expected - present)}"


def _stub_classes() -> list[str]:
    return sorted(name for name, node in _stub_names(_stub()).items() if isinstance(node, ast.ClassDef))


@pytest.mark.parametrize("name", _stub_classes())
def test_each_class_has_the_members_the_stub_gives_it(name: str):
    cls = getattr(_module(), name)
    assert inspect.isclass(cls), f"shardkit._C.{name} is a {type(cls).__name__}, _C.pyi says a class"
    stubbed = _stub_members(_stub_names(_stub())[name])
    bound = _module_members(cls)
    assert not set(bound) - set(stubbed), f"shardkit._C.{name} has, _C.pyi lacks: {sorted(set(bound) - set(stubbed))}"
    assert not set(stubbed) - set(bound), f"_C.pyi's {name} has, shardkit._C lacks: {sorted(set(stubbed) - set(bound))}"


def test_every_function_has_the_parameters_it_is_bound_with():
    module = _module()
    stubbed = _stub_names(_stub())
    checked, differ = 0, []
    callables = [(name, stubbed[name], value) for name, value in _module_names(module).items()
                 if isinstance(stubbed.get(name), ast.FunctionDef)]
    for cls_name, node in stubbed.items():
        if isinstance(node, ast.ClassDef) and hasattr(module, cls_name):
            members = _module_members(getattr(module, cls_name))
            callables += [(f"{cls_name}.{name}", member, members[name]) for name, member in _stub_members(node).items()
                          if isinstance(member, ast.FunctionDef) and not member.decorator_list and name in members]
    for where, node, function in callables:
        bound = _bound_parameters(function)
        assert bound is not None, f"shardkit._C.{where}: no pybind11 signature in its docstring to compare with"
        if bound != _stub_parameters(node):
            differ.append(f"{where}: bound {bound}, stub {_stub_parameters(node)}")
        checked += 1
    assert not differ, "parameters (name, has a default) differ:\n" + "\n".join(differ)
    assert checked > 50  # the walk reached the classes' methods, not only the module's functions

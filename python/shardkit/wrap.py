"""Auto-wrap policies for shardkit.FullyShardedDataParallel, with torch FSDP1's signatures.

A policy is called as ``policy(module=m, recurse=..., nonwrapped_numel=n)`` while FSDP walks the module
tree depth first: with ``recurse=True`` it answers "look inside m?", with ``recurse=False`` (after m's
children were visited) "make m a unit of its own?". ``nonwrapped_numel`` counts m's parameters not yet
claimed by a unit below it. Bind the keyword arguments with ``functools.partial``, as with torch:

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    model = shardkit.FullyShardedDataParallel(model, auto_wrap_policy=policy)

A set (or list) of module classes is accepted as ``auto_wrap_policy`` too, meaning
``transformer_auto_wrap_policy`` over those classes (torch's ``ModuleWrapPolicy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from torch import nn

from . import _torch_compat

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "size_based_auto_wrap_policy",
           "transformer_auto_wrap_policy", "as_policy"]

# Containers that hold other modules but compute nothing: size_based_auto_wrap_policy never wraps them
# (a ModuleList unit would gather at the first child's forward only: it has no forward of its own).
FORCE_LEAF_MODULES: set[type[nn.Module]] = {nn.MultiheadAttention}
EXCLUDE_WRAP_MODULES: set[type[nn.Module]] = {nn.ModuleList, nn.ModuleDict}


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """Every module with parameters of its own becomes a unit."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wraps the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Wraps every instance of ``transformer_layer_cls`` (e.g. a transformer block class)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wraps a module once at least ``min_num_params`` of its parameters are not in a unit below it; never
    looks inside ``force_leaf_modules`` and never wraps ``exclude_wrap_modules`` (torch's defaults)."""
    force_leaf = FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    exclude = EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    large = nonwrapped_numel >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(force_leaf))
    return large and not isinstance(module, tuple(exclude))


def as_policy(auto_wrap_policy) -> Callable[..., bool] | None:
    """None, a policy callable, or a set/list/tuple of module classes (-> transformer_auto_wrap_policy)."""
    if auto_wrap_policy is None or callable(auto_wrap_policy):
        return auto_wrap_policy
    if isinstance(auto_wrap_policy, (set, frozenset, list, tuple)) and all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in auto_wrap_policy):
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(auto_wrap_policy))
    raise TypeError("auto_wrap_policy must be a callable policy(module, recurse, nonwrapped_numel) or a set of "
                    f"nn.Module classes, got {auto_wrap_policy!r}")


# --- applying a policy (used by shardkit.FullyShardedDataParallel) -------------------------------------
def choose_units(root: nn.Module, policy, ignored: set[int]) -> list[tuple[str, nn.Module]]:
    """Units as (path, module), root first then in pre-order: FSDP1's recursive wrapping (torch's
    ``_recursive_wrap``: a module's nonwrapped numel counts its distinct, non-ignored parameters minus those
    of the units chosen below it). A chosen module that ends up owning no parameter (assign_parameters) is
    no unit."""
    chosen: list[tuple[str, nn.Module]] = []
    ignored_params = {id(p) for m in root.modules() if id(m) in ignored for p in m.parameters()}

    def visit(path: str, module: nn.Module) -> int:
        """Returns the parameter elements of `module` that are in units (torch's "wrapped numel")."""
        nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
            return 0
        mark = len(chosen)
        wrapped = sum(visit(f"{path}.{name}" if path else name, child)
                      for name, child in module.named_children() if id(child) not in ignored)
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped):
            chosen.insert(mark, (path, module))
            return nonwrapped
        return wrapped

    if policy is None:
        return [("", root)]
    visit("", root)
    units = [("", root)] + chosen
    owners = assign_parameters(root, units, ignored_params)
    return [(path, m) for path, m in units if path == "" or owners[path]]


def assign_parameters(root: nn.Module, units: list[tuple[str, nn.Module]],
                      ignored: set[int]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Each parameter to the closest unit enclosing every module that registers it, in registration order."""
    unit_paths = {name for name, _ in units}
    enclosing: dict[int, list[str]] = {}  # id(param) -> innermost unit of each registering module
    for path, sub in root.named_modules(remove_duplicate=False):
        for p in _torch_compat.registered_parameters(sub).values():
            if p is None or id(p) in ignored:
                continue
            parts = path.split(".") if path else []
            innermost = next(".".join(parts[:cut]) for cut in range(len(parts), -1, -1)
                             if ".".join(parts[:cut]) in unit_paths)
            enclosing.setdefault(id(p), []).append(innermost)

    def enclosing_units(unit: str) -> list[str]:  # the unit and every unit above it, innermost first
        parts = unit.split(".") if unit else []
        return [p for p in (".".join(parts[:cut]) for cut in range(len(parts), -1, -1)) if p in unit_paths]

    owners: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in units}
    for fqn, p in root.named_parameters():
        if id(p) in ignored:
            continue
        common, *others = enclosing[id(p)]
        for other in others:
            above_other = set(enclosing_units(other))
            common = next(u for u in enclosing_units(common) if u in above_other)
        owners[common].append((fqn, p))
    return owners

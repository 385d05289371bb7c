"""What a front implements so that its state dicts are chosen and built without this package naming it.

shardkit's fronts choose their state dicts as torch FSDP1 does: inside
``FullyShardedDataParallel.state_dict_type(module, StateDictType.X, config)`` (``state_dict_type`` here), every
shardkit model front in ``module`` -- the FSDP1 front's roots and DistributedDataParallel -- gives the full or
sharded state dict it names, and ``FullyShardedDataParallel.optim_state_dict(model, optim)`` /
``optim_state_dict_to_load`` (``optim_state_dict`` here) give the name-keyed optimizer state dict of whichever
front holds the optimizer state. shardkit.state_dict reaches them the same way. So that neither the FSDP1 class nor
this package imports the other fronts, each front implements one of two protocols:

- ``ModelFront``: a model whose ``state_dict()`` / ``load_state_dict()`` follow its ``state_dict_setting`` (set
  by ``state_dict_type``; None: nn.Module's own), and which builds the name-keyed state dict of a plain optimizer
  over its parameters;
- ``OptimizerFront``: an optimizer that builds its own name-keyed state dict over any model (ZeRO: its
  partition's pieces), following that model's ``state_dict_setting`` where it has one.

A front is recognised by its class (``implements``), never by looking an attribute up on the instance: a wrapper
that forwards unknown attributes to the module it holds (torch.compile's OptimizedModule, the FSDP1 front itself)
is not taken for the module it holds.

Each front's adapter, the code that reads its own layout into the vocabulary of _sharded_state.py (ShardedSpace,
Place, Slot, PieceTensor), lives with the front: fsdp/_state_dict.py, shardkit/_zero_state_dict.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["FullStateDictConfig", "ModelFront", "OptimizerFront", "ShardedStateDictConfig", "StateDictFunctions",
           "StateDictSetting", "StateDictType", "implements", "optim_state_dict", "optim_state_dict_to_load",
           "state_dict_functions", "state_dict_type", "use_state_dict_functions"]


class StateDictType(enum.Enum):
    FULL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclasses.dataclass
class FullStateDictConfig:
    offload_to_cpu: bool = False  # values on the CPU
    rank0_only: bool = False  # only rank 0 of the group returns the values; the others return {}


@dataclasses.dataclass
class ShardedStateDictConfig:
    offload_to_cpu: bool = False


@dataclasses.dataclass(frozen=True)
class StateDictSetting:
    """What ``state_dict_type`` chose for a model front: the kind of state dict and its config."""

    kind: StateDictType
    config: FullStateDictConfig | ShardedStateDictConfig

    @property
    def sharded(self) -> bool:
        return self.kind == StateDictType.SHARDED_STATE_DICT

    @property
    def rank0_only(self) -> bool:
        return getattr(self.config, "rank0_only", False)


class ModelFront(Protocol):
    """A shardkit model wrapper whose state dicts ``state_dict_type`` chooses (the FSDP1 front, DDP)."""

    state_dict_setting: StateDictSetting | None  # None: nn.Module's own state dicts

    def name_keyed_optim_state_dict(self, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """The name-keyed state dict of ``optim``, a torch optimizer over this model's parameters (full or
        sharded as ``state_dict_setting`` says)."""
        ...

    def name_keyed_optim_state_dict_to_load(self, optim: torch.optim.Optimizer,
                                            optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        """A name-keyed optimizer state dict of any world size, in ``optim``'s own format."""
        ...


class OptimizerFront(Protocol):
    """A shardkit optimizer that keeps its own state's layout (ZeroRedundancyOptimizer), over any model."""

    def name_keyed_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Its name-keyed state dict, names from ``model``; full or sharded as the model's
        ``state_dict_setting`` says (full for a model without one)."""
        ...

    def name_keyed_state_dict_to_load(self, model: nn.Module, optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        """A name-keyed optimizer state dict of any world size, as its own ``load_state_dict`` takes it."""
        ...


def _methods(protocol: type) -> tuple[str, ...]:
    return tuple(name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_"))


def implements(obj: Any, protocol: type) -> bool:
    """Whether ``obj``'s class defines every method of ``protocol`` (read from the class: see the module
    docstring)."""
    return all(callable(getattr(type(obj), name, None)) for name in _methods(protocol))


@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                    state_dict_config: FullStateDictConfig | ShardedStateDictConfig | None = None) -> Iterator[None]:
    """Inside it, every model front in ``module`` uses ``state_dict_type`` (with ``state_dict_config``, by
    default the kind's own default config); on leaving, each gets its previous setting back."""
    config = state_dict_config or (FullStateDictConfig() if state_dict_type == StateDictType.FULL_STATE_DICT
                                   else ShardedStateDictConfig())
    expected = FullStateDictConfig if state_dict_type == StateDictType.FULL_STATE_DICT else ShardedStateDictConfig
    if not isinstance(config, expected):
        raise TypeError(f"state_dict_type {state_dict_type.name} takes a {expected.__name__}, got {config!r}")
    roots: list[ModelFront] = [m for m in module.modules() if implements(m, ModelFront)]  # type: ignore[misc]
    if not roots:
        raise ValueError(f"state_dict_type: {type(module).__name__} holds no shardkit FullyShardedDataParallel or "
                         "DistributedDataParallel")
    previous = [root.state_dict_setting for root in roots]
    for root in roots:
        root.state_dict_setting = StateDictSetting(state_dict_type, config)
    try:
        yield
    finally:
        for root, setting in zip(roots, previous):
            root.state_dict_setting = setting


def _refuse(model: nn.Module, call: str) -> TypeError:
    return TypeError(f"{call}: model must be a shardkit FullyShardedDataParallel or DistributedDataParallel (or the "
                     f"optimizer a shardkit ZeroRedundancyOptimizer), got {type(model).__name__}")


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, call: str) -> dict[str, Any]:
    """The name-keyed state dict of ``optim`` over ``model``: the optimizer front's own where ``optim`` is one,
    else the model front's. ``call`` names the public call in errors."""
    if implements(optim, OptimizerFront):
        return optim.name_keyed_state_dict(model)  # type: ignore[attr-defined]
    if implements(model, ModelFront):
        return model.name_keyed_optim_state_dict(optim)  # type: ignore[operator]
    raise _refuse(model, call)


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                             call: str) -> dict[str, Any]:
    """A name-keyed optimizer state dict (any world size, any front's) as ``optim.load_state_dict`` takes it."""
    if implements(optim, OptimizerFront):
        return optim.name_keyed_state_dict_to_load(model, optim_state_dict)  # type: ignore[attr-defined]
    if implements(model, ModelFront):
        return model.name_keyed_optim_state_dict_to_load(optim, optim_state_dict)  # type: ignore[operator]
    raise _refuse(model, call)


# --- the Checkpointer's state-dict functions -------------------------------------------------------------------
# checkpoint/_checkpointer.py saves and loads models and optimizers of every front through shardkit.state_dict's
# functions, which it cannot import (this package imports no front, and shardkit.state_dict imports them all).
# shardkit.state_dict hands them over here as it is imported (``import shardkit`` imports it); the hand-over lives in
# this module, not in _checkpointer, so that it loads no part of torch.distributed.checkpoint.
@dataclasses.dataclass(frozen=True)
class StateDictFunctions:
    """shardkit.state_dict's get/set functions for models and optimizers of every front."""
    get_model: Callable[[nn.Module], dict[str, Any]]
    get_optimizer: Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]]
    set_model: Callable[[nn.Module, dict[str, Any]], Any]
    set_optimizer: Callable[[nn.Module, torch.optim.Optimizer, dict[str, Any]], Any]


_FUNCTIONS: list[StateDictFunctions] = []


def use_state_dict_functions(functions: StateDictFunctions) -> None:
    """Called by shardkit.state_dict as it is imported."""
    _FUNCTIONS[:] = [functions]


def state_dict_functions() -> StateDictFunctions:
    """The functions shardkit.state_dict handed over; raises where it was not imported."""
    if not _FUNCTIONS:
        raise RuntimeError("shardkit Checkpointer: shardkit.state_dict was not imported (import shardkit)")
    return _FUNCTIONS[0]

"""``torch.distributed.checkpoint.state_dict``'s functions, for shardkit models: ``get_state_dict``,
``set_state_dict`` and their model / optimizer halves, same names, signatures and ``StateDictOptions``.

torch's own functions recognise torch's wrappers only (FSDP1/2, DDP, TP): on any other module they call
``model.state_dict()`` and ``optimizer.state_dict()`` and rename parameters by identity, which would gather a
shardkit FSDP model in full and give its optimizer state in piece shapes. These choose shardkit's state dicts
instead, through the protocol every shardkit front implements (checkpoint/_front_protocol.py; the adapters:
fsdp/_state_dict.py, _zero_state_dict.py):

- models: a shardkit ``FullyShardedDataParallel`` or ``DistributedDataParallel`` (any zero_stage), canonical
  names (the unwrapped model's: no ``module.`` prefix), so a checkpoint from one loads into the other;
- optimizers: the optimizer over a shardkit FSDP model, a ``ZeroRedundancyOptimizer``, or a torch optimizer over
  a shardkit DDP model; state keyed by parameter names.
- ``full_state_dict=False`` (the default): sharded, for ``torch.distributed.checkpoint.save/load``, at any world
  size; ``True``: every value whole (with ``cpu_offload=True`` on rank 0 only, the others get ``{}``, as torch).
  ``cpu_offload`` moves the values to the CPU; ``strict`` and ``ignore_frozen_params`` as torch's.

Any other model is handed to torch's function of the same name. Options shardkit does not implement
(``broadcast_from_rank0``, ``flatten_optimizer_state_dict``, ``submodules``) raise NotImplementedError naming
themselves; one optimizer per call (a list of one is fine).

``set_state_dict`` must run on every rank (loading a sharded model state into a DDP all-gathers the pieces).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _torch_compat
from . import _zero_state_dict as zero_state_dict
from .checkpoint import _front_protocol as front_protocol
from .checkpoint._front_protocol import (
    FullStateDictConfig,
    ModelFront,
    ShardedStateDictConfig,
    StateDictFunctions,
    StateDictSetting,
    StateDictType,
    implements,
)
from .checkpoint._optim_state import parameter_names
from .ddp import DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

# torch.distributed.checkpoint.state_dict (and with it DCP, DTensor and FSDP2) loads at the first call of a function
# here, not when shardkit is imported: a DDP job never needs it (docs/design.md, "Python").

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]

_OptimArg = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def __getattr__(name: str) -> Any:
    if name == "StateDictOptions":  # torch's own class, re-exported (PEP 562: loaded at first use)
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_sd() -> Any:
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _ours(model: nn.Module) -> bool:
    """A shardkit model front: its FSDP1 front or DistributedDataParallel."""
    return implements(model, ModelFront)


def _options(options: StateDictOptions | None, submodules: Any, call: str) -> StateDictOptions:
    if options is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        options = StateDictOptions()
    refused = [name for name, on in (("submodules", submodules is not None),
                                     ("broadcast_from_rank0", options.broadcast_from_rank0),
                                     ("flatten_optimizer_state_dict", options.flatten_optimizer_state_dict)) if on]
    if refused:
        raise NotImplementedError(f"shardkit.state_dict.{call}: {', '.join(refused)} is not supported for shardkit "
                                  "models")
    return options


def _one(optimizers: _OptimArg, call: str) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise NotImplementedError(f"shardkit.state_dict.{call}: one optimizer per call on shardkit models, got "
                                  f"{len(optimizers)}")
    return optimizers[0]


@contextlib.contextmanager
def _kind(model: nn.Module, options: StateDictOptions) -> Iterator[StateDictSetting]:
    if options.full_state_dict:
        kind = StateDictType.FULL_STATE_DICT
        config: Any = FullStateDictConfig(offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload)
    else:
        kind, config = StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=options.cpu_offload)
    with front_protocol.state_dict_type(model, kind, config):
        yield StateDictSetting(kind, config)


def _frozen_names(model: nn.Module) -> set[str]:
    names = parameter_names(model)
    return {names[id(p)] for p in model.parameters() if not p.requires_grad}


def get_model_state_dict(model: nn.Module, *, submodules: Any = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    if not _ours(model):
        return _torch_sd().get_model_state_dict(model, submodules=submodules, options=options)
    options = _options(options, submodules, "get_model_state_dict")
    with _kind(model, options) as setting:
        if isinstance(model, DistributedDataParallel):  # canonical names: without its ``module.``
            state = zero_state_dict.model_state_dict(model, setting, "", module_prefix="")
        else:
            state = model.state_dict()
    if options.ignore_frozen_params:
        for name in _frozen_names(model):
            state.pop(name, None)
    return state


def get_optimizer_state_dict(model: nn.Module, optimizers: _OptimArg, *, submodules: Any = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    if not _ours(model):
        return _torch_sd().get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options)
    options = _options(options, submodules, "get_optimizer_state_dict")
    optim = _one(optimizers, "get_optimizer_state_dict")
    with _kind(model, options):
        state = front_protocol.optim_state_dict(model, optim, "shardkit.state_dict.get_optimizer_state_dict")
    if options.ignore_frozen_params and state:
        for name in _frozen_names(model):
            state["state"].pop(name, None)
    return state


def get_state_dict(model: nn.Module, optimizers: _OptimArg, *, submodules: Any = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict); see the module docstring."""
    if not _ours(model):
        return _torch_sd().get_state_dict(model, optimizers, submodules=submodules, options=options)
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _torch_compat.IncompatibleKeys:
    if not _ours(model):
        return _torch_sd().set_model_state_dict(model, model_state_dict, options=options)
    options = _options(options, None, "set_model_state_dict")
    strict = options.strict and not options.ignore_frozen_params
    with _kind(model, options) as setting:
        if isinstance(model, DistributedDataParallel):  # canonical names: without its ``module.``
            result = zero_state_dict.load_model_state_dict(model, setting, model_state_dict, strict, module_prefix="")
        else:
            result = model.load_state_dict(model_state_dict, strict=strict)
    if options.strict and options.ignore_frozen_params:
        frozen = _frozen_names(model)
        missing = [k for k in result.missing_keys if k not in frozen]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"shardkit.state_dict.set_model_state_dict: missing keys {missing}, unexpected keys "
                               f"{result.unexpected_keys}")
    return result


def set_optimizer_state_dict(model: nn.Module, optimizers: _OptimArg, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    if not _ours(model):
        return _torch_sd().set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    options = _options(options, None, "set_optimizer_state_dict")
    optim = _one(optimizers, "set_optimizer_state_dict")
    with _kind(model, options):
        optim.load_state_dict(front_protocol.optim_state_dict_to_load(
            model, optim, optim_state_dict, "shardkit.state_dict.set_optimizer_state_dict"))
    return None


def set_state_dict(model: nn.Module, optimizers: _OptimArg, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any],
                   options: StateDictOptions | None = None) -> _torch_compat.IncompatibleKeys:
    """Loads both; see the module docstring. Call on every rank."""
    if not _ours(model):
        return _torch_sd().set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                        optim_state_dict=optim_state_dict, options=options)
    result = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return result


# The checkpoint package's Checkpointer saves and loads models and optimizers through these (it imports no front).
front_protocol.use_state_dict_functions(StateDictFunctions(
    get_model=get_model_state_dict, get_optimizer=get_optimizer_state_dict, set_model=set_model_state_dict,
    set_optimizer=set_optimizer_state_dict))

"""State dicts of shardkit.FullyShardedDataParallel: FSDP1's StateDictType, full and sharded, of the model and
of an optimizer over it. The FSDP1 front's adapter to shardkit.checkpoint: it reads the front's units and flat
parameters into checkpoint's vocabulary (ShardedSpace, Place, Slot: checkpoint/_sharded_state.py), and
checkpoint, which imports no front, builds the state dicts from that.

``FullyShardedDataParallel.state_dict_type(model, StateDictType.X, config)`` picks what ``model.state_dict()``
returns and ``model.load_state_dict()`` takes, as in torch FSDP1:

- FULL_STATE_DICT (the default): the unwrapped model's keys, shapes and values. Gathered one flat parameter at
  a time; with ``FullStateDictConfig(rank0_only=True)`` the other ranks return ``{}`` and never hold more than
  one flat parameter's full values. Every value is a tensor of its own (its storage is exactly its bytes, as
  torch FSDP1's clones): neither a view of a gathered flat buffer nor an alias of a live parameter or buffer, so
  it stays as it was whatever the model does next (a step, a reshard), and torch.save writes only its bytes.
  Loading takes such a dict (from any world size, or from the plain model) on every rank; each rank copies its
  pieces.
- SHARDED_STATE_DICT: no communication. Every parameter is a ``PieceTensor`` (checkpoint/_sharded_state.py):
  this rank's piece, a view of its shard (no copy), which torch.distributed.checkpoint sees as the parameter in
  its own shape of which this rank holds the boxes its piece covers. ``torch.distributed.checkpoint.save/load``
  work on it directly, and the checkpoint is in torch FSDP2's format: it loads at any world size, into this
  front, ZeRO, ``shardkit.fully_shard`` or torch FSDP2, and theirs load here (DCP reads, for each rank, the boxes
  its pieces need). Loading through DCP writes straight into the shards; ``load_state_dict`` then only checks.

Buffers are plain tensors in both (every rank holds them whole: DCP saves them once).

The optimizer (``optim_state_dict`` / ``optim_state_dict_to_load``): an optimizer over this front's model holds,
per parameter, state for this rank's piece only; its name-keyed state dict (checkpoint/_optim_state.py), under
the model's state_dict_type, holds PieceTensors of the pieces (SHARDED_STATE_DICT) or every state tensor
gathered into its parameter's own shape (FULL_STATE_DICT: one all-gather per flat parameter and state key).
Loading takes one of any world size, strategy or ZeRO stage, and cuts this rank's piece of every value."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import _torch_compat
from ..checkpoint._front_protocol import FullStateDictConfig, ShardedStateDictConfig
from ..checkpoint._optim_state import state_dict_of, state_dict_to_load
from ..checkpoint._sharded_state import Place, ShardedSpace, load_entries, owned_copy, sharded_entries

if TYPE_CHECKING:
    from ._fsdp1 import FullyShardedDataParallel
    from ._fsdp1_units import FlatGroup


def spaces(model: FullyShardedDataParallel) -> list[tuple[FlatGroup, ShardedSpace]]:
    """Every flat parameter of the model, in unit order (the same on every rank), as a checkpoint sees it."""
    return [(g, ShardedSpace(g.handle.layout, g.names, g.shapes, model._shard_group))
            for u in model._units for g in u.groups]


def _places(model: FullyShardedDataParallel) -> dict[int, Place]:
    """id(parameter) -> its place: this rank's piece is the parameter itself (a 1-D view of the shard)."""
    return {id(p): Place(space, i, p.detach().reshape(-1))
            for g, space in spaces(model) for i, p in enumerate(g.params)}


def _keys_of(model: FullyShardedDataParallel, prefix: str) -> dict[str, Any]:
    """The unwrapped module's state-dict entries (parameters as the live sharded Parameters), in its order."""
    return model._fsdp_wrapped_module.state_dict(prefix=prefix, keep_vars=True)


def _where(model: FullyShardedDataParallel, call: str) -> str:
    return f"shardkit FSDP (rank {dist.get_rank(model.process_group)}) {call}"


def full_state_dict(model: FullyShardedDataParallel, config: FullStateDictConfig, prefix: str) -> dict[str, Any]:
    """Gathered one flat parameter at a time; ranks that keep nothing (rank0_only) drop each at once."""
    model._end_iteration()
    keep = not config.rank0_only or dist.get_rank(model.process_group) == 0
    gathered: dict[int, torch.Tensor] = {}
    for g, _ in spaces(model):  # every rank gathers every group, in the same order
        values = g.handle.gather_full_precision()  # views of one flat buffer per group
        if keep:
            for p, value in zip(g.params, values):
                gathered[id(p)] = owned_copy(value, config.offload_to_cpu)
        del values  # before the next gather allocates: a rank that keeps nothing holds one unit at a time
    if not keep:
        return OrderedDict()
    out: dict[str, Any] = OrderedDict()  # as torch's: generic code (accelerate) drops tied duplicates only from one
    for key, value in _keys_of(model, prefix).items():
        if isinstance(value, torch.Tensor) and id(value) in gathered:
            out[key] = gathered[id(value)]
        elif isinstance(value, torch.Tensor):
            out[key] = owned_copy(value, config.offload_to_cpu)
        else:
            out[key] = value
    return out


def sharded_state_dict(model: FullyShardedDataParallel, config: ShardedStateDictConfig, prefix: str) -> dict[str, Any]:
    model._end_iteration()
    return sharded_entries(_keys_of(model, prefix), _places(model), config.offload_to_cpu)


def load(model: FullyShardedDataParallel, state_dict: Mapping[str, Any],
         strict: bool) -> _torch_compat.IncompatibleKeys:
    """Loads a full or sharded state dict into the shards (the kind of each value decides; no communication, but
    every rank must call it with its own dict). Errors name the parameter and both shapes."""
    model._end_iteration()
    return load_entries(_where(model, "load_state_dict"), _keys_of(model, ""), _places(model), state_dict, strict)


def optim_state_dict(model: FullyShardedDataParallel, optim: torch.optim.Optimizer) -> dict[str, Any]:
    flat = spaces(model)  # at least one (FSDP refuses a module without parameters), not necessarily the root's
    setting = model.state_dict_setting
    return state_dict_of(optim, {id(p): name for name, p in model.named_parameters()},
                         [(g.params, space) for g, space in flat], sharded=setting.sharded,
                         rank0_only=setting.rank0_only, group=model.process_group,
                         device=flat[0][0].handle.shard.device)


def optim_state_dict_to_load(model: FullyShardedDataParallel, optim: torch.optim.Optimizer,
                             optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    return state_dict_to_load(f"shardkit FSDP (rank {dist.get_rank(model.process_group)}) optim_state_dict_to_load",
                              optim, {id(p): name for name, p in model.named_parameters()},
                              [(g.params, space) for g, space in spaces(model)], optim_state_dict)

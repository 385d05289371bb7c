"""Model state dicts of shardkit.FullyShardedDataParallel: FSDP1's StateDictType, full and sharded.

``FullyShardedDataParallel.state_dict_type(model, StateDictType.X, config)`` picks what ``model.state_dict()``
returns and ``model.load_state_dict()`` takes, as in torch FSDP1:

- FULL_STATE_DICT (the default): the unwrapped model's keys, shapes and values. Gathered one flat parameter at
  a time; with ``FullStateDictConfig(rank0_only=True)`` the other ranks return ``{}`` and never hold more than
  one flat parameter's full values. Loading takes such a dict (from any world size, or from the plain model)
  on every rank; each rank copies its pieces.
- SHARDED_STATE_DICT: no communication. Every parameter is a ``ShardedTensor`` over the flattened parameter
  (global size ``(numel,)``): this rank's piece, a view of its shard (no copy), plus every rank's piece as
  metadata (a pure function of the layout). ``torch.distributed.checkpoint.save/load`` work on it directly, and
  a checkpoint saved at one world size loads at any other: DCP reads, for each rank, the ranges its pieces
  need. Loading through DCP writes straight into the shards; ``load_state_dict`` then only checks. The
  original shapes are recorded under ``"_shardkit.shapes"`` (JSON), for consumers without the model
  (``python -m shardkit checkpoint consolidate``).

Buffers are plain tensors in both (every rank holds them whole: DCP saves them once).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

if TYPE_CHECKING:
    from .fsdp import FullyShardedDataParallel, _FlatGroup

__all__ = ["FullStateDictConfig", "ShardedStateDictConfig", "StateDictType"]


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


def _managed(model: "FullyShardedDataParallel") -> dict[int, tuple["_FlatGroup", int]]:
    """id(parameter) -> (its flat group, its index in the group)."""
    return {id(p): (g, i) for u in model._units for g in u.groups for i, p in enumerate(g.params)}


def _keys_of(model: "FullyShardedDataParallel", prefix: str) -> dict[str, Any]:
    """The unwrapped module's state-dict entries (parameters as the live sharded Parameters), in its order."""
    return model._fsdp_wrapped_module.state_dict(prefix=prefix, keep_vars=True)


def full_state_dict(model: "FullyShardedDataParallel", config: FullStateDictConfig, prefix: str) -> dict[str, Any]:
    model._end_iteration()
    entries = _keys_of(model, prefix)
    managed = _managed(model)
    keep = not config.rank0_only or dist.get_rank(model.process_group) == 0
    gathered: dict[int, torch.Tensor] = {}
    for u in model._units:
        for g in u.groups:  # every rank gathers every group, in the same order
            values = g.handle.gather_full_precision()
            if keep:
                for p, value in zip(g.params, values):
                    gathered[id(p)] = value.cpu() if config.offload_to_cpu else value
    if not keep:
        return {}
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if isinstance(value, torch.Tensor) and id(value) in managed:
            out[key] = gathered[id(value)]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu() if config.offload_to_cpu else value.detach()
        else:
            out[key] = value
    return out


# The sharded state dict's record of each parameter's own shape (its tensors are flattened), a JSON string
# that torch.distributed.checkpoint saves like any object: what a consumer without the model (the
# `python -m shardkit checkpoint` tools) reshapes with. load_state_dict ignores it.
SHAPES_KEY = "_shardkit.shapes"


def sharded_state_dict(model: "FullyShardedDataParallel", config: ShardedStateDictConfig, prefix: str) -> dict[str, Any]:
    model._end_iteration()
    managed = _managed(model)
    out: dict[str, Any] = {}
    shapes: dict[str, list[int]] = {}
    for key, value in _keys_of(model, prefix).items():
        if isinstance(value, torch.Tensor) and id(value) in managed:
            group, index = managed[id(value)]
            shapes[key] = list(group.shapes[index])
            out[key] = _sharded_tensor(model, group, index, value, config.offload_to_cpu)
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu() if config.offload_to_cpu else value.detach()
        else:
            out[key] = value
    out[prefix + SHAPES_KEY] = json.dumps(shapes)
    return out


def _sharded_tensor(model: "FullyShardedDataParallel", group: "_FlatGroup", index: int, param: torch.Tensor,
                    offload_to_cpu: bool) -> ShardedTensor | torch.Tensor:
    local = param.detach().reshape(-1)  # this rank's piece: a view of the shard
    if offload_to_cpu:
        local = local.cpu()
    shard_group = model._shard_group
    if shard_group is None:  # NO_SHARD (or one rank): the whole parameter, the same on every rank
        return local
    layout = group.handle.layout
    numel = layout.numels[index]
    device = local.device
    if numel == 0:
        return local
    # Every rank gets a shard, an empty one where it holds no piece: torch's ShardedTensor answers `.device`
    # on a rank without local shards with torch.cuda.current_device() unless the group is gloo's. Empty
    # shards sit at the end (offset numel), where no real one starts: DCP deduplicates chunks by offset.
    pieces = [layout.piece(index, r) for r in range(layout.world)]
    # Placements name global ranks (a HYBRID_SHARD shard group is a subgroup).
    metadata = [ShardMetadata(shard_offsets=[piece.param_begin if piece.numel else numel], shard_sizes=[piece.numel],
                              placement=f"rank:{dist.get_global_rank(shard_group, r)}/{device}")
                for r, piece in enumerate(pieces)]
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    rank = dist.get_rank(shard_group)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(local, metadata[rank])], ShardedTensorMetadata(metadata, torch.Size([numel]), properties),
        process_group=shard_group)


def load(model: "FullyShardedDataParallel", state_dict: dict[str, Any], strict: bool) -> nn.modules.module._IncompatibleKeys:
    """Loads a full or sharded state dict into the shards (the kind of each value decides; a collective only in
    that every rank must call it with its own dict). Errors name the parameter and both shapes."""
    model._end_iteration()
    managed = _managed(model)
    entries = _keys_of(model, "")
    rank = dist.get_rank(model.process_group)
    missing = [k for k in entries if k not in state_dict]
    unexpected = [k for k in state_dict if k not in entries and k != SHAPES_KEY]
    if strict and (missing or unexpected):
        raise RuntimeError(f"shardkit FSDP (rank {rank}) load_state_dict: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    with torch.no_grad():
        for key, target in entries.items():
            if key not in state_dict or not isinstance(target, torch.Tensor):
                continue
            value = state_dict[key]
            if id(target) not in managed:  # a buffer (or an ignored module's parameter)
                _check_shape(rank, key, value.shape, target.shape)
                target.copy_(value)
                continue
            group, index = managed[id(target)]
            full_shape = torch.Size(group.handle.layout.numels[index:index + 1])
            if isinstance(value, ShardedTensor):
                _check_shape(rank, key, value.size(), full_shape, flattened=True)
                local = target.reshape(-1)
                for shard in value.local_shards():
                    if shard.tensor.data_ptr() != local.data_ptr() or shard.tensor.numel() != local.numel():
                        local.copy_(shard.tensor.reshape(-1))
            else:  # a whole parameter: its own shape (a full state dict) or flattened (NO_SHARD's sharded one)
                if torch.Size(value.shape) != full_shape:
                    _check_shape(rank, key, value.shape, group.shapes[index])
                piece = group.handle.layout.piece(index, _shard_rank(model))
                flat = value.reshape(-1)
                target.copy_(flat[piece.param_begin:piece.param_begin + piece.numel].view(target.shape))
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _shard_rank(model: "FullyShardedDataParallel") -> int:
    return dist.get_rank(model._shard_group) if model._shard_group is not None else 0


def _check_shape(rank: int, key: str, got: torch.Size, want: torch.Size, flattened: bool = False) -> None:
    if torch.Size(got) != torch.Size(want):
        what = "flattened shape" if flattened else "shape"
        raise RuntimeError(f"shardkit FSDP (rank {rank}) load_state_dict: parameter {key!r} has {what} "
                           f"{list(got)} in the checkpoint but {list(want)} in the model")

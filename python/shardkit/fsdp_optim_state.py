"""Optimizer state dicts of shardkit.FullyShardedDataParallel, keyed by parameter names (FSDP1's
``optim_state_dict`` / ``optim_state_dict_to_load``).

An optimizer over a shardkit FSDP model holds, per parameter, state for this rank's piece only (exp_avg and
exp_avg_sq of AdamW have the piece's 1-D shape; ``step`` is a scalar). Under the model's state_dict_type:

- SHARDED_STATE_DICT: each piece-shaped state tensor becomes a ShardedTensor over the flattened parameter with
  the parameter's own metadata (see fsdp_state_dict), so torch.distributed.checkpoint saves it without
  communication and loads it at any world size; scalars stay as they are.
- FULL_STATE_DICT: each state tensor is gathered (one all-gather per flat parameter and state key) into the
  parameter's own shape, as the unsharded optimizer would hold it.

Both are ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``. Loading goes through
``optim_state_dict_to_load(model, optim, state)`` → ``optim.load_state_dict(...)``, which takes this rank's
piece of every value, whatever world size or strategy saved it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from . import _exchange
from .fsdp_state_dict import StateDictType, _managed, _shard_rank, _sharded_tensor

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from .fsdp import FullyShardedDataParallel



def _names(model: "FullyShardedDataParallel") -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _init_state(model: "FullyShardedDataParallel", optim: "Optimizer") -> None:
    """An optimizer that has not stepped holds no state tensors for a checkpoint to be loaded into: one step
    with zero gradients and a zero learning rate creates them without changing a parameter (as torch's
    torch.distributed.checkpoint.state_dict does)."""
    if optim.state:
        return
    saved = []
    for group in optim.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optim.step()
    for group, lr in zip(optim.param_groups, saved):
        group["lr"] = lr
    optim.zero_grad(set_to_none=True)


def optim_state_dict(model: "FullyShardedDataParallel", optim: "Optimizer") -> dict[str, Any]:
    _init_state(model, optim)
    names, managed = _names(model), _managed(model)
    sharded = model._state_dict_type == StateDictType.SHARDED_STATE_DICT
    rank0_only = not sharded and getattr(model._state_dict_config, "rank0_only", False)
    state: dict[str, dict[str, Any]] = {}
    full = {} if sharded else _gather_state(model, optim, managed)
    for group in optim.param_groups:
        for p in group["params"]:
            if p not in optim.state:
                continue
            name = names[id(p)]
            where = managed.get(id(p))
            entry = {}
            for key, value in optim.state[p].items():
                piece_shaped = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape
                if where is None or not piece_shaped:
                    entry[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
                elif sharded:
                    entry[key] = _sharded_tensor(model, where[0], where[1], value, offload_to_cpu=False)
                else:
                    entry[key] = full[(id(p), key)]
            state[name] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optim.param_groups]
    if rank0_only and dist.get_rank(model.process_group) != 0:
        return {}
    return {"state": state, "param_groups": groups}


def _gather_state(model: "FullyShardedDataParallel", optim: "Optimizer", managed) -> dict[tuple[int, str], torch.Tensor]:
    """Every piece-shaped state tensor gathered into its parameter's own shape: per flat parameter and state
    key, this rank's pieces are packed into an S-element buffer at their shard offsets and all-gathered."""
    gathered: dict[tuple[int, str], torch.Tensor] = {}
    for unit in model._units:
        for group in unit.groups:
            layout = group.handle.layout
            shard_rank = _shard_rank(model)
            keys = sorted({k for p in group.params if p in optim.state for k, v in optim.state[p].items()
                           if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape})
            for key in keys:  # every rank holds the same keys (the same optimizer over the same parameters)
                dtype = next(optim.state[p][key].dtype for p in group.params if p in optim.state)
                mine = torch.zeros(layout.shard_numel, dtype=dtype, device=group.handle.shard.device)
                for index, p in enumerate(group.params):
                    piece = layout.piece(index, shard_rank)
                    if piece.numel and p in optim.state:
                        mine[piece.shard_begin:piece.shard_begin + piece.numel] = optim.state[p][key].reshape(-1)
                if model._shard_group is None:
                    whole = mine
                else:
                    whole = torch.empty(layout.padded_numel, dtype=dtype, device=mine.device)
                    _exchange.all_gather_single(whole, mine, group=model._shard_group)
                for index, p in enumerate(group.params):
                    offset, numel = layout.offsets[index], layout.numels[index]
                    gathered[(id(p), key)] = whole[offset:offset + numel].view(group.shapes[index]).clone()
    return gathered


def optim_state_dict_to_load(model: "FullyShardedDataParallel", optim: "Optimizer",
                             optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (full or sharded, any world size) in this rank's optimizer's own
    format: state by parameter index, each piece-shaped value cut to this rank's piece."""
    names, managed = _names(model), _managed(model)
    rank = dist.get_rank(model.process_group)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    saved_groups = optim_state_dict["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"shardkit FSDP (rank {rank}) optim_state_dict_to_load: the checkpoint has "
                         f"{len(saved_groups)} parameter groups, the optimizer {len(optim.param_groups)}")
    for saved_group, group in zip(saved_groups, optim.param_groups):
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            saved = optim_state_dict["state"].get(name)
            if saved is not None:
                state[index] = {key: _local_piece(model, managed.get(id(p)), p, name, key, value, rank)
                                for key, value in saved.items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _local_piece(model, where, p: torch.Tensor, name: str, key: str, value: Any, rank: int) -> Any:
    if isinstance(value, ShardedTensor):
        return value.local_shards()[0].tensor.detach().clone().view(p.shape) if value.local_shards() else value
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or where is None:
        return value
    group, index = where
    numel = group.handle.layout.numels[index]
    if value.numel() != numel:
        raise RuntimeError(f"shardkit FSDP (rank {rank}) optim_state_dict_to_load: state {key!r} of parameter "
                           f"{name!r} has shape {list(value.shape)} in the checkpoint but the parameter has "
                           f"{list(group.shapes[index])}")
    piece = group.handle.layout.piece(index, _shard_rank(model))
    return value.detach().reshape(-1)[piece.param_begin:piece.param_begin + piece.numel].clone().view(p.shape)

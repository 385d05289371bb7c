"""Name-keyed state dicts of a torch optimizer over named parameters, some of them in flat layouts (FSDP1's
``optim_state_dict`` / ``optim_state_dict_to_load`` format, which ZeroRedundancyOptimizer's shares).

An optimizer over a flat layout holds, per parameter, state for this rank's piece only (exp_avg and exp_avg_sq
of AdamW have the piece's 1-D shape; ``step`` is a scalar); over a whole parameter, state of the parameter's
shape. Given the parameters' names and, for those in a flat layout, their ``ShardedSpace`` (_sharded_state.py):

- sharded: each piece-shaped state tensor becomes a PieceTensor (the parameter's own shape to DCP, this rank's
  boxes of it), so torch.distributed.checkpoint saves it without communication and loads it at any world size,
  in torch FSDP2's format; scalars stay as they are.
- full: each state tensor is gathered (one all-gather per flat layout and state key) into the parameter's own
  shape, as the unsharded optimizer would hold it.

Both are ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``. ``state_dict_to_load``
takes one of any world size, strategy or ZeRO stage and gives ``optim.load_state_dict`` this rank's piece of
every value. The fronts' adapters (fsdp/_state_dict.py, shardkit/_zero_state_dict.py) say which parameters lie
in which space.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._sharded_state import ShardedSpace, Slot, check_param_groups, init_optimizer_state, local_optim_state
from ._sharded_state import optim_state_dict as name_keyed_state


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the unwrapped model (a shardkit or torch DDP's ``module.`` dropped; shardkit's
    is a torch DDP subclass)."""
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return {id(p): name for name, p in model.named_parameters()}


def _slots(optim: torch.optim.Optimizer, names: dict[int, str], placed: dict[int, tuple[ShardedSpace, int]],
           whole_in_place: bool = False) -> tuple[list[Slot], list[list[str]]]:
    """One slot per parameter of the optimizer (in its order), and the names of each param group's parameters.
    ``placed``: id(parameter) -> (its space, its index) for parameters in a flat layout; the others are whole
    (``whole_in_place``: see Slot.in_place)."""
    slots, group_names = [], []
    for group in optim.param_groups:
        group_names.append([names[id(p)] for p in group["params"]])
        for p in group["params"]:
            space, index = placed.get(id(p), (None, -1))
            slots.append(Slot(names[id(p)], p, space, index, in_place=whole_in_place and space is None))
    return slots, group_names


def state_dict_of(optim: torch.optim.Optimizer, names: dict[int, str], spaces: list[tuple[list, ShardedSpace]], *,
                  sharded: bool, rank0_only: bool, group: dist.ProcessGroup, device: torch.device,
                  whole_in_place: bool = False) -> dict[str, Any]:
    """The name-keyed state dict of a torch optimizer over named parameters, those in ``spaces`` ((parameters,
    space) pairs) holding this rank's pieces, the others whole (a shardkit DDP's with a plain optimizer: no
    spaces, ``whole_in_place``)."""
    init_optimizer_state(optim)
    placed = {id(p): (space, i) for params, space in spaces for i, p in enumerate(params)}
    slots, group_names = _slots(optim, names, placed, whole_in_place)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names_}
              for g, names_ in zip(optim.param_groups, group_names)]
    keep = sharded or not rank0_only or dist.get_rank(group) == 0
    return name_keyed_state(optim, slots, [space for _, space in spaces], groups, sharded=sharded, group=group,
                            device=device, keep=keep)


def state_dict_to_load(where: str, optim: torch.optim.Optimizer, names: dict[int, str],
                       spaces: list[tuple[list, ShardedSpace]], optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (full or sharded, any world size) in ``optim``'s own format: state by
    parameter index, each piece-shaped value cut to this rank's piece."""
    placed = {id(p): (space, i) for params, space in spaces for i, p in enumerate(params)}
    slots, group_names = _slots(optim, names, placed)
    check_param_groups(where, optim_state_dict["param_groups"], group_names)
    state = local_optim_state(where, slots, optim_state_dict)
    groups, index = [], 0
    for saved, names_ in zip(optim_state_dict["param_groups"], group_names):
        groups.append({**{k: v for k, v in saved.items() if k != "params"},
                       "params": list(range(index, index + len(names_)))})
        index += len(names_)
    return {"state": state, "param_groups": groups}

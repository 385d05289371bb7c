"""State dicts of shardkit.DistributedDataParallel (any zero_stage) and shardkit.ZeroRedundancyOptimizer, in
the format of shardkit.FullyShardedDataParallel's (fsdp/_state_dict.py): a checkpoint saved by one loads into the
other, at any world size. The ZeRO fronts' adapter to shardkit.checkpoint: it reads the DDP's ZeRO partition and
the optimizer's spaces and pieces into checkpoint's vocabulary (ShardedSpace, Place, Slot:
checkpoint/_sharded_state.py); ddp.py and zero.py implement checkpoint's front protocol (_front_protocol.py)
with it, so that neither the FSDP1 front nor checkpoint imports them.

Chosen as in FSDP1: ``with FullyShardedDataParallel.state_dict_type(ddp, StateDictType.X, config):`` then
``ddp.state_dict()`` / ``ddp.load_state_dict()`` and ``FullyShardedDataParallel.optim_state_dict(ddp, zero)`` /
``optim_state_dict_to_load(ddp, zero, osd)``. Outside the context a DDP's state dict is nn.Module's (torch DDP's:
keys prefixed ``module.``), and so it stays inside it.

Model, SHARDED_STATE_DICT: every rank holds every parameter, but writes only its own slice of the ZeRO
partition: each trainable parameter is a PieceTensor (checkpoint/_sharded_state.py: the parameter in its own
shape to DCP) of this rank's piece of it (a view: no copy, no communication) -- the partition the DDP owns under
zero_stage 1|2, the same layout computed on the fly under zero_stage 0. DCP then writes every element once,
spread over the ranks. Loading through DCP fills this rank's pieces; ``load_state_dict`` then all-gathers the
pieces into whole parameters (a collective). FULL_STATE_DICT: the module's own state dict (no communication: it
is whole on every rank), honouring ``rank0_only`` and ``offload_to_cpu``, each value a copy of its own (under
zero_stage 1|2 the parameters are views of the DDP's flat buffer, which the next step updates in place).

Optimizer: the name-keyed dict of checkpoint/_sharded_state.py's optim_state_dict over the optimizer's partition
(its pieces are the slots; the names are the model's, without a DDP's ``module.``). ``optim_state_dict_to_load``
returns this rank's pieces' state cut from a dict of any world size, marked so that ``zero.load_state_dict``
takes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import _flat, _torch_compat
from .checkpoint import _optim_state as optim_state
from .checkpoint._front_protocol import StateDictSetting
from .checkpoint._optim_state import parameter_names
from .checkpoint._sharded_state import (
    Place,
    ShardedSpace,
    Slot,
    check_param_groups,
    init_optimizer_state,
    load_entries,
    local_optim_state,
    owned_copy,
    sharded_entries,
)
from .checkpoint._sharded_state import optim_state_dict as name_keyed_state

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel
    from .zero import ZeroRedundancyOptimizer

_PREFIX = "module."  # a DDP's state-dict prefix (nn.Module naming of its `module` attribute)
# Marks a state dict holding this rank's pieces' state already cut (optim_state_dict_to_load), which
# ZeroRedundancyOptimizer.load_state_dict takes as it is.
LOCAL_PIECES_KEY = "shardkit_zero_local_pieces"  # keys of an outer param group that the local optimizer never sees


def _spaces(ddp: DistributedDataParallel) -> list[tuple[_flat.FlatSpace, ShardedSpace]]:
    partition = ddp._zero_partition
    if partition is not None:
        flat = partition.spaces
    else:  # zero_stage 0: the layout a ZeRO partition would have, for spreading the writes
        trainable = [p for p in ddp.module.parameters() if p.requires_grad]
        flat = _flat.flat_spaces(trainable, dist.get_world_size(ddp.process_group))
    names = parameter_names(ddp)
    return [(space, ShardedSpace(space.layout, [names[id(p)] for p in space.params], [p.shape for p in space.params],
                                 ddp.process_group)) for space in flat]


def _places(spaces: list[tuple[_flat.FlatSpace, ShardedSpace]]) -> dict[int, Place]:
    return {id(p): Place(space, i, space.cut(i, p.detach()), p.detach())
            for flat, space in spaces for i, p in enumerate(flat.params)}


def model_state_dict(ddp: DistributedDataParallel, setting: StateDictSetting, prefix: str,
                     module_prefix: str = _PREFIX) -> dict[str, Any]:
    """``module_prefix``: ``module.`` for ``ddp.state_dict()``; "" for shardkit.state_dict's canonical names."""
    entries = ddp.module.state_dict(prefix=prefix + module_prefix, keep_vars=True)
    config = setting.config
    if setting.sharded:
        return sharded_entries(entries, _places(_spaces(ddp)), config.offload_to_cpu)
    if setting.rank0_only and dist.get_rank(ddp.process_group) != 0:
        return {}
    return {key: owned_copy(value, config.offload_to_cpu) if isinstance(value, torch.Tensor) else value
            for key, value in entries.items()}


def load_model_state_dict(ddp: DistributedDataParallel, setting: StateDictSetting, state_dict: dict[str, Any],
                          strict: bool, module_prefix: str = _PREFIX) -> _torch_compat.IncompatibleKeys:
    """A full or sharded state dict of any world size; under SHARDED_STATE_DICT a collective (the pieces loaded
    here are all-gathered into whole parameters)."""
    where = f"shardkit DDP (rank {dist.get_rank(ddp.process_group)}) load_state_dict"
    spaces = _spaces(ddp)
    entries = ddp.module.state_dict(prefix=module_prefix, keep_vars=True)
    result = load_entries(where, entries, _places(spaces), state_dict, strict)
    if setting.sharded:
        _flat.all_gather_parameters([flat for flat, _ in spaces], ddp.process_group)
    return result


# --- ZeroRedundancyOptimizer --------------------------------------------------------------------------------

def _slots(model: nn.Module, zero: ZeroRedundancyOptimizer) -> tuple[list[Slot], list[ShardedSpace], list[list[str]]]:
    """One slot per piece of the optimizer's partition on this rank (the local optimizer's order), the spaces,
    and the names of each outer param group's parameters."""
    names = parameter_names(model)
    rank = zero.rank
    for group in zero.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): a parameter of shape {list(p.shape)} in the "
                                 f"optimizer is not a parameter of the model {type(model).__name__}")
    spaces = [ShardedSpace(space.layout, [names[id(p)] for p in space.params], [p.shape for p in space.params],
                           zero.process_group) for space in zero._spaces]
    where = {id(p): (spaces[s], i) for s, space in enumerate(zero._spaces) for i, p in enumerate(space.params)}
    slots = [Slot(names[id(piece.param)], piece.leaf, *where[id(piece.param)]) for piece in zero._pieces]
    return slots, spaces, [[names[id(p)] for p in group["params"]] for group in zero.param_groups]


def optim_state_dict(model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """Sharded or full as the model's state_dict_type says (full for a model without one: a plain module or
    torch's DDP). Full is a collective over the optimizer's group."""
    init_optimizer_state(zero.optim)
    slots, spaces, group_names = _slots(model, zero)
    setting: StateDictSetting | None = getattr(model, "state_dict_setting", None)
    sharded = setting is not None and setting.sharded
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": names}
              for g, names in zip(zero.param_groups, group_names)]
    device = zero._spaces[0].device if zero._spaces else torch.device("cpu")
    keep = sharded or setting is None or not setting.rank0_only or zero.rank == 0
    return name_keyed_state(zero.optim, slots, spaces, groups, sharded=sharded, group=zero.process_group,
                            device=device, keep=keep)


def optim_state_dict_to_load(model: nn.Module, zero: ZeroRedundancyOptimizer,
                             optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's pieces' state cut from a name-keyed dict (full or sharded, any world size, saved by ZeRO or
    FSDP), as ``zero.load_state_dict`` takes it."""
    where = f"ZeroRedundancyOptimizer (rank {zero.rank}) optim_state_dict_to_load"
    slots, _, group_names = _slots(model, zero)
    check_param_groups(where, optim_state_dict["param_groups"], group_names)
    return {"state": local_optim_state(where, slots, optim_state_dict),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optim_state_dict["param_groups"]],
            LOCAL_PIECES_KEY: {"world": zero.world_size, "rank": zero.rank}}


# --- a plain torch optimizer under a shardkit DDP: whole state on every rank ---------------------------------

def plain_optim_state_dict(ddp: DistributedDataParallel, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The name-keyed state dict of a torch optimizer over a shardkit DDP's parameters (every rank holds the
    whole state: no communication; sharded, the state tensors as they are, in their parameters' shapes, the
    format of ZeRO's and FSDP's pieces, and DCP saves each value once)."""
    setting = ddp.state_dict_setting
    return optim_state.state_dict_of(
        optim, parameter_names(ddp), [], sharded=setting is not None and setting.sharded,
        rank0_only=setting is not None and setting.rank0_only, group=ddp.process_group, device=torch.device("cpu"),
        whole_in_place=True)


def plain_optim_state_dict_to_load(ddp: DistributedDataParallel, optim: torch.optim.Optimizer,
                                   optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    where = f"shardkit DDP (rank {dist.get_rank(ddp.process_group)}) optim_state_dict_to_load"
    return optim_state.state_dict_to_load(where, optim, parameter_names(ddp), [], optim_state_dict)

"""Construction of shardkit.FullyShardedDataParallel, apart from the class: the checks every rank runs alike and
the choices made once.

- ``verify_same_arguments_and_layout_everywhere``: the wrapper's first collective; every rank raises the same
  error, naming ranks and values, where their arguments, groups or units differ (``layout`` is what is compared
  of the units).
- ``groups``: the shard and replicate groups of a ShardingStrategy (HYBRID_SHARD's from the hosts, or given).
- devices: ``compute_device_type`` (compared across ranks), ``move_to_device_id`` (FSDP1's device_id rule),
  ``check_one_device``, and under ``CPUOffload(offload_params=True)`` ``refuse_offload_without_cuda`` and
  ``offload_device`` (where the offloaded units compute).
- ``broadcast_from_rank0`` (sync_module_states) and ``zero_copy_memory`` (the shard group's shared memory for the
  flat gradients), both collectives."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, _agreement, _torch_compat
from ..backend import host_groups, shared_buffer, zero_copy_unavailable
from ._fsdp1_api import CPUOffload, ShardingStrategy
from ._fsdp1_units import Unit


def verify_same_arguments_and_layout_everywhere(arguments: dict[str, str], layout: list, members: Any,
                                                process_group: Any) -> None:
    """The wrapper's first collective: every rank's communication arguments (printable values), its groups'
    members (``members``: _agreement.pair_members) and its units' layout (``layout``) go to every rank in one
    exchange (shardkit._agreement), issued alike whatever the arguments. Raises the same error on every rank, naming
    the ranks and the values, where any differ: ranks that went on would pair different collectives."""
    me = dist.get_rank()
    given = process_group if isinstance(process_group, tuple) else (process_group,)
    everyone = _agreement.gather((arguments, members, layout), _agreement.exchange_groups(given))
    problems = _agreement.disagreements({rank: theirs[0] for rank, theirs in everyone.items()})
    problems += _agreement.mismatched_pairs({rank: theirs[1] for rank, theirs in everyone.items()})
    if problems:
        raise RuntimeError(f"shardkit FSDP (rank {me}): {'; '.join(problems)}; pass the same arguments on every rank")
    layouts = {rank: theirs[2] for rank, theirs in everyone.items()}
    first = min(layouts)
    reference = layouts[first]
    differing = [rank for rank, theirs in sorted(layouts.items()) if theirs != reference]
    if not differing:
        return
    theirs = layouts[differing[0]]
    for position in range(max(len(reference), len(theirs))):
        a = reference[position] if position < len(reference) else None
        b = theirs[position] if position < len(theirs) else None
        if a != b:
            unit = (a if a is not None else b or ("",))[0] or "(root)"
            raise RuntimeError(
                f"shardkit FSDP (rank {me}): unit '{unit}' differs between ranks: rank {first} has "
                f"{_describe_unit(a)}, {_agreement.name_ranks(differing)} {'have' if len(differing) > 1 else 'has'} "
                f"{_describe_unit(b)}; wrap the same model with the same policy on every rank")


def layout(owners: dict[str, list[tuple[str, nn.Parameter]]]) -> list:
    """The units as ranks compare them: (unit, [(name, shape, dtype, requires_grad) of each parameter])."""
    return [(unit, [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in params])
            for unit, params in owners.items()]


def _describe_unit(entry) -> str:
    if entry is None:
        return "no such unit"
    _, params = entry
    shown = ", ".join(f"{n} {list(s)} {d.removeprefix('torch.')}{'' if g else ' frozen'}" for n, s, d, g in params[:4])
    return f"{len(params)} parameters ({shown}{', ...' if len(params) > 4 else ''})"


def groups(strategy: ShardingStrategy, process_group):
    """(shard group, replicate group, the group spanning both) for a strategy."""
    if strategy == ShardingStrategy.HYBRID_SHARD:
        if isinstance(process_group, tuple):
            if len(process_group) != 2 or any(g is None for g in process_group):
                raise ValueError("HYBRID_SHARD's process_group=(shard_group, replicate_group) needs both groups, "
                                 f"got {process_group!r}")
            shard, replicate = process_group
            return (shard if dist.get_world_size(shard) > 1 else None,
                    replicate if dist.get_world_size(replicate) > 1 else None, shard)
        return _hybrid_groups(process_group)
    if isinstance(process_group, tuple):
        raise ValueError(f"a (shard, replicate) process group pair is for HYBRID_SHARD, not {strategy.name}")
    group = process_group if process_group is not None else _torch_compat.default_group()
    if strategy == ShardingStrategy.NO_SHARD or dist.get_world_size(group) == 1:
        return None, (group if dist.get_world_size(group) > 1 else None), group
    return group, None, group


def _hybrid_groups(process_group):
    if process_group is not None and dist.get_process_group_ranks(process_group) != list(range(dist.get_world_size())):
        raise ValueError("HYBRID_SHARD over a subgroup: pass process_group=(shard_group, replicate_group)")
    on_host, across_hosts = host_groups("shardkit FSDP HYBRID_SHARD")
    shard = on_host if dist.get_world_size(on_host) > 1 else None
    replicate = across_hosts if dist.get_world_size(across_hosts) > 1 else None
    return shard, replicate, _torch_compat.default_group()


# --- devices ------------------------------------------------------------------------------------------------
def compute_device_type(device_id: int | torch.device | None, cpu_offload: CPUOffload,
                        managed: list[tuple[str, nn.Parameter]]) -> str:
    """Where the units will compute, as ranks compare it ("cpu", "cuda"): ranks on different device types would
    run their collectives on different engines."""
    if cpu_offload.offload_params:
        return "cuda"
    if device_id is not None:
        return "cuda" if isinstance(device_id, int) else torch.device(device_id).type
    return managed[0][1].device.type if managed else "cpu"


def _device_of(device_id: int | torch.device) -> torch.device:
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


def move_to_device_id(module: nn.Module, device_id: int | torch.device, rank: int) -> None:
    """FSDP1's rule: a CPU module moves to device_id (in place: its parameters stay the same objects); one already
    on another GPU is a mistake, not a move."""
    target = _device_of(device_id)
    elsewhere = next(((n, p.device) for n, p in module.named_parameters()
                      if p.device.type != "cpu" and p.device != target), None)
    if elsewhere is not None:
        raise ValueError(f"shardkit FSDP (rank {rank}): device_id={device_id!r} ({target}), but parameter "
                         f"'{elsewhere[0]}' is on {elsewhere[1]}; pass the module's own device as device_id, "
                         "or keep the module on the CPU and let FSDP move it")
    module.to(target)


def check_one_device(module: nn.Module, managed: list[tuple[str, nn.Parameter]], ignored: bool, rank: int) -> set[str]:
    """The one device the managed parameters are on (as a set of its name); refuses none or several."""
    if not managed:
        raise ValueError(f"shardkit FSDP (rank {rank}): the module has no parameters to shard "
                         f"({type(module).__name__}{', all ignored' if ignored else ''})")
    devices = {str(p.device) for _, p in managed}
    if len(devices) > 1:
        raise ValueError(f"shardkit FSDP (rank {rank}): parameters on mixed devices {sorted(devices)}: "
                         + ", ".join(f"{n} on {p.device}" for n, p in managed[:8]))
    return devices


def _global_rank() -> str:
    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"


def refuse_offload_without_cuda() -> None:
    """offload_params=True keeps the shards in pinned host memory and computes on a GPU: without one it would
    silently be plain CPU training, so it is refused, naming why."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("torch.cuda.is_available() is False")
    if not _C.with_cuda:
        reasons.append("this shardkit was built without CUDA (build it with SHARDKIT_CUDA=1)")
    if reasons:
        raise RuntimeError(f"shardkit FSDP (rank {_global_rank()}): cpu_offload=CPUOffload(offload_params=True) needs "
                           "a CUDA device (the shards live in pinned host memory, the units compute on the GPU), but "
                           + " and ".join(reasons))


def offload_device(device_id: int | torch.device | None, managed: list[tuple[str, nn.Parameter]],
                   rank: int) -> torch.device:
    """The compute device of an offloaded model, as FSDP1 picks it: ``device_id``, else the parameters' CUDA
    device, else the current CUDA device. Parameters must be on the CPU or on that device."""
    if device_id is not None:
        device = _device_of(device_id)
        if device.type != "cuda":
            raise ValueError(f"shardkit FSDP (rank {rank}): cpu_offload=CPUOffload(offload_params=True) computes on a "
                             f"CUDA device, but device_id={device_id!r}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = next((p.device for _, p in managed if p.device.type == "cuda"),
                      torch.device("cuda", torch.cuda.current_device()))
    elsewhere = [(n, p.device) for n, p in managed if p.device.type != "cpu" and p.device != device]
    if elsewhere:
        name, where = elsewhere[0]
        raise ValueError(f"shardkit FSDP (rank {rank}): cpu_offload=CPUOffload(offload_params=True) computes on "
                         f"{device} (device_id={device_id!r}), but parameter '{name}' is on {where}; keep the module "
                         "on the CPU (or on the compute device)")
    return device


# --- collectives made once ----------------------------------------------------------------------------------
def broadcast_from_rank0(replicate_group: Any, shard_group: Any, tensors: list[torch.Tensor]) -> None:
    """Replicas first, then inside each shard group: every rank ends with global rank 0's values."""
    for group in (replicate_group, shard_group):
        if group is not None and tensors:
            _torch_compat.broadcast_coalesced(group, tensors, src=0)


def zero_copy_memory(shard_group: Any, offloaded: bool, managed: list[tuple[str, nn.Parameter]],
                     units: list[Unit]) -> torch.Tensor | None:
    """Collective on the shard group: host memory every rank of it maps, big enough for the largest flat
    gradient it reduce-scatters, in which each backward makes the gradient it reduces next (one at a time:
    the previous reduction is finished first), so that the reduce-scatter reads the peers' gradients where
    they lie instead of copying them through the group's slots. Only on a shardkit group on one host, for
    host parameters and a shard group of several ranks; else None (ordinary memory, same results). Nobody
    asked for it, so only a refusal where it applies is worth a ZeroCopyUnavailableWarning: no room in
    /dev/shm (shardkit.backend.shared_buffer warns, on every rank)."""
    if shard_group is None or offloaded:
        return None
    if any(p.device.type != "cpu" for _, p in managed):
        return None
    sizes = [g.handle.reduce_input_bytes for u in units for g in u.groups if g.trainable]
    if not sizes or zero_copy_unavailable(shard_group) is not None:  # gloo, or a group across hosts
        return None
    return shared_buffer(max(sizes), shard_group, who="shardkit FSDP", what="the flat gradients")

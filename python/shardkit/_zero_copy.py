"""Zero-copy memory: host memory that every rank of a shardkit group maps, from which collectives read the peers'
data where it lies instead of copying it through the group's slots.

It promises: ``shared_buffer`` (a collective) hands out such memory or returns None on every rank alike, with the
same results either way; ``zero_copy_unavailable`` says, without communicating, why a group can have none (the same
answer on every rank); every refusal is told the user as one ZeroCopyUnavailableWarning naming the caller, the
memory asked for and why (``warn_zero_copy_unavailable``). The fronts (DDP's buckets, FSDP's and fully_shard's
buffers) ask here; the memory itself is the C++ backend's (csrc/comm/backend.h).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from . import _C, _torch_compat
from ._group_backend import cpu_backend
from ._topology import host_topology


class ZeroCopyUnavailableWarning(UserWarning):
    """Zero-copy memory (shared memory that every rank of a group maps, from which collectives read the peers'
    data where it lies) could not be had; ordinary memory is used instead, with the same results. The message says
    why. Silence it with ``warnings.filterwarnings("ignore", category=shardkit.ZeroCopyUnavailableWarning)``."""


def zero_copy_unavailable(group: dist.ProcessGroup | None = None) -> str | None:
    """Why ``group`` (default: the world) can have no zero-copy memory at all, or None where it can (if /dev/shm
    has the room): its CPU backend is not shardkit's, or its ranks are on several hosts. The same answer on every
    rank of the group, found without communication."""
    group = group if group is not None else _torch_compat.default_group()
    if not isinstance(cpu_backend(group), _C.ProcessGroupShardkit):
        return f"the group's backend is {dist.get_backend(group)}, not shardkit's"
    hosts = host_topology(group).num_hosts
    return f"the group's ranks are on {hosts} hosts, which share no memory" if hosts > 1 else None


def shared_buffer(nbytes: int, group: dist.ProcessGroup | None = None, *, who: str = "shardkit.backend.shared_buffer",
                  what: str = "the buffer") -> torch.Tensor | None:
    """A collective over ``group`` (default: the world): ``nbytes`` of host memory, a uint8 tensor, that every rank
    of the group maps from the others; an allreduce of a tensor lying in it, or a reduce-scatter whose input lies
    in it, reads the peers' data there instead of copying it through the group's slots (same results). Every rank
    calls it with the same ``nbytes``, in the same place among the group's collectives.

    Where there is none, returns None on every rank and warns (warn_zero_copy_unavailable: "{who} (rank r): no
    zero-copy memory for {what} (n bytes per rank): why; ..."): /dev/shm has not the room, the group spans hosts
    or its backend is not shardkit's (zero_copy_unavailable; then no collective is issued)."""
    why = zero_copy_unavailable(group)
    if why is None:
        memory, why = cpu_backend(group).shared_buffer(nbytes)
        if memory is not None:
            return memory
    warn_zero_copy_unavailable(who, f"{what} ({nbytes} bytes per rank)", why)  # attributed to our caller
    return None


def warn_zero_copy_unavailable(who: str, what: str, why: str, stacklevel: int = 1) -> None:
    """Warns ``"{who} (rank r): no zero-copy memory for {what}: {why}; ordinary memory is used, with the same
    results"`` (a ZeroCopyUnavailableWarning; r: the global rank), attributed to the frame ``stacklevel`` levels
    above the caller (1: the caller's caller)."""
    warnings.warn(f"{who} (rank {dist.get_rank()}): no zero-copy memory for {what}: {why}; ordinary memory is used, "
                  "with the same results", ZeroCopyUnavailableWarning, stacklevel=stacklevel + 2)

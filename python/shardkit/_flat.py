"""Per-dtype flat spaces over parameters (ZeRO-1/2), laid out by ``_C.FlatLayout`` (csrc/core/flat_layout.h).

One space per dtype, in order of the dtype's first appearance; each holds its parameters in the given order
and the layout: offsets, shard size S, padding to world * S, and every (parameter, rank) piece. No offset or
shard arithmetic is done in Python: every such question is asked of the layout.

``ZeroPartition`` is what ``shardkit.DistributedDataParallel(zero_stage=1|2)`` computes at construction and
owns; ``shardkit.ZeroRedundancyOptimizer`` built over that model's parameters reads it instead of computing
its own. The optimizer finds it through a weak reference that the DDP leaves on each of its trainable
parameters (``PARTITION_ATTR``): the DDP holds the only strong reference (the optimizer takes one more
while it lives), so a parameter never keeps a dead DDP's partition alive.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import _C, _exchange

PARTITION_ATTR = "_shardkit_zero_partition"


@dataclasses.dataclass(eq=False)
class FlatSpace:
    """One dtype's parameters laid out flat. Under a shardkit DDP with zero_stage 1|2, ``flat`` is the buffer of
    ``layout.padded_numel`` elements whose slices the parameters are (``p.data`` is a view of it; gaps and
    padding hold zeros), and under zero_stage 2 ``grad_shard`` is this rank's S elements of the gradients."""

    dtype: torch.dtype
    device: torch.device
    params: list[torch.Tensor]
    layout: Any  # _C.FlatLayout
    flat: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel


def flat_spaces(params: Iterable[torch.Tensor], world: int) -> list[FlatSpace]:
    """Groups ``params`` by dtype (first appearance first, order kept) and lays each group out for ``world``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [FlatSpace(dtype, members[0].device, members, _C.FlatLayout([p.numel() for p in members], world))
            for dtype, members in by_dtype.items()]


def flatten_into_buffers(spaces: list[FlatSpace]) -> None:
    """Makes every parameter a view of its space's new flat buffer (values kept, gaps and padding zero)."""
    for space in spaces:
        flat = torch.zeros(space.layout.padded_numel, dtype=space.dtype, device=space.device)
        with torch.no_grad():
            for p, offset in zip(space.params, space.layout.offsets):
                view = flat[offset:offset + p.numel()].view(p.shape)
                view.copy_(p.detach())
                p.data = view
        space.flat = flat


def packed_output(layout: Any, rank: int, world: int, pieces: list[torch.Tensor | None], dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, mine): a ``world * S`` output buffer and its ``rank``-th slice, which holds this rank's pieces of
    ``pieces`` (one value per parameter of ``layout``, whole or already this rank's piece, any shape; None:
    zeros) and zeros in its gaps. ``mine`` is then the input of an in-place all-gather into ``full``: no
    staging shard (both shardkit's backend and gloo take an input that aliases its own place in the output;
    test_zero.py checks)."""
    shard = layout.shard_numel
    full = torch.empty(shard * world, dtype=dtype, device=device)
    mine = full[rank * shard:(rank + 1) * shard]
    mine.zero_()
    for piece in layout.pieces_of_rank(rank):
        value = pieces[piece.param]
        if value is None:
            continue
        flat = value.detach().reshape(-1)
        if flat.numel() != piece.numel:  # a whole value: cut this rank's piece out of it
            flat = flat[piece.param_begin:piece.param_begin + piece.numel]
        mine[piece.shard_begin:piece.shard_begin + piece.numel] = flat
    return full, mine


def all_gather_parameters(spaces: list[FlatSpace], group: dist.ProcessGroup) -> None:
    """Every rank's slice of every space's parameters to every rank: one all-gather (all_gather_into_tensor)
    per space, all in flight together (a collective over ``group``, the spaces laid out for its size).

    Where the parameters are views of the space's flat buffer (a shardkit DDP with zero_stage 1|2), this rank's
    slice of the buffer is the all-gather's input and the buffer its output: nothing is packed or copied.
    Otherwise this rank's pieces are packed into its slice of a transient flat buffer (``packed_output``),
    gathered in place and copied into the parameters."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered = []
    for space in spaces:
        layout = space.layout
        if space.flat is not None:
            begin = layout.rank_begin(rank)
            mine, full = space.flat[begin:begin + layout.shard_numel], space.flat
        else:
            full, mine = packed_output(layout, rank, world, list(space.params), space.dtype, space.device)
        work = _exchange.all_gather_single(full, mine, group=group, async_op=True)
        gathered.append((space, full, work))
    with torch.no_grad():
        for space, full, work in gathered:
            work.wait()
            if space.flat is None:
                for p, offset in zip(space.params, space.layout.offsets):
                    p.detach().copy_(full[offset:offset + p.numel()].view(p.shape))


@dataclasses.dataclass(eq=False)
class ZeroPartition:
    """A shardkit DDP's ZeRO partition: its trainable parameters (the reducer's, in its order) in flat spaces."""

    stage: int
    process_group: dist.ProcessGroup
    spaces: list[FlatSpace]
    names: dict[int, str]  # id(param) -> the parameter's name in the module
    reducer: Any  # _C.Reducer; under stage 2 it writes into the spaces' grad_shard
    reducer_index: dict[int, int]  # id(param) -> its index in the reducer
    optimizer: weakref.ReferenceType | None = None  # stage 2: the ZeroRedundancyOptimizer stepping the shards

    def holds(self, p: torch.Tensor) -> bool:
        return any(q is p for space in self.spaces if space.dtype == p.dtype for q in space.params)

    def mark_parameters(self) -> None:
        ref = weakref.ref(self)
        for space in self.spaces:
            for p in space.params:
                setattr(p, PARTITION_ATTR, ref)


def partitions_of(params: Iterable[torch.Tensor]) -> list[ZeroPartition]:
    """The live partitions that the parameters are marked with and that really hold them (a deep copy of a
    marked parameter carries the mark but belongs to no partition)."""
    found: dict[int, ZeroPartition] = {}
    for p in params:
        ref = getattr(p, PARTITION_ATTR, None)
        partition = ref() if ref is not None else None
        if partition is not None and id(partition) not in found and partition.holds(p):
            found[id(partition)] = partition
    return list(found.values())

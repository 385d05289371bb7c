"""Uneven inputs for shardkit DDP (``torch.distributed.algorithms.join``): what a rank whose inputs ran out does
while the others still train.

It promises torch DDP's ``join()`` for ``zero_stage=0``: every iteration that the other ranks still train, a joined
rank issues the collectives their forward and backward issue, in the order DistributedDataParallel._prepare_forward
issues them, contributing zero gradients; the average is over the initial world size, or over the ranks still
training, as asked; at the end the model of the last rank to join (the highest such rank of the group) goes to every
rank of the group. ZeRO stages are refused (``check_joinable``). The wrapper keeps the Joinable interface itself
(``join``, ``join_hook``, ``join_device``, ``join_process_group``) and calls in here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from . import _profiling

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


def check_joinable(zero_stage: int) -> None:
    """Refuses join() under ZeRO, naming the stage."""
    if zero_stage:
        raise NotImplementedError(
            f"shardkit DDP: join() with zero_stage={zero_stage} is not supported: a rank whose inputs ran "
            "out would also have to step its ZeRO partition and match ZeroRedundancyOptimizer.step()'s "
            "all-gather; use zero_stage=0 with join(), or give every rank the same number of batches")


def agree_on_backward_sync(group: dist.ProcessGroup, device: torch.device, synced: bool) -> bool:
    """An allreduce telling ranks whose inputs ran out whether this iteration's backward syncs."""
    flag = torch.tensor([1 if synced else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


class ShardkitJoinHook(JoinHook):
    """torch's Join protocol for shardkit DDP. Each iteration that the other ranks still train, a rank whose
    inputs ran out issues what their forward and backward issue (DistributedDataParallel._prepare_forward and
    Reducer::shadow_backward), contributing zeros; at the end the last rank to join broadcasts the model."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        # Dividing by the ranks still training is done by the reducer; every rank enters join() alike.
        ddp.reducer.set_engine_average(divide_by_initial_world_size)

    def main_hook(self) -> None:
        ddp = self.ddp
        with _profiling.span("shardkit::ddp.join_main_hook"):
            if ddp.forward_sync_buffers and ddp.require_forward_param_sync:
                ddp._broadcast_from_rank0(ddp._synced_buffers())
            synced = agree_on_backward_sync(ddp.process_group, ddp.device, False)
            ddp.require_forward_param_sync = synced
            if synced:
                ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """The model of the last rank to join (the highest such rank) goes to every rank: the others skipped
        optimizer steps after their inputs ran out."""
        ddp = self.ddp
        ddp.reducer.set_engine_average(True)  # join is over on every rank: no divisor but the world size
        candidate = torch.tensor([dist.get_rank(ddp.process_group) if is_last_joiner else -1], device=ddp.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=ddp.process_group)
        source = int(candidate.item())  # a rank of the group, as c10d's broadcast takes its root (not a global rank)
        tensors = [p.detach() for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        if ddp.forward_sync_buffers:
            tensors += ddp._synced_buffers()
        ddp._broadcast_from_rank0(tensors, src=source)

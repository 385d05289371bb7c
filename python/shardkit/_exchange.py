"""Picklable objects exchanged through tensor collectives, without numpy.

torch's object collectives (``dist.all_gather_object``, ``dist.gather_object``, ...) turn the received bytes back
into objects with ``Tensor.numpy()``, so they raise "Numpy is not available" in an environment without numpy —
and torch does not depend on numpy. shardkit's DDP and ZeRO use these instead, so a clean install
(torch + shardkit) trains.

Protocol (the same collectives, in the same order and forms, as torch's versions, so every rank — and any
tool counting a group's collectives — sees the same sequence):
  1. each rank pickles its object into a uint8 tensor;
  2. an all_gather of one int64 per rank (the pickle sizes);
  3. each tensor is padded to the largest size, then an all_gather (or a gather to ``dst``) of the uint8 tensors;
  4. each received tensor is cut back to its rank's size and unpickled.
Every rank of the group must call the same function with the same ``group`` (and ``dst``).

Bytes ↔ tensor without numpy: ``torch.frombuffer`` reads a bytearray; the way back copies the tensor's memory
with ``ctypes.string_at`` (``bytes(storage)`` would work too, but iterates element by element: minutes for
tens of MB of optimizer state).
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

from . import _torch_compat


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> Any:
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13): _torch_compat picks the name."""
    return _torch_compat.all_gather_single(output, input, group, async_op)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order, on every rank (a collective)."""
    device = _torch_compat.object_collective_device(group)
    payload, sizes = _padded_payload(obj, device, group)
    received = torch.empty(payload.numel() * len(sizes), dtype=torch.uint8, device=device)
    dist.all_gather(_slices(received, len(sizes)), payload, group=group)
    return _unpickle_all(received, sizes)


def gather_object(obj: Any, dst: int, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``obj``, in group-rank order, on group rank ``dst``; None elsewhere (a collective)."""
    device = _torch_compat.object_collective_device(group)
    payload, sizes = _padded_payload(obj, device, group)
    if dist.get_rank(group) != dst:
        dist.gather(payload, None, group=group, group_dst=dst)
        return None
    received = torch.empty(payload.numel() * len(sizes), dtype=torch.uint8, device=device)
    dist.gather(payload, _slices(received, len(sizes)), group=group, group_dst=dst)
    return _unpickle_all(received, sizes)


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's ``values`` (the same count on every rank, each fitting int64), in group-rank order: one
    all-gather of int64s (a collective), on the device torch's object collectives use."""
    device = _torch_compat.object_collective_device(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = torch.empty(mine.numel() * dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    return everyone.view(-1, mine.numel()).tolist()


def _padded_payload(obj: Any, device: str, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, list[int]]:
    """Steps 1, 2 and 3's padding: this rank's pickle as a uint8 tensor as long as the largest rank's, and
    every rank's size."""
    data = pickle.dumps(obj)
    world = dist.get_world_size(group)
    local_size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    all_sizes = torch.zeros(world, dtype=torch.int64, device=device)
    dist.all_gather([all_sizes[r:r + 1] for r in range(world)], local_size, group=group)
    sizes = all_sizes.tolist()
    # frombuffer shares the bytearray's memory (and keeps it alive); a pickle is never empty.
    payload = torch.frombuffer(bytearray(data).ljust(max(sizes), b"\0"), dtype=torch.uint8)
    return payload.to(device), sizes


def _slices(received: torch.Tensor, world: int) -> list[torch.Tensor]:
    """One equal, non-overlapping view of ``received`` per rank: the collective's output list."""
    width = received.numel() // world
    return [received[r * width:(r + 1) * width] for r in range(world)]


def _unpickle_all(received: torch.Tensor, sizes: list[int]) -> list[Any]:
    """Step 4: rank r's object from bytes [r * width, r * width + sizes[r]) of ``received``."""
    width = received.numel() // len(sizes)
    host = received.cpu().contiguous()
    raw = memoryview(ctypes.string_at(host.data_ptr(), host.numel()))
    return [pickle.loads(raw[r * width:r * width + size]) for r, size in enumerate(sizes)]

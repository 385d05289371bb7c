"""Tensors inside the nested containers a forward takes and returns (tuples, lists, dicts; dataclasses when
looking for tensors): found, moved to a device, or cast, for the fronts that touch a module's inputs and outputs
(shardkit DDP's device_ids, the FSDP1 front's offload and mixed precision).

Mapping keeps every container's type (a list stays a list, a tuple a tuple) and leaves what is not a tensor
as it is."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (also inside dataclass instances), depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each tensor in its lists, tuples and dicts replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device | int | str, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor moved to ``device``."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor cast to ``dtype`` (the others as they are)."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)

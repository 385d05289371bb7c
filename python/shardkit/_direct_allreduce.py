"""``shardkit.all_reduce_``: a shardkit group's allreduce of a dense CPU tensor, called straight into the C++ backend.

It promises the very collective ``torch.distributed.all_reduce`` issues on that group (validation, numbering, order
with the group's other collectives, results and errors), synchronous and in place, without torch's Python wrapper,
its dispatcher, a Work or a Future: for latency-bound loops of small allreduces (docs/backend.md, "Speed"). A group
whose CPU backend is not shardkit's is refused with a TypeError.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _C, _torch_compat
from ._group_backend import cpu_backend

_DIRECT: dict[int, tuple[dist.ProcessGroup, Any]] = {}  # id(group) -> (group, its shardkit CPU backend)
# ReduceOp.SUM and its kin are RedOpType values; pybind converts one to a ReduceOp object on every call (about
# 1 µs, a sixth of a small allreduce). These are converted once and found by identity (hashing a pybind enum
# costs half a microsecond); a ReduceOp object (PREMUL_SUM) passes as is.
_REDUCE_OPS = tuple((kind, dist.ReduceOp(kind)) for name, kind in dist.ReduceOp.RedOpType.__members__.items()
                    if name != "PREMUL_SUM")


def _as_reduce_op(op: Any) -> Any:
    for kind, converted in _REDUCE_OPS:
        if op is kind:
            return converted
    return op


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.distributed.all_reduce(tensor, op, group)`` for a dense CPU tensor on a shardkit group, synchronous,
    in place, returning ``tensor``: the same collective (validation, numbering, order with every other
    collective of the group, results and errors), reached without torch's Python wrapper, its dispatcher, a
    Work or a Future. For latency-bound loops of small allreduces, where those cost more than the reduction
    (docs/backend.md, "Speed"); everything else should call ``torch.distributed.all_reduce``. A collective: every rank
    of ``group`` calls it in the same order as its other collectives."""
    group = group if group is not None else _torch_compat.default_group()
    entry = _DIRECT.get(id(group))
    if entry is None or entry[0] is not group:
        backend = cpu_backend(group)
        if not isinstance(backend, _C.ProcessGroupShardkit):
            raise TypeError(f"shardkit.all_reduce_: the group's CPU backend is {type(backend).__name__}, not "
                            "shardkit's; use torch.distributed.all_reduce")
        entry = _DIRECT[id(group)] = (group, backend)
    entry[1].allreduce_now(tensor, _as_reduce_op(op))
    return tensor

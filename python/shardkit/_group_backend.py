"""Which backend runs a process group's collectives on CPU tensors: the one lookup through which every shardkit module
reaches its own backend (``_C.ProcessGroupShardkit``) behind a group.

It promises the backend itself, never the checking wrapper torch puts around every backend under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and None (not an error) for a group without a CPU backend. It communicates
nothing and creates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _torch_compat


def cpu_backend(group: dist.ProcessGroup | None = None) -> Any:
    """The backend that runs ``group``'s (default: the world's) collectives on CPU tensors, None where it has none
    (a group of "cuda:nccl" only). Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps every backend in a checking
    wrapper (a private type with ``wrapped_pg``): the backend inside it."""
    group = group if group is not None else _torch_compat.default_group()
    try:
        backend = _torch_compat.group_backend(group, torch.device("cpu"))
    except RuntimeError:
        return None
    while hasattr(backend, "wrapped_pg"):
        backend = backend.wrapped_pg
    return backend

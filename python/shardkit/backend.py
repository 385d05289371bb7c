"""Registration of the ``"shardkit"`` torch.distributed backend.

``dist.init_process_group("shardkit")`` calls :func:`_create_backend` once per group. It agrees a
shared-memory segment name with the group's other ranks through the group's Store, builds the inner gloo
backend used for point-to-point traffic, and constructs the C++ ``ProcessGroupShardkit``.

Environment:
  SHARDKIT_SHM_SLOT_BYTES   bytes per rank and buffer in the shared segment (default 1 MiB); collectives
                            of any size are chunked through it.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

import torch.distributed as dist

from . import _C

BACKEND_NAME = "shardkit"
_DEFAULT_SLOT_BYTES = 1 << 20


def _slot_bytes() -> int:
    raw = os.environ.get("SHARDKIT_SHM_SLOT_BYTES", str(_DEFAULT_SLOT_BYTES))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"SHARDKIT_SHM_SLOT_BYTES must be a positive integer, got {raw!r}")
    return value


def _agree_segment_name(store: dist.Store, rank: int, group_id: str) -> str:
    """Rank 0 draws a name unique to this job and group; the others read it from the group's Store."""
    key = "shardkit/shm_name"
    if rank == 0:
        name = f"/shardkit-{os.getpid()}-{secrets.token_hex(6)}-{group_id or 'default'}"
        store.set(key, name)
        return name
    return store.get(key).decode()


def _create_backend(options: "dist.distributed_c10d._DistributedBackendOptions", pg_options) -> dist.Backend:
    if pg_options is not None:
        raise ValueError(f"the shardkit backend takes no pg_options, got {pg_options!r}")
    store, rank, size = options.store, options.group_rank, options.group_size
    timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(seconds=options.timeout)
    group_id = "".join(ch if ch.isalnum() else "_" for ch in str(options.group_id))[:40]
    name = _agree_segment_name(store, rank, group_id)
    fallback = dist.ProcessGroupGloo(dist.PrefixStore("shardkit/gloo", store), rank, size, timeout)
    return _C.ProcessGroupShardkit(rank, size, name, _slot_bytes(), timeout, fallback)


def register_backend() -> None:
    """Register ``"shardkit"`` with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # devices must be a list: a plain string would be iterated letter by letter.
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])

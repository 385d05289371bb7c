"""``backend="shardkit"`` in any process that imports torch, without ``import shardkit``: torch's extension autoloading.

shardkit's wheel declares :func:`register` in the ``torch.backends`` entry-point group; ``import torch`` calls every
entry of that group as its last step, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. ``register`` makes the name
``"shardkit"`` known to torch.distributed with a creator that imports shardkit, its native extension included, only
when a process group on the backend is made: a process that never makes one loads none of shardkit's code but this
module. It also registers the ``slurm://`` rendezvous (``shardkit.launchers``: ranks started by ``srun`` without
torchrun), whose handler is imported only when ``init_process_group`` asks for it. ``import shardkit`` registers
through the same function (it does nothing when the name is already known), so
the backend has one creator however it was found.

This module sits outside the ``shardkit`` package on purpose: importing anything inside the package runs
``shardkit/__init__.py``, which loads the extension. It imports only torch, which is fully imported when torch calls
the entry point (torch.distributed included).
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "shardkit"
SLURM_SCHEME = "slurm"


def register() -> None:
    """Register ``"shardkit"`` and the ``slurm://`` rendezvous with torch.distributed (idempotent; nothing where
    torch has no distributed)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(SLURM_SCHEME, slurm_rendezvous)
    except RuntimeError:  # registered already: by an earlier call, or by another package (its handler stays)
        pass
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # devices must be a list: a plain string would be iterated letter by letter. A CPU-only torch gets no
    # "cuda" entry: torch code that asks a backend's device map for its accelerator (ShardedTensor, used by
    # torch.distributed.checkpoint) would otherwise call torch.cuda.current_device() and fail.
    devices = ["cpu", "cuda"] if torch.version.cuda is not None else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=devices)


def create_backend(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed's creator for the backend: shardkit's own (``shardkit._startup.create_backend``), imported
    at the first group made on the backend."""
    from shardkit._startup import create_backend as create

    return create(*args, **kwargs)


def slurm_rendezvous(url: str, **kwargs: Any) -> Any:
    """torch.distributed's rendezvous for ``init_method="slurm://"``: shardkit's (``shardkit.launchers``), imported
    when a process group asks for it."""
    from shardkit.launchers import rendezvous_handler

    yield from rendezvous_handler(url, **kwargs)

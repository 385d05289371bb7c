"""shardkit: distributed training for PyTorch.

Importing shardkit registers the ``"shardkit"`` torch.distributed backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, checkpoint, data, fsdp, hooks, optim, state_dict, wrap  # noqa: F401  (_C: the extension, loaded here)
from ._attempt import attempt_store
from ._trace import dump_traces
from .backend import ZeroCopyUnavailableWarning, all_reduce_, register_backend
from .ddp import DistributedDataParallel
from .fsdp import FullyShardedDataParallel
from .quantized import Quantized
from .strategy import auto
from .zero import ZeroRedundancyOptimizer

if TYPE_CHECKING:
    from .fsdp import fully_shard

__version__ = "0.2.0"
__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "Quantized", "ZeroCopyUnavailableWarning",
           "ZeroRedundancyOptimizer", "__version__", "all_reduce_", "attempt_store", "auto", "dump_traces",
           "checkpoint", "fsdp", "fully_shard", "hooks", "optim", "register_backend", "state_dict", "wrap"]

register_backend()


# ``import shardkit`` loads no part of torch.distributed.checkpoint, torch.distributed.tensor, torch.distributed.fsdp
# or sympy: a DDP or ZeRO-1/2 job needs none of them. ``fully_shard`` (torch's FSDP2, DTensor), shardkit.checkpoint's
# save/load and shardkit.state_dict's functions (DCP) load them at first use (PEP 562; docs/design.md, "Python").
def __getattr__(name: str) -> Any:
    if name == "fully_shard":
        return fsdp.fully_shard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

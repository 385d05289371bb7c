"""shardkit: distributed training for PyTorch.

Importing shardkit registers the ``"shardkit"`` torch.distributed backend.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, checkpoint, data, fsdp, hooks, state_dict, wrap  # noqa: F401  (_C: the extension, loaded here)
from ._attempt import attempt_store
from ._trace import dump_traces
from .backend import ZeroCopyUnavailableWarning, all_reduce_, register_backend
from .ddp import DistributedDataParallel
from .fsdp import FullyShardedDataParallel, fully_shard
from .quantized import Quantized
from .strategy import auto
from .zero import ZeroRedundancyOptimizer

__version__ = "0.2.0"
__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "Quantized", "ZeroCopyUnavailableWarning",
           "ZeroRedundancyOptimizer", "__version__", "all_reduce_", "attempt_store", "auto", "dump_traces",
           "checkpoint", "fsdp", "fully_shard", "hooks", "register_backend", "state_dict", "wrap"]

register_backend()

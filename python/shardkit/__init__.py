"""shardkit: distributed training for PyTorch.

Importing shardkit registers the ``"shardkit"`` torch.distributed backend.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, hooks
from .backend import register_backend
from .ddp import DistributedDataParallel
from .zero import ZeroRedundancyOptimizer

__version__ = "0.1.0"
__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "__version__", "hooks", "register_backend"]

register_backend()

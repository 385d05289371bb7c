"""The FSDP1 front's configuration vocabulary, with torch FSDP1's names and fields: ShardingStrategy,
BackwardPrefetch, MixedPrecision, CPUOffload. Plain values, no behaviour: shardkit.FullyShardedDataParallel
(_fsdp1.py) reads them, and they are importable from shardkit.fsdp as in torch.distributed.fsdp."""

from __future__ import annotations

import dataclasses
import enum

import torch


class ShardingStrategy(enum.Enum):
    FULL_SHARD = enum.auto()  # parameters, gradients and optimizer state sharded; full buffers freed after use
    SHARD_GRAD_OP = enum.auto()  # as FULL_SHARD, but the full buffers live from forward through backward
    NO_SHARD = enum.auto()  # replicated (DDP's memory), gradients all-reduced
    HYBRID_SHARD = enum.auto()  # FULL_SHARD inside each host, replicated across hosts


class BackwardPrefetch(enum.Enum):
    BACKWARD_PRE = enum.auto()  # the next unit's all-gather is issued when a unit's backward starts
    BACKWARD_POST = enum.auto()  # ... when a unit's backward ends


@dataclasses.dataclass
class MixedPrecision:
    """FSDP1's MixedPrecision: the full buffers (forward and backward compute) in ``param_dtype``, the gradient
    reduction in ``reduce_dtype`` (default: param_dtype), floating buffers in ``buffer_dtype`` (cast once, at
    wrapping). The shards, and so the optimizer, stay in the parameters' own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True


@dataclasses.dataclass
class CPUOffload:
    """FSDP1's CPUOffload. ``offload_params=True``: shards, gradients and optimizer state in (pinned) host memory,
    compute on a CUDA device (see _fsdp1.py's docstring); without CUDA it is an error, never a silent no-op."""

    offload_params: bool = False

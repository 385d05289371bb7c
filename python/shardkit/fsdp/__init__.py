"""shardkit's sharding fronts (ZeRO-3), one per module:

- ``fully_shard`` (_fully_shard.py): torch FSDP2's ``fully_shard`` with shardkit's collectives plugged in —
  DTensor state, torch's API and checkpoints. The recommended front.
- ``FullyShardedDataParallel`` (_fsdp1.py): torch FSDP1's arguments on shardkit's fused flat layout, with its
  own schedule (unshard, prefetch, reduce-scatter, end of backward). The migration path from FSDP1.

Both keep their shared-memory buffers resident through _resident_memory.py. Their state dicts live below them,
in ``shardkit.checkpoint`` (which imports neither front), in one format: torch FSDP2's.
"""

from ..checkpoint._fsdp_state_dict import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from ._fsdp1 import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from ._fully_shard import fully_shard

__all__ = ["BackwardPrefetch", "CPUOffload", "FullStateDictConfig", "FullyShardedDataParallel", "MixedPrecision",
           "ShardedStateDictConfig", "ShardingStrategy", "StateDictType", "fully_shard"]

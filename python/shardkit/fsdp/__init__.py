"""shardkit's sharding fronts (ZeRO-3), one per module:

- ``fully_shard`` (_fully_shard.py): torch FSDP2's ``fully_shard`` with shardkit's collectives plugged in —
  DTensor state, torch's API and checkpoints. The recommended front.
- ``FullyShardedDataParallel`` (_fsdp1.py): torch FSDP1's arguments on shardkit's fused flat layout, with its
  own schedule (unshard, prefetch, reduce-scatter, end of backward: _fsdp1_schedule.py). The migration path from
  FSDP1. Beside it, as in torch's _fully_shard/: its configuration values (_fsdp1_api.py), construction's checks
  (_fsdp1_init.py) and its units (_fsdp1_units.py).

Both keep their shared-memory buffers resident through _resident_memory.py. Their checkpoints are in one
format, torch FSDP2's: ``fully_shard``'s are torch's own; the FSDP1 front's state-dict adapter (_state_dict.py)
reads its flat parameters into ``shardkit.checkpoint``'s vocabulary (which imports neither front).

``fully_shard`` loads _fully_shard.py, and with it torch's FSDP2 and DTensor, at first use (PEP 562): importing
this package, which ``import shardkit`` does, loads neither (docs/design.md, "Python").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..checkpoint._front_protocol import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from ._fsdp1 import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy

if TYPE_CHECKING:
    from ._fully_shard import fully_shard

__all__ = ["BackwardPrefetch", "CPUOffload", "FullStateDictConfig", "FullyShardedDataParallel", "MixedPrecision",
           "ShardedStateDictConfig", "ShardingStrategy", "StateDictType", "fully_shard"]


def __getattr__(name: str) -> Any:
    if name == "fully_shard":
        from ._fully_shard import fully_shard

        globals()["fully_shard"] = fully_shard
        return fully_shard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The ranks of a save or load: a process group, or this one process when torch.distributed is not initialized.

Agreement is one object all-gather (``shardkit._exchange``, which needs no numpy): every rank contributes what it
found and every rank gets everyone's, so all decide alike. Its deadline is the process group's timeout.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .. import _exchange


class Ranks:
    def __init__(self, process_group: Any = None) -> None:
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (a collective: every rank must call it, in the same order)."""
        return _exchange.all_gather_object(obj, self.group) if self.distributed else [obj]

"""The ranks of a save or load: a process group, or this one process when torch.distributed is not initialized.

Agreement is one object all-gather (``shardkit._exchange``, which needs no numpy): every rank contributes what it
found and every rank gets everyone's, so all decide alike. Its deadline is the process group's timeout.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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

    @contextmanager
    def quiet_single_process(self) -> Iterator[None]:
        """Without a process group, DCP warns that it assumes a single process: it is one, on purpose."""
        with warnings.catch_warnings():
            if not self.distributed:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            yield

"""shardkit checkpoints: torch.distributed.checkpoint (DCP) directories, loaded strictly by training ranks and
read by ``python -m shardkit checkpoint info|consolidate`` in a plain process (no process group, no GPU).

One concern per module: ``_load`` (``load``, ``check_matches``), ``_reader`` (metadata, ``info``,
``consolidate``), ``_cli`` (the command line). This package imports no front (DDP, FSDP, ZeRO).
"""

from __future__ import annotations

from ._cli import add_arguments
from ._load import check_matches, load
from ._reader import consolidate, info, read_metadata

__all__ = ["add_arguments", "check_matches", "consolidate", "info", "load", "read_metadata"]

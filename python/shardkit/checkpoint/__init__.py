"""shardkit checkpoints: torch.distributed.checkpoint (DCP) directories that appear whole or not at all, whose
every file is checksummed, and that load only when every file is the one written.

- ``save(state_dict, checkpoint_id)``: DCP's save into a staging directory beside the target, committed by one
  atomic rename once every rank's files are durable, with a manifest of every file's size and CRC32C
  (computed while writing). An interrupted save leaves the previous checkpoint intact. With
  ``async_save=True`` it returns an ``AsyncSave`` handle once the state is copied into a staging area, and the
  process's writer thread runs the same protocol on that copy (``_async``).
- ``load(state_dict, checkpoint_id, strict=True, verify=True)``: verifies the files (spread over the ranks),
  checks the checkpoint matches the state dict, then ``dcp.load``.
- ``Checkpointer(root, every=N, keep=K)``: a training loop's checkpoints (``root/step-00000100``): saved every N
  steps with every rank's RNG states, the newest K kept, ``load_latest`` resuming from the newest that verifies
  (_checkpointer.py; the data position: shardkit.data.ResumableSampler).
- ``verify(checkpoint_id)``: the verification alone, in one process; ``info`` and ``consolidate`` read a
  checkpoint without a process group; ``python -m shardkit checkpoint info [--verify] | consolidate``.

The directory stays a plain DCP checkpoint (the manifest is one more file, which DCP ignores): ``dcp.load`` and
torch's FSDP2 read it unchanged, and plain ``dcp.save`` checkpoints load here, with a warning that they cannot be
verified. One concern per module: ``_save`` (the commit protocol), ``_async`` (asynchronous saves' staging and
writer thread), ``_commit`` (its directory operations),
``_writer`` (checksums while writing), ``_manifest``, ``_verify``, ``_load``, ``_reader`` (metadata, info,
consolidate), ``_safe_pickle`` (what every read of a checkpoint unpickles with: never plain pickle), ``_cli``;
``_checkpointer`` and ``_rng`` (a training loop's checkpoints: Checkpointer, the RNG states); for the fronts'
state dicts, ``_sharded_state`` (ShardedSpace, Place, Slot, PieceTensor), ``_optim_state`` (name-keyed optimizer
state dicts) and ``_front_protocol`` (what a front implements). This package imports no front (DDP, FSDP, ZeRO),
not even for annotations: each front keeps its own adapter (fsdp/_state_dict.py, shardkit/_zero_state_dict.py);
the Checkpointer gets shardkit.state_dict's functions from it (state_dict.py hands them over through
_front_protocol as it is imported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import CheckpointIntegrityError, CheckpointSaveError, UnsafeCheckpointError, UnverifiedCheckpointWarning

if TYPE_CHECKING:
    from ._async import AsyncSave
    from ._checkpointer import Checkpointer
    from ._cli import add_arguments
    from ._load import check_matches, load
    from ._reader import consolidate, info, read_metadata
    from ._save import save
    from ._verify import verify

# Importing this package loads no part of torch.distributed.checkpoint (DCP): the fronts import its vocabulary
# (_front_protocol, _sharded_state, _optim_state) with every ``import shardkit``, and a DDP job never saves through
# DCP. The names imported under TYPE_CHECKING above load, and DCP with them, at first use (PEP 562; docs/design.md,
# "Python").
__all__ = ["AsyncSave", "CheckpointIntegrityError", "CheckpointSaveError", "Checkpointer",
           "UnsafeCheckpointError", "UnverifiedCheckpointWarning", "add_arguments", "check_matches", "consolidate",
           "info", "load", "read_metadata", "save", "verify"]
_LAZY = frozenset(__all__) - set(globals())


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The same imports as under TYPE_CHECKING, all at once (each loads DCP anyway), written out so that the import
    # graph tests/python/test_layers.py reads sees them.
    from ._async import AsyncSave
    from ._checkpointer import Checkpointer
    from ._cli import add_arguments
    from ._load import check_matches, load
    from ._reader import consolidate, info, read_metadata
    from ._save import save
    from ._verify import verify

    loaded = {"AsyncSave": AsyncSave, "Checkpointer": Checkpointer, "add_arguments": add_arguments,
              "check_matches": check_matches, "load": load, "consolidate": consolidate, "info": info,
              "read_metadata": read_metadata, "save": save, "verify": verify}
    globals().update(loaded)
    return loaded[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)

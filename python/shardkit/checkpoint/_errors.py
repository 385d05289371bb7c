"""What checkpoint saves and loads raise and warn."""

from __future__ import annotations


class CheckpointSaveError(RuntimeError):
    """A save that committed nothing: the checkpoint directory still holds what it held before (the previous
    checkpoint, intact, or nothing). Raised on every rank that lives to see it, naming each rank's failure (a
    full disk says "No space left on device" and the file)."""


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint that must not be loaded: a file missing, truncated, written by another save, or whose
    bytes are not the ones written (its CRC32C). The message names every such file and what differs."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without shardkit's manifest (written by plain ``torch.distributed.checkpoint.save``): its
    files' sizes were checked against its metadata, but their contents cannot be verified."""


class UnsafeCheckpointError(CheckpointIntegrityError):
    """A checkpoint whose reading would run code it names: its ``.metadata`` names a global other than DCP's
    metadata classes, or a non-tensor value holds what ``torch.load(weights_only=True)`` refuses. The message
    names the file or the key and the refused global; nothing of the checkpoint is unpickled past it."""

"""Directory operations of a checkpoint commit: staging beside the target, durable directory entries, the one
atomic step that makes a save visible, and the clean-up (and recovery) of what an interrupted save left.

Names, all in the target's parent directory (so every rename stays on one filesystem):
    TARGET                                   the checkpoint, what load and DCP read
    .TARGET.shardkit-staging-<save id>       a save in progress: only ever renamed into TARGET whole
    .TARGET.shardkit-old-<save id>           a replaced checkpoint on its way out (the fallback publish only)

``publish`` replaces TARGET by the staging directory in one step: renameat2(RENAME_EXCHANGE) swaps the two
names atomically (the staging name then holds the old checkpoint, removed after). Where the filesystem or
kernel cannot exchange (EINVAL, ENOTSUP, ENOSYS: some network and FUSE filesystems, non-Linux), it falls back
to two renames, TARGET -> .old, staging -> TARGET; a crash between them leaves no TARGET but the previous
checkpoint whole under the .old name, which ``recover_and_clean`` (run by the next save) renames back, and
which load's "no such checkpoint" error names.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path

from .. import _C
from ._manifest import MANIFEST_NAME

_STAGING = ".shardkit-staging-"
_RETIRED = ".shardkit-old-"
_CANNOT_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def staging_path(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{_STAGING}{save_id}"


def retired_path(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{_RETIRED}{save_id}"


def _leftovers(target: Path, tag: str) -> list[Path]:
    if not target.parent.is_dir():
        return []
    prefix = f".{target.name}{tag}"
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


def leftovers(target: Path) -> list[Path]:
    """What interrupted saves into ``target`` left beside it."""
    return _leftovers(target, _STAGING) + _leftovers(target, _RETIRED)


def retired_checkpoints(target: Path) -> list[Path]:
    """Previous checkpoints a fallback publish moved aside and did not remove, oldest first."""
    return sorted(_leftovers(target, _RETIRED), key=lambda p: p.stat().st_mtime_ns)


def fsync_directory(path: Path) -> None:
    """Makes the directory's entries (files created, renamed, removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover_and_clean(target: Path) -> None:
    """Before a save: brings back a checkpoint that an interrupted fallback publish left under the .old name
    (only where ``target`` is missing, with a warning), then removes every other leftover of earlier saves."""
    retired = retired_checkpoints(target)
    if retired and not target.exists():
        os.rename(retired[-1], target)
        fsync_directory(target.parent)
        warnings.warn(f"shardkit checkpoint: {target} was missing and an interrupted save had left the previous "
                      f"checkpoint at {retired[-1]}: renamed it back", stacklevel=3)
    for path in leftovers(target):
        remove_tree(path)


def check_replaceable(target: Path) -> None:
    """Raises unless ``target`` is absent, an empty directory, or a checkpoint directory: publish replaces the
    directory whole, and must never take an unrelated directory (or a file) with it."""
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir() or target.is_symlink():
        raise FileExistsError(f"{target} exists and is not a directory: a checkpoint cannot replace it")
    if any(True for _ in target.iterdir()) and not ((target / ".metadata").exists()
                                                     or (target / MANIFEST_NAME).exists()):
        raise FileExistsError(f"{target} is a directory that holds files but no checkpoint (no .metadata): "
                              "refusing to replace it with a checkpoint")


def publish(staging: Path, target: Path, save_id: str) -> Path | None:
    """Makes the complete, durable ``staging`` directory the checkpoint ``target`` in one atomic step; returns
    where the replaced checkpoint now lies (for the caller to remove), or None when there was none. Raises,
    having changed nothing, when it cannot; once it returns the new checkpoint is visible (the caller fsyncs the
    parent directory to make that durable)."""
    if not target.exists():
        os.rename(staging, target)  # a directory renamed onto a missing name: atomic
        return None
    result = _C.rename_exchange(str(staging), str(target))
    if result == 0:
        return staging  # the swap put the old checkpoint under the staging name
    if result not in _CANNOT_EXCHANGE:
        raise OSError(result, f"exchanging {staging} and {target}: {os.strerror(result)}")
    retired = retired_path(target, save_id)
    os.rename(target, retired)
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(retired, target)  # put the previous one back: nothing was committed
        raise
    return retired


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

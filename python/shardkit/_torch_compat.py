"""The private torch interfaces shardkit's checkpoint code relies on, in one place (the twin of csrc/compat.h).

Each function says what it uses (shardkit supports torch >= 2.11). The checkpoint interfaces were read in torch
2.13 (installed here) and 2.14.1 (its wheel), and in an older revision of torch's main branch (2.5-era), which
uses them the same way; 2.11 lies between and was not read itself. A torch release that changes one of these
fails here, with a message naming the interface, rather than somewhere inside a save.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """DCP's own flattening of a nested state dict: ``(flat, paths)``, keys as DCP's metadata spells them
    (``torch.distributed.checkpoint._nested_dict``, present in 2.13 and 2.14)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def use_filesystem(writer: FileSystemWriter, filesystem: FileSystem) -> None:
    """Makes ``writer`` open, rename and remove every file it writes through ``filesystem``.

    FileSystemWriter keeps its FileSystem in the attribute ``fs`` and goes through it for every file of a save:
    ``write_data`` hands ``self.fs.create_stream`` to ``_write_files_from_queue`` (the data files, one stream
    per file, written front to back: ``tell()`` gives each item's offset, then ``write`` calls, then an
    optional ``fsync(stream.fileno())`` and ``close()``), and ``finish`` writes ``.metadata.tmp`` through
    ``self.fs.create_stream`` and renames it with ``self.fs.rename`` (2.13 and 2.14 alike, and the 2.5-era code;
    2.14 adds a ``flush()`` before the fsync, which 2.13 lacks).
    """
    if not isinstance(getattr(writer, "fs", None), FileSystem):
        raise RuntimeError(f"shardkit checkpoint: this torch's FileSystemWriter ({type(writer).__module__}) has no "
                           "FileSystem in its attribute 'fs': shardkit cannot checksum the files it writes "
                           "(python/shardkit/_torch_compat.py needs updating for this torch)")
    writer.fs = filesystem

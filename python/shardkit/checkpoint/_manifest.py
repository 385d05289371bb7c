"""The manifest of a shardkit checkpoint: which files one save wrote, their sizes and CRC32C checksums.

``.shardkit-manifest.json`` lies in the checkpoint directory beside DCP's ``.metadata`` and data files; DCP
reads only the files its metadata names, so the directory stays a plain DCP checkpoint. It is written by rank 0
after every rank's files are durable and before the checkpoint is committed (see _save.py), and lists every
file of the save, ``.metadata`` included:

    {"format": "shardkit.checkpoint.manifest", "version": 1, "checksum": "crc32c",
     "save_id": "<32 hex digits>", "world_size": 2,
     "files": {".metadata": {"size": 1466, "crc32c": "0x1c2b3a49", "rank": 0},
               "__0_0.distcp": {"size": 5272, "crc32c": "0x8a01f3e2", "rank": 0}, ...},
     "manifest_crc32c": "0x..."}

``rank`` is the rank that wrote the file. ``manifest_crc32c`` is the CRC32C of the rest of the manifest in
canonical form (sorted keys, no spaces), so a damaged manifest is refused like any damaged file. The save id is
also the ``save_id`` of ``.metadata``'s storage metadata, which ties DCP's metadata to this manifest.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .. import _C

MANIFEST_NAME = ".shardkit-manifest.json"
_FORMAT = "shardkit.checkpoint.manifest"
_VERSION = 1
# Read in 1 MiB pieces: the piece is checksummed while it is still in the core's cache (8 MiB pieces: ~20 %
# slower here). An mmap of the file would skip the copy (2x faster from the page cache) but turns a file truncated
# meanwhile into SIGBUS instead of an error.
_READ_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class FileRecord:
    size: int
    crc32c: int
    rank: int  # the rank that wrote it


@dataclasses.dataclass(frozen=True)
class Manifest:
    save_id: str
    world_size: int
    files: dict[str, FileRecord]

    def to_json(self) -> bytes:
        body = {"format": _FORMAT, "version": _VERSION, "checksum": "crc32c", "save_id": self.save_id,
                "world_size": self.world_size,
                "files": {name: {"size": r.size, "crc32c": f"0x{r.crc32c:08x}", "rank": r.rank}
                          for name, r in sorted(self.files.items())}}
        body["manifest_crc32c"] = f"0x{_C.crc32c(_canonical(body)):08x}"
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Raises ValueError saying what is wrong with ``raw`` (not JSON, not a manifest, damaged)."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"not JSON ({error})") from error
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            raise ValueError("not a shardkit manifest")
        if body.get("version") != _VERSION:
            raise ValueError(f"manifest version {body.get('version')!r}; this shardkit reads version {_VERSION}")
        recorded = body.pop("manifest_crc32c", None)
        computed = f"0x{_C.crc32c(_canonical(body)):08x}"
        if recorded != computed:
            raise ValueError(f"its own CRC32C is {computed}, but it records {recorded}: the manifest was damaged")
        try:
            files = {name: FileRecord(size=int(r["size"]), crc32c=int(r["crc32c"], 16), rank=int(r["rank"]))
                     for name, r in body["files"].items()}
            return cls(save_id=str(body["save_id"]), world_size=int(body["world_size"]), files=files)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"malformed manifest ({error!r})") from error


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of the checkpoint in ``directory``; None when it has none (plain DCP). Raises ValueError
    naming the file when it is there but unreadable."""
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return Manifest.from_json(raw)
    except ValueError as error:
        raise ValueError(f"{path}: unreadable shardkit manifest: {error}") from error


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Writes the manifest into ``directory`` and makes it durable (the directory entry is the caller's)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        with open(path, "wb") as file:
            file.write(manifest.to_json())
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        raise OSError(error.errno, f"writing {path}: {os.strerror(error.errno or 0)}") from error


def file_crc32c(path: Path) -> tuple[int, int]:
    """(size, CRC32C) of the file's bytes, read front to back in chunks."""
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    crc = size = 0
    with open(path, "rb", buffering=0) as file:
        while True:
            count = file.readinto(view)
            if not count:
                return size, crc
            crc = _C.crc32c(view[:count], crc)
            size += count

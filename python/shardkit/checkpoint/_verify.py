"""Verification of a checkpoint directory before anything in it is trusted.

With shardkit's manifest (_manifest.py), every file it lists must be there with exactly its size and CRC32C,
and ``.metadata`` must carry the manifest's save id and name only files the manifest lists. Without one (a
plain ``dcp.save``), an UnverifiedCheckpointWarning says the contents cannot be verified, and every file
``.metadata`` places data in must exist and reach the end of its last item (a truncated file is named).

Across ranks (``check_for_load``), the files are split so that each byte is read once per job: largest first,
each to the rank with the fewest bytes so far (a pure function of the manifest, so every rank computes the same
split without communicating). Each rank checks its share, then one all-gather of the problems found lets every
rank raise the same CheckpointIntegrityError, naming every bad file and what differs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from .. import _C
from . import _commit
from ._errors import CheckpointIntegrityError, UnsafeCheckpointError, UnverifiedCheckpointWarning
from ._manifest import MANIFEST_NAME, FileRecord, Manifest, file_crc32c, read_manifest
from ._ranks import Ranks
from ._safe_pickle import load_metadata

METADATA_NAME = ".metadata"


def verify(checkpoint_id: str | Path) -> dict[str, Any]:
    """Verifies the checkpoint directory in this process alone (no process group needed): every file's size and
    CRC32C against its manifest, or, for a checkpoint without one, its files' sizes against ``.metadata`` (with
    an UnverifiedCheckpointWarning). Returns what was checked: ``{"save_id", "world_size", "files", "bytes",
    "checksums"}`` (``checksums`` False without a manifest; ``save_id`` and ``world_size`` then None). Raises
    CheckpointIntegrityError naming every bad file, FileNotFoundError when there is no checkpoint."""
    directory = Path(checkpoint_id)
    manifest, problems = _plan(directory, warn_unverified=True)
    if manifest is not None and not problems:
        for name, record in sorted(manifest.files.items()):
            problems += _check_file(directory, name, record, manifest, checksums=True)
    if problems:
        raise CheckpointIntegrityError(f"shardkit checkpoint verify: {directory} failed verification: "
                                       + "; ".join(problems))
    if manifest is None:
        metadata = _read_metadata_bytes(directory)[0]
        assert metadata is not None, "_plan reports an unreadable .metadata as a problem"
        sizes = _sizes_needed(metadata)
        return {"save_id": None, "world_size": None, "files": len(sizes) + 1, "checksums": False,
                "bytes": sum((directory / name).stat().st_size for name in [METADATA_NAME, *sizes])}
    return {"save_id": manifest.save_id, "world_size": manifest.world_size, "files": len(manifest.files),
            "bytes": sum(r.size for r in manifest.files.values()), "checksums": True}


def check_for_load(directory: Path, ranks: Ranks, checksums: bool) -> None:
    """Collective: raises the same CheckpointIntegrityError on every rank when the checkpoint must not be loaded.
    ``checksums=False`` checks sizes only (no file is read but ``.metadata`` where there is no manifest)."""
    manifest, problems = _plan(directory, warn_unverified=checksums)
    if manifest is not None and not problems:
        share = assign(manifest.files, ranks.world)[ranks.rank]
        for name in share:
            problems += _check_file(directory, name, manifest.files[name], manifest, checksums)
    found = sorted({problem for rank_problems in ranks.all_gather(problems) for problem in rank_problems})
    if found:
        raise CheckpointIntegrityError(f"shardkit checkpoint load (rank {ranks.rank}): {directory} failed "
                                       "verification, nothing was loaded: " + "; ".join(found))


def assign(files: dict[str, FileRecord], world: int) -> list[list[str]]:
    """Each rank's share of the files: largest first, each to the rank with the fewest bytes so far."""
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    for name, record in sorted(files.items(), key=lambda item: (-item[1].size, item[0])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shares[rank].append(name)
        loads[rank] += record.size
    return shares


def missing_checkpoint_error(directory: Path) -> FileNotFoundError:
    retired = _commit.retired_checkpoints(directory)
    hint = (f"; an interrupted save left the previous checkpoint at {retired[-1]} (the next shardkit "
            f"checkpoint.save renames it back, or rename it yourself)") if retired else ""
    return FileNotFoundError(f"{directory}: no such checkpoint directory{hint}")


def _plan(directory: Path, warn_unverified: bool) -> tuple[Manifest | None, list[str]]:
    """The manifest, or for a checkpoint without one the problems its size check found (with the warning)."""
    if not directory.is_dir():
        raise missing_checkpoint_error(directory)
    try:
        manifest = read_manifest(directory)
    except ValueError as error:
        return None, [str(error)]
    if manifest is not None:
        listed = METADATA_NAME in manifest.files
        return manifest, [] if listed else [f"{directory / MANIFEST_NAME}: does not list {METADATA_NAME}"]
    if warn_unverified:
        warnings.warn(f"{directory} has no shardkit manifest (saved by plain torch.distributed.checkpoint.save?): "
                      "its files' contents cannot be verified, only their sizes", UnverifiedCheckpointWarning,
                      stacklevel=3)
    metadata, problems = _read_metadata_bytes(directory)
    if metadata is None:
        return None, problems
    for name, needed in sorted(_sizes_needed(metadata).items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing (.metadata places data in it)")
        elif path.stat().st_size < needed:
            problems.append(f"{path}: {path.stat().st_size} bytes, but .metadata places data up to byte {needed} "
                            "in it (truncated)")
    return None, problems


def _read_metadata_bytes(directory: Path, raw: bytes | None = None) -> tuple[Metadata | None, list[str]]:
    path = directory / METADATA_NAME
    try:
        raw = path.read_bytes() if raw is None else raw
        metadata = load_metadata(raw, path)  # DCP's metadata classes only (_safe_pickle.py), never plain pickle
    except FileNotFoundError:
        return None, [f"{path}: missing (a torch.distributed.checkpoint directory has one)"]
    except UnsafeCheckpointError as error:
        return None, [str(error)]
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same
        return None, [f"{path}: unreadable checkpoint metadata ({type(error).__name__}: {error})"]
    if not isinstance(metadata, Metadata):
        return None, [f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata"]
    return metadata, []


def _sizes_needed(metadata: Metadata) -> dict[str, int]:
    """Each data file's least size: the end of the last item .metadata places in it."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def _check_file(directory: Path, name: str, record: FileRecord, manifest: Manifest, checksums: bool) -> list[str]:
    """Problems of one file against its manifest record (for .metadata also its ties to the manifest)."""
    path = directory / name
    of_save = f"save {manifest.save_id} (rank {record.rank})"
    if not path.is_file():
        return [f"{path}: missing; {of_save} wrote it, {record.size} bytes"]
    size = path.stat().st_size
    if size != record.size:
        how = "truncated" if size < record.size else "grown"
        return [f"{path}: {size} bytes, but {of_save} wrote {record.size} ({how})"]
    if not checksums:
        return []
    if name == METADATA_NAME:  # read once: checksummed and then parsed from the same bytes
        raw = path.read_bytes()
        size, crc = len(raw), _C.crc32c(raw)
    else:
        size, crc = file_crc32c(path)
    if (size, crc) != (record.size, record.crc32c):
        return [f"{path}: CRC32C 0x{crc:08x} over {size} bytes, but {of_save} wrote 0x{record.crc32c:08x} over "
                f"{record.size}: these are not the bytes it wrote (bit flips, or a file of another save)"]
    if name != METADATA_NAME:
        return []
    metadata, problems = _read_metadata_bytes(directory, raw)
    if metadata is None:
        return problems
    saved_by = getattr(metadata.storage_meta, "save_id", None)
    if saved_by != manifest.save_id:
        problems.append(f"{path}: written by save {saved_by}, but {directory / MANIFEST_NAME} is save "
                        f"{manifest.save_id}'s: the files are of different saves")
    for data_name, needed in sorted(_sizes_needed(metadata).items()):
        listed = manifest.files.get(data_name)
        if listed is None:
            problems.append(f"{path}: places data in {data_name}, which save {manifest.save_id} did not write")
        elif listed.size < needed:
            problems.append(f"{path}: places data up to byte {needed} in {data_name}, which save "
                            f"{manifest.save_id} wrote with {listed.size} bytes")
    return problems

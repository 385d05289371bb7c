"""DCP's FileSystemWriter with every file checksummed while it is written, made durable, and accounted for.

``ChecksummingWriter`` is ``torch.distributed.checkpoint.FileSystemWriter`` (the same files, the same format)
whose files all go through ``ChecksummingFileSystem``. Each stream it opens for writing passes the bytes through
to the file and folds them into a running CRC32C (shardkit._C.crc32c) and a byte count, so no file is read again
to be checksummed. On close the stream is flushed and fsync'ed (torch 2.13's writer fsyncs before flushing, so
its last buffered bytes were not covered). The writer's ``ledger`` ends up with, per file name, its size and
CRC32C (``.metadata`` too: it is written as ``.metadata.tmp`` and renamed, and the record follows the rename),
and with the first OSError any write raised: a full disk surfaces inside torch.save as "unexpected pos ...",
while the ledger still has "No space left on device" and the file.

A stream that is ever seeked (no torch version checked does) is checksummed by reading the file back after it
is closed, so a record is right whatever the writes' order.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .. import _C, _torch_compat
from ._manifest import FileRecord, file_crc32c


@dataclasses.dataclass(frozen=True)
class WriteFailure:
    path: str
    error: OSError


class WriteLedger:
    """What one rank's writer wrote (name -> FileRecord) and the first OSError it met; thread-safe (DCP may
    write with several threads)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._files: dict[str, FileRecord] = {}
        self._first_failure: WriteFailure | None = None

    @property
    def files(self) -> dict[str, FileRecord]:
        with self._lock:
            return dict(self._files)

    @property
    def first_failure(self) -> WriteFailure | None:
        return self._first_failure

    def written(self, name: str, size: int, crc32c: int) -> None:
        with self._lock:
            self._files[name] = FileRecord(size=size, crc32c=crc32c, rank=self.rank)

    def failed(self, path: str, error: OSError) -> None:
        with self._lock:
            if self._first_failure is None:
                self._first_failure = WriteFailure(path, error)

    def renamed(self, old: str, new: str) -> None:
        with self._lock:
            if old in self._files:
                self._files[new] = self._files.pop(old)

    def removed(self, name: str) -> None:
        with self._lock:
            self._files.pop(name, None)


class _ChecksummedStream:
    """A file open for writing, passed through; every byte written is added to a running CRC32C and count.

    Only what DCP's writer calls is offered (write, tell, flush, fileno, close, and seek, which makes the
    stream be checksummed from the file instead): a call that could slip bytes past the checksum fails loudly.
    """

    def __init__(self, raw: Any, path: str, ledger: WriteLedger) -> None:
        self._raw = raw
        self._path = path
        self._ledger = ledger
        self.crc32c = 0
        self.size = 0
        self.sequential = True

    def _failing(self, error: OSError) -> None:
        """Records ``error`` in the ledger; the caller re-raises it."""
        self._ledger.failed(self._path, error)

    def write(self, data: Any) -> int:
        try:
            count = self._raw.write(data)
        except OSError as error:
            self._failing(error)
            raise
        view = memoryview(data)
        count = view.nbytes if count is None else count
        self.crc32c = _C.crc32c(view if count == view.nbytes else view.cast("B")[:count], self.crc32c)
        self.size += count
        return count

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.sequential = False
        return self._raw.seek(offset, whence)

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as error:
            self._failing(error)
            raise

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return self._raw.seekable()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def close(self) -> None:
        """Flush, fsync, close: once this returns the file's bytes are on the disk."""
        if self._raw.closed:
            return
        try:
            self._raw.flush()
            os.fsync(self._raw.fileno())
        except OSError as error:
            self._failing(error)
            raise
        finally:
            self._raw.close()

    def abandon(self) -> None:
        """Close after a failure, keeping the failure that is already propagating."""
        try:
            self._raw.close()
        except OSError as error:
            self._failing(error)

    def __enter__(self) -> _ChecksummedStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class ChecksummingFileSystem(FileSystem):
    """FileSystem whose write streams checksum what they write into ``ledger``; reads are plain."""

    def __init__(self, ledger: WriteLedger) -> None:
        super().__init__()
        self.ledger = ledger

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode and "a" not in mode and "+" not in mode:
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummedStream(raw, str(path), self.ledger)
            try:
                yield stream
            except BaseException:
                stream.abandon()
                raise
            stream.close()
        if stream.sequential:
            self.ledger.written(Path(path).name, stream.size, stream.crc32c)
        else:
            self.ledger.written(Path(path).name, *file_crc32c(Path(path)))

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.ledger.renamed(Path(path).name, Path(new_path).name)

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.ledger.removed(Path(path).name)


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter into ``staging`` that records every file in ``self.ledger`` (see the module docstring).

    Its metadata names the checkpoint by ``target`` (where it will be committed, not the staging directory)
    and carries ``save_id``, the manifest's id, as DCP's storage metadata save id.
    """

    def __init__(self, staging: Path, target: Path, save_id: str, rank: int) -> None:
        # overwrite=False: the staging directory is fresh; a .metadata there would be a protocol bug.
        super().__init__(staging, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.ledger = WriteLedger(rank)
        _torch_compat.use_filesystem(self, ChecksummingFileSystem(self.ledger))
        self._target = target
        self._shardkit_save_id = save_id
        self.save_id = save_id

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self._shardkit_save_id  # DCP's reset draws a new one

    def storage_meta(self) -> Any:
        meta = super().storage_meta()
        return None if meta is None else dataclasses.replace(meta, checkpoint_id=str(self._target))

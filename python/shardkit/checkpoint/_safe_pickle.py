"""Reading a checkpoint without running what it holds: nothing a user may have been sent is read with plain pickle.

DCP reads a checkpoint's ``.metadata`` with ``pickle.load`` (FileSystemReader.read_metadata) and every non-tensor
value with ``torch.load(weights_only=False)`` (DefaultLoadPlanner.load_bytes): either runs whatever code the file
names. shardkit reads both here instead:

- ``load_metadata``: ``.metadata`` through an unpickler that resolves only the globals a DCP Metadata pickle
  names (DCP's metadata classes, torch.Size, dtypes, a layout, FileSystemWriter's storage info:
  ``_torch_compat.DCP_METADATA_GLOBALS``) and refuses any other, naming it and the file;
- ``SafeFileSystemReader``: FileSystemReader reading its metadata with ``load_metadata``;
- ``SafeLoadPlanner``: DefaultLoadPlanner reading each non-tensor value with ``torch.load(weights_only=True)``
  (what it allows can be extended with torch.serialization.add_safe_globals); a value it cannot read raises,
  naming the key and why. Tensors are read into the state dict's own tensors as before;
- ``load_weights_only``: any other ``torch.save`` bytes a peer sent (the torchft transport's metadata), read the
  same way.

torch's public ``weights_only`` machinery reads ``torch.save`` files only, not the plain pickle of ``.metadata``:
hence the unpickler of its own here.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import _torch_compat
from ._errors import UnsafeCheckpointError

_DTYPES = frozenset(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype))
ALLOWED_GLOBALS = _torch_compat.DCP_METADATA_GLOBALS | _DTYPES


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, source: Any) -> None:
        super().__init__(io.BytesIO(raw))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(f"{self.source}: shardkit refuses to unpickle {module}.{name}: a "
                                        "checkpoint's .metadata holds only DCP's metadata classes")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: shardkit refuses a persistent id in .metadata: a "
                                    "checkpoint's .metadata holds only DCP's metadata classes")


def load_metadata(raw: bytes, source: Any) -> Any:
    """The object ``raw`` (the bytes of ``source``, a .metadata file) pickles, resolving only DCP's metadata
    globals. Raises UnsafeCheckpointError naming ``source`` and any other global; other unpickling errors as
    pickle raises them."""
    return _MetadataUnpickler(raw, source).load()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``read_metadata`` unpickles with ``load_metadata``, as torch's does otherwise. A
    refusal is kept in ``refused`` too: dcp.load folds a failed metadata read into an AssertionError's text."""

    refused: UnsafeCheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = _torch_compat.dcp_metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            raw = stream.read()
        try:
            metadata = load_metadata(raw, path)
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
        except UnsafeCheckpointError as error:
            self.refused = self.refused or error
            raise
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose ``load_bytes`` reads with ``torch.load(weights_only=True)`` and places the value
    as torch's does (at its path in the nested state dict where DCP flattened it, else under its key)."""

    def __init__(self, checkpoint: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:  # noqa: BLE001 - UnpicklingError for a refused global, others for bad bytes
            raise UnsafeCheckpointError(
                f"checkpoint {self.checkpoint}: shardkit refuses to load {key!r}: torch.load(weights_only=True) "
                f"cannot read it ({type(error).__name__}: {_reason(error)}); a checkpoint's non-tensor values "
                "may hold only what weights_only reads (torch.serialization.add_safe_globals adds a class you "
                "trust)") from error
        if self.flatten_state_dict:
            _torch_compat.set_state_dict_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            self.state_dict[key] = loaded


def load_weights_only(raw: bytes, source: str) -> Any:
    """The object ``torch.save`` wrote into ``raw`` (bytes from ``source``, e.g. a peer), read with
    ``torch.load(weights_only=True)``: containers, plain values, dtypes, sizes and tensors, nothing that runs code.
    Raises UnsafeCheckpointError naming ``source`` and what weights_only refused (or why the bytes do not read)."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as error:  # noqa: BLE001 - UnpicklingError for a refused global, others for bad bytes
        raise UnsafeCheckpointError(
            f"{source}: shardkit refuses to read it: torch.load(weights_only=True) cannot "
            f"({type(error).__name__}: {_reason(error)}); only what weights_only reads is accepted "
            "(torch.serialization.add_safe_globals adds a class you trust)") from error


def refusal(error: BaseException, reader: SafeFileSystemReader) -> UnsafeCheckpointError | None:
    """What a failed dcp.load with ``reader`` and a SafeLoadPlanner refused, if anything: ``reader``'s refusal of
    the metadata, else the first rank's refusal of a value among the failures DCP gathered from the ranks (every
    rank holds every rank's), else ``error`` itself where it is one."""
    if reader.refused is not None:
        return reader.refused
    if isinstance(error, CheckpointException):
        for _, (failure, _trace) in sorted(error.failures.items(), key=lambda item: item[0]):
            if isinstance(failure, UnsafeCheckpointError):
                return failure
    return error if isinstance(error, UnsafeCheckpointError) else None


def _reason(error: Exception) -> str:
    """What weights_only refused, without its page of advice: the WeightsUnpickler's own words where torch gives
    them ("Unsupported global: GLOBAL io.open was not an allowed global by default."), else its message's lines
    less the preamble and the pointer to the documentation (the wording differs among torch versions)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    if "WeightsUnpickler error:" in text:
        said = text.split("WeightsUnpickler error:", 1)[1].split("\n\n", 1)[0]
        said = " ".join(said.split()).split(" Please use ", 1)[0]
        if said:
            return said
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation"))]
    return " ".join(kept) or (lines[0] if lines else type(error).__name__)

"""A torchft ``CheckpointTransport`` whose transfers are checksummed: ``ChecksummedTransport``.

torchft's Manager heals a replica group that is behind (restarted, or new) live from a healthy peer: in the
quorum, the healthy side calls ``send_checkpoint(dst_ranks, step, state_dict, timeout)`` and the recovering side
``recv_checkpoint(src_rank, metadata, step, timeout)``, both over the Manager's own process group (replica ranks).
torchft's ``PGTransport`` sends the state over that group and takes what arrives as it is, reading the metadata
with plain pickle. This transport sends the same kind of state over any torchft ``ProcessGroup`` (torchft's
``ProcessGroupGloo``, shardkit's ``ProcessGroupShardkit``: only ``send`` and ``recv`` are used) and promises:

- **Checked bytes.** Every tensor travels with the CRC32C of its bytes (shardkit's C++ CRC32C, ``_C.crc32c``, the
  checkpoints' checksum), taken before it is sent. The receiver checks each tensor as it lands and refuses the
  transfer (``CheckpointTransferError``) when any differs, naming each such tensor's key path
  (``['user']['default']['model']['fc.weight']``), the step and the source rank. The metadata carries its own
  CRC32C in the header.
- **Refused, then retried.** A refusal raises from ``recv_checkpoint`` inside the Manager's quorum: the Manager
  reports the error, keeps no pending state dict and loads nothing (so the replica's model is untouched: the
  receiver builds the state in tensors of its own, never in the live ones), ``should_commit`` returns False so the
  step is not committed, and the replica's step stays behind, so the next quorum assigns it a recovery again
  (torchft 0.2.0's manager.py ``_async_quorum`` / ``should_commit``, manager.rs ``compute_quorum_results``;
  tests/python/test_torchft_transport.py runs it with a Lighthouse).
- **No pickle from a peer.** The non-tensor part of the state (its nesting, ints, floats, strings, tuples, dtypes,
  ``None``...) travels as ``torch.save`` bytes read with ``torch.load(weights_only=True)``
  (``checkpoint/_safe_pickle.py``); a value weights_only will not read is refused by the sender before anything
  is sent (it tells the receiver why, so neither waits out a timeout).
- **Memory.** The receiver allocates each tensor once, in its final dtype and shape, and receives its bytes
  straight into it (no staging buffer, no copy): the peak is one copy of the state. The sender sends contiguous
  tensors from their own memory; a non-contiguous one (a transposed or strided view) is sent as a contiguous copy
  of its elements (not its whole storage), at most ``_COPY_WINDOW`` bytes of such copies in flight. Received
  tensors are contiguous, with the sender's values, dtypes and shapes.

The wire, per destination, in this order (tags as torchft's PGTransport: the receiver matches them one to one):

1. tag 1: an int64 header ``[magic, version, step, status, length, crc32c]``; ``status`` 0: the metadata follows,
   ``length`` bytes with that CRC32C; 1: the sender refused to send, and ``length`` bytes of UTF-8 say why.
2. tag 2: the metadata, ``torch.save({"step", "tree", "tensors": [(key path, dtype, shape, nbytes, crc32c,
   global shape or None)]})`` where ``tree`` is the state with each tensor replaced by a 0-d int64 tensor holding
   its index in ``tensors``.
3. tag 3 + i: tensor i's bytes (none for an empty tensor).

The receiver waits for every tensor before it raises a mismatch, so a refused transfer leaves nothing in flight
on the group: the sender's sends all complete and the group stays usable for the next quorum. Tensors are CPU or
``device`` tensors (like PGTransport's ``device``; the checksum is taken on a host copy for a non-CPU device).
Plain tensors, Parameters and DTensors: a DTensor's local tensor travels, and the receiver rebuilds it over the
mesh and placements of its own DTensor at that key path (``state_dict``, as PGTransport's argument: a mesh
cannot travel without pickle). A sparse or quantized tensor or another tensor subclass is refused by name (the
sender says which key). Sends are synchronous: ``send_checkpoint`` returns when every byte is sent,
so ``disallow_checkpoint`` has nothing to wait for.

Why not wrap PGTransport and check around it: its receiver unpickles the sender's metadata with plain pickle
before anything could be checked, and a checksum sent beside it would need a second channel whose order against
PGTransport's tags the wrapper does not own; it also sends each tensor's whole storage (a slice of a large tensor
sends the large tensor). Sending the bytes here costs the same sends (one per tensor, on the same group).
"""

from __future__ import annotations

import copy
import ctypes
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor
from torchft.checkpointing.transport import CheckpointTransport

from .. import _C, _torch_compat
from ..checkpoint._errors import CheckpointIntegrityError, UnsafeCheckpointError
from ..checkpoint._safe_pickle import load_weights_only

T = TypeVar("T")

PROTOCOL = "shardkit-crc32c-transport/1"
_MAGIC = 0x53484B54  # "SHKT"
_VERSION = 1
_OK, _REFUSED = 0, 1
_HEADER_TAG, _METADATA_TAG, _FIRST_TENSOR_TAG = 1, 2, 3
_MAX_METADATA = 1 << 30  # a header announcing more is garbage: refused before anything is allocated
_COPY_WINDOW = 256 << 20  # bytes of the sender's temporary contiguous copies in flight before it waits for them


class CheckpointTransferError(CheckpointIntegrityError):
    """A state a recovering replica refused: bytes that differ from the sender's (named by key path, with the
    step and the source rank), metadata that does not read, or a sender that refused to send (its reason)."""


@dataclass
class _Entry:
    """One tensor of the transfer, as the metadata describes it: for a DTensor, its local tensor's, and the
    DTensor's global shape (None for a plain tensor)."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc32c: int
    global_shape: tuple[int, ...] | None = None


def _key(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


def _split(value: Any, path: str, tensors: list[tuple[str, torch.Tensor, tuple[int, ...] | None]],
           markers: torch.Tensor) -> Any:
    """``value`` with each tensor replaced by a marker: ``markers[i]``, a 0-d int64 view holding i, its index in
    ``tensors`` (to which it is appended with its key path, and for a DTensor its local tensor and global shape);
    the markers are views of one storage, which torch.save writes once. Descends dicts (of any class, keys kept in
    order), lists and plain tuples; anything else is a leaf for torch.save (whose weights_only reading decides)."""
    if isinstance(value, torch.Tensor):
        where = path or "the state"
        global_shape = None
        if isinstance(value, DTensor):
            global_shape = tuple(value.shape)
            value = _torch_compat.dtensor_local(value)
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{where} is a {type(value).__name__}: ChecksummedTransport sends plain tensors and "
                            "DTensors only (another subclass's metadata cannot travel without pickle)")
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError(f"{where} is a {value.layout} {'quantized ' * value.is_quantized}tensor: "
                            "ChecksummedTransport sends dense strided tensors only")
        tensors.append((where, value, global_shape))
        return markers[len(tensors) - 1]
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the class (OrderedDict, ...) and the key order; values replaced below
        for key, item in value.items():
            out[key] = _split(item, _key(path, key), tensors, markers)
        return out
    if isinstance(value, list) or type(value) is tuple:
        items = [_split(item, f"{path}[{i}]", tensors, markers) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _leaves(value: Any, path: str, out: dict[str, Any]) -> dict[str, Any]:
    """Every leaf of ``value`` by its key path, as ``_split`` names them."""
    if isinstance(value, dict):
        for key, item in value.items():
            _leaves(item, _key(path, key), out)
    elif isinstance(value, list) or type(value) is tuple:
        for i, item in enumerate(value):
            _leaves(item, f"{path}[{i}]", out)
    else:
        out[path or "the state"] = value
    return out


def _join(tree: Any, received: list[torch.Tensor], used: list[bool]) -> Any:
    """The inverse of ``_split`` over the loaded ``tree``: each marker replaced by its received tensor."""
    if isinstance(tree, torch.Tensor):
        index = int(tree) if tree.dim() == 0 and tree.dtype == torch.int64 else -1
        if not 0 <= index < len(received) or used[index]:
            raise CheckpointTransferError(f"the metadata's tree holds a tensor that is no marker of a sent tensor "
                                          f"(index {index} of {len(received)})")
        used[index] = True
        return received[index]
    if isinstance(tree, dict):
        for key, item in tree.items():
            tree[key] = _join(item, received, used)
        return tree
    if isinstance(tree, list) or type(tree) is tuple:
        items = [_join(item, received, used) for item in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view of the same memory."""
    return tensor.reshape(-1).view(torch.uint8)


def _crc32c(data: torch.Tensor) -> int:
    """CRC32C of a contiguous 1-D uint8 tensor's bytes, read in place on the CPU (a ctypes array over its memory:
    no numpy, which a user's install may lack; the GIL is released while it runs)."""
    host = data if data.device.type == "cpu" else data.cpu()
    if host.numel() == 0:
        return 0
    return _C.crc32c((ctypes.c_char * host.numel()).from_address(host.data_ptr()))


def _host_bytes(data: torch.Tensor) -> bytes:
    """A contiguous 1-D uint8 tensor's bytes, copied once (ctypes.string_at: no numpy)."""
    host = data if data.device.type == "cpu" else data.cpu()
    return ctypes.string_at(host.data_ptr(), host.numel())


class _Deadline:
    """What remains of one timeout shared by every wait of a transfer. Never zero: to c10d a zero timeout means
    'the group's default', so a spent deadline waits 1 ms and then fails."""

    def __init__(self, timeout: timedelta) -> None:
        self._end = time.monotonic() + timeout.total_seconds()

    def left(self) -> timedelta:
        return timedelta(seconds=max(self._end - time.monotonic(), 0.001))


def _posted(post: Callable[[], Any], what: str) -> Any:
    """The Work ``post()`` returns; a send or receive refused when posted (gloo raises at once when the peer's
    connection is gone) raises CheckpointTransferError naming ``what``."""
    try:
        return post()
    except Exception as error:
        raise CheckpointTransferError(f"{what} failed: {error}") from error


def _completed(work: Any, deadline: _Deadline) -> None:
    """Waits for ``work`` within ``deadline``. A gloo send or receive that was aborted returns False instead of
    raising: that is a failure too, never bytes to trust."""
    if work.wait(deadline.left()) is False:
        raise RuntimeError("the operation did not complete (aborted)")


class ChecksummedTransport(CheckpointTransport[T]):
    """torchft's CheckpointTransport over ``pg`` (a torchft ProcessGroup: its ``send`` and ``recv``), every tensor
    checked against the CRC32C its sender took. See the module's docstring for the promises and the wire.

    Args:
        pg: the process group, normally the Manager's own (its ranks are the replica ranks torchft passes).
        timeout: the default deadline of one whole transfer (the Manager passes its own timeout per call).
        device: where tensors are sent from and received into (CPU by default; a CUDA device for NCCL groups).
        state_dict: the receiving side's own state, laid out as what it receives (the Manager's: ``{"user": ...,
            "torchft": ...}``), called when a DTensor arrives: it is rebuilt over the mesh and placements of the
            DTensor at its key path there (as torchft's PGTransport's argument of that name, which it also uses
            to receive in place; this transport never receives into live tensors, see the module docstring).
    """

    def __init__(self, pg: Any, timeout: timedelta, device: torch.device | str = "cpu",
                 state_dict: Callable[[], Any] | None = None) -> None:
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict

    def metadata(self) -> str:
        """What the recovering side checks before it receives: this transport's protocol name and version."""
        return PROTOCOL

    def disallow_checkpoint(self) -> None:
        """Nothing to wait for: ``send_checkpoint`` returns only when everything is sent."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to release: no thread, no server; the process group is the caller's."""

    # --- the sender -------------------------------------------------------------------------------------------
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Sends ``state_dict`` (as of ``step``) to each of ``dst_ranks``, every tensor with the CRC32C of its bytes;
        returns when every send has completed, within ``timeout`` in all. A state it cannot send (a value
        weights_only would refuse, a tensor kind it does not carry) raises CheckpointTransferError after telling
        the receivers why."""
        deadline = _Deadline(timeout or self._timeout)
        try:
            tensors: list[tuple[str, torch.Tensor, tuple[int, ...] | None]] = []
            count = sum(isinstance(leaf, torch.Tensor) for leaf in _leaves(state_dict, "", {}).values())
            tree = _split(state_dict, "", tensors, torch.arange(count, dtype=torch.int64))
            entries = [self._describe(*described) for described in tensors]
            buffer = io.BytesIO()
            torch.save({"step": step, "tree": tree, "tensors": [
                (e.path, e.dtype, list(e.shape), e.nbytes, e.crc32c,
                 None if e.global_shape is None else list(e.global_shape)) for e in entries]}, buffer)
            metadata = buffer.getvalue()
            # What the receiver will do with these bytes, done here first: a value weights_only refuses is
            # reported by the sender, which knows whose it is, instead of by a receiver left guessing.
            load_weights_only(metadata, f"the state of step {step}")
        except Exception as error:  # noqa: BLE001 - whatever stops it, the receivers are told before it raises
            self._send_header(dst_ranks, step, _REFUSED, (str(error) or type(error).__name__).encode(), deadline)
            raise CheckpointTransferError(f"step {step}: refused to send the state to ranks {dst_ranks}: "
                                          f"{error}") from error

        self._send_header(dst_ranks, step, _OK, metadata, deadline)
        works: list[tuple[Any, str, int]] = []
        copies = 0
        for index, (path, tensor, _) in enumerate(tensors):
            if entries[index].nbytes == 0:
                continue
            data, copied = self._wire_bytes(tensor)
            for dst in dst_ranks:
                work = _posted(lambda: self._send_tensor_bytes(path, data, dst, _FIRST_TENSOR_TAG + index),
                               f"step {step}: sending {path} to rank {dst}")
                works.append((work, path, dst))
            copies += data.numel() if copied else 0
            if copies > _COPY_WINDOW:  # let the temporary copies go before making more
                self._wait_all(works, step, deadline)
                works, copies = [], 0
        self._wait_all(works, step, deadline)

    def _describe(self, path: str, tensor: torch.Tensor, global_shape: tuple[int, ...] | None) -> _Entry:
        data, _ = self._wire_bytes(tensor)
        return _Entry(path, tensor.dtype, tuple(tensor.shape), data.numel(), _crc32c(data), global_shape)

    def _wire_bytes(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The bytes that go on the wire for ``tensor``, and whether they are a temporary copy."""
        moved = tensor.detach().to(self._device)
        dense = moved if moved.is_contiguous() else moved.contiguous()
        return _as_bytes(dense), dense.data_ptr() != tensor.data_ptr() or dense.device != tensor.device

    def _send_header(self, dst_ranks: list[int], step: int, status: int, payload: bytes,
                     deadline: _Deadline) -> None:
        header = torch.tensor([_MAGIC, _VERSION, step, status, len(payload), _C.crc32c(payload)], dtype=torch.int64,
                              device=self._device)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device)
        works = []
        for dst in dst_ranks:
            for what, tensor, tag in (("the header", header, _HEADER_TAG), ("the metadata", body, _METADATA_TAG)):
                work = _posted(lambda: self._pg.send([tensor], dst, tag), f"step {step}: sending {what} to rank {dst}")
                works.append((work, what, dst))
        self._wait_all(works, step, deadline)

    def _send_tensor_bytes(self, path: str, data: torch.Tensor, dst_rank: int, tag: int) -> Any:
        """Sends one tensor's bytes (already checksummed); the Work. The one place a tensor goes on the wire."""
        return self._pg.send([data], dst_rank, tag)

    @staticmethod
    def _wait_all(works: list[tuple[Any, str, int]], step: int, deadline: _Deadline) -> None:
        for work, what, dst in works:
            try:
                _completed(work, deadline)
            except Exception as error:
                raise CheckpointTransferError(f"step {step}: sending {what} to rank {dst} failed: {error}") from error

    # --- the receiver -----------------------------------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """The state ``src_rank`` sends for ``step``, every tensor checked against its CRC32C, within ``timeout`` in
        all. Raises CheckpointTransferError naming each tensor whose bytes differ (its key path), the step and the
        source rank, once every byte has arrived; or naming what else was wrong (``metadata`` not this protocol's,
        a header or metadata that does not read, a sender that refused, a receive that failed or timed out)."""
        where = f"the state of step {step} from rank {src_rank}"
        if metadata != PROTOCOL:
            raise CheckpointTransferError(f"{where}: the sender's transport is {metadata!r}, not {PROTOCOL!r} "
                                          "(every replica group must use ChecksummedTransport)")
        deadline = _Deadline(timeout or self._timeout)
        header = torch.zeros(6, dtype=torch.int64, device=self._device)
        what = f"{where}: receiving the header"
        self._wait(_posted(lambda: self._pg.recv([header], src_rank, _HEADER_TAG), what), what, deadline)
        magic, version, sent_step, status, length, crc = (int(v) for v in header.cpu())
        if magic != _MAGIC or version != _VERSION:
            raise CheckpointTransferError(f"{where}: the header is not {PROTOCOL}'s (magic {magic:#x}, version "
                                          f"{version})")
        if not 0 < length <= _MAX_METADATA:
            raise CheckpointTransferError(f"{where}: the header announces {length} bytes of metadata")
        body = torch.empty(length, dtype=torch.uint8, device=self._device)
        what = f"{where}: receiving the metadata"
        self._wait(_posted(lambda: self._pg.recv([body], src_rank, _METADATA_TAG), what), what, deadline)
        raw = _host_bytes(body)
        if _C.crc32c(raw) != crc:
            raise CheckpointTransferError(f"{where}: the metadata arrived with bytes other than the sender's "
                                          f"(CRC32C {_C.crc32c(raw):#010x}, sent {crc:#010x})")
        if status == _REFUSED:
            raise CheckpointTransferError(f"{where}: the sender refused to send it: {raw.decode(errors='replace')}")
        if status != _OK or sent_step != step:
            raise CheckpointTransferError(f"{where}: the sender sent step {sent_step} (status {status})")
        try:
            meta = load_weights_only(raw, f"the metadata of {where}")
            entries = [_Entry(str(p), d, tuple(int(n) for n in s), int(b), int(c),
                              None if g is None else tuple(int(n) for n in g)) for p, d, s, b, c, g in meta["tensors"]]
            tree = meta["tree"]
        except UnsafeCheckpointError as error:
            raise CheckpointTransferError(str(error)) from error
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointTransferError(f"{where}: the metadata is not {PROTOCOL}'s ({error!r})") from error

        # Every tensor is allocated once, in its own dtype and shape, and its recv posted at once: the bytes land
        # in place while earlier ones are checked.
        received: list[torch.Tensor] = []
        pending: list[tuple[int, Any]] = []
        for entry in entries:
            if not isinstance(entry.dtype, torch.dtype) or min(entry.shape, default=0) < 0:
                raise CheckpointTransferError(f"{where}: {entry.path} is announced as {entry.dtype!r} of shape "
                                              f"{list(entry.shape)}")
            tensor = torch.empty(entry.shape, dtype=entry.dtype, device=self._device)
            if tensor.numel() * tensor.element_size() != entry.nbytes:
                raise CheckpointTransferError(f"{where}: {entry.path} is announced as {entry.nbytes} bytes, but "
                                              f"{entry.dtype} of shape {list(entry.shape)} takes "
                                              f"{tensor.numel() * tensor.element_size()}")
            received.append(tensor)
        for index, tensor in enumerate(received):
            if entries[index].nbytes:
                target, tag = _as_bytes(tensor), _FIRST_TENSOR_TAG + index
                pending.append((index, _posted(lambda: self._pg.recv([target], src_rank, tag),
                                               f"{where}: receiving {entries[index].path}")))

        # Check each as it lands, but refuse only once all have: the sender's sends complete, nothing is left in
        # flight on the group for the next quorum to trip over.
        mismatched: list[str] = []
        for index, work in pending:
            entry = entries[index]
            self._wait(work, f"{where}: receiving {entry.path} ({entry.nbytes} bytes)", deadline)
            got = _crc32c(_as_bytes(received[index]))
            if got != entry.crc32c:
                mismatched.append(f"{entry.path} (CRC32C {got:#010x}, sent {entry.crc32c:#010x})")
        if mismatched:
            raise CheckpointTransferError(
                f"refused {where}: {len(mismatched)} of {len(entries)} tensors arrived with bytes other than the "
                f"sender's: {', '.join(mismatched[:8])}{' ...' if len(mismatched) > 8 else ''}")

        if any(entry.global_shape is not None for entry in entries):
            received = self._as_dtensors(entries, received, where)
        used = [False] * len(received)
        state = _join(tree, received, used)
        if not all(used):
            raise CheckpointTransferError(f"{where}: the metadata's tree does not place tensor "
                                          f"{entries[used.index(False)].path}")
        return state

    def _as_dtensors(self, entries: list[_Entry], received: list[torch.Tensor], where: str) -> list[torch.Tensor]:
        """``received`` with each DTensor entry's local tensor made a DTensor over the spec (mesh, placements) of
        the DTensor at the same key path in this side's own state (``state_dict``): what a peer cannot send
        without pickle."""
        own = _leaves(self._state_dict(), "", {}) if self._state_dict is not None else {}
        out = list(received)
        for index, entry in enumerate(entries):
            if entry.global_shape is None:
                continue
            mine = own.get(entry.path)
            if not isinstance(mine, DTensor):
                held = "no state_dict was given" if self._state_dict is None else (
                    f"this side's state_dict holds {type(mine).__name__ if entry.path in own else 'nothing'} there")
                raise CheckpointTransferError(f"{where}: {entry.path} is a DTensor, and {held}: a received DTensor "
                                              "takes its mesh and placements from this side's own DTensor "
                                              "(ChecksummedTransport(state_dict=...))")
            local = _torch_compat.dtensor_local(mine)
            if (tuple(mine.shape), tuple(local.shape), local.dtype) != (entry.global_shape, entry.shape, entry.dtype):
                raise CheckpointTransferError(
                    f"{where}: {entry.path} is a DTensor of global shape {list(entry.global_shape)} with a local "
                    f"{entry.dtype} {list(entry.shape)}; this side's is {list(mine.shape)} with a local {local.dtype} "
                    f"{list(local.shape)}")
            out[index] = _torch_compat.dtensor_with_local(mine, received[index].to(local.device))
        return out

    @staticmethod
    def _wait(work: Any, what: str, deadline: _Deadline) -> None:
        try:
            _completed(work, deadline)
        except Exception as error:
            raise CheckpointTransferError(f"{what} failed: {error}") from error

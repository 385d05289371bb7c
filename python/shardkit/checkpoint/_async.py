"""Asynchronous saves: ``save(state_dict, checkpoint_id, async_save=True)`` copies the state into a staging area and
returns an ``AsyncSave`` handle; the process's one checkpoint writer thread then runs the commit protocol (_save)
on that copy, with every guarantee of a synchronous save.

What blocks the caller: creating the writer's gloo group (the first asynchronous save on a process group only),
then staging: one copy of every tensor into the staging area. Nothing else: no collective, no file.

Staging: a deep copy of the state dict whose tensors' data live in staging buffers, so the copy is the snapshot
and training may change the live tensors as soon as ``save`` returns. Each value keeps its kind, so DCP writes
exactly what a synchronous save of the live state would (the same plan, the same bytes):
  - a plain tensor: a tensor of its shape and dtype;
  - a ``PieceTensor`` (shardkit's FSDP1 front and ZeRO): ``PieceTensor.of`` the staged piece, same parameter
    shape and place (a plain copy_ of a PieceTensor into a tensor of another shape is refused on purpose);
  - a DTensor (``shardkit.fully_shard``, torch FSDP2/TP): the same spec (mesh, placements, global shape) over
    the staged local shard; a torch ShardedTensor: the same metadata over the staged local shards;
  - any other tensor subclass is refused, naming the key; non-tensor values (ints, bytes, param groups) are
    deep-copied, dicts, lists and tuples rebuilt around their staged values.
The buffers: for CPU tensors, one shared-memory block per staging set (``Tensor.share_memory_()``: with torch's
default ``file_descriptor`` sharing strategy the segment is unlinked from /dev/shm at once and lives only as long
as this process holds it; under the ``file_system`` strategy, which leaves files there, plain host memory is used
instead); for CUDA tensors, one pinned host block, filled by non-blocking copies that ``save`` waits for (the
current streams are synchronized) before it returns. Every staged tensor is a view with a storage of exactly its
bytes (_C.exact_storage_alias: DCP would copy a view of a larger storage again). Staging sets are kept for reuse,
keyed by the state's structure (the keys, each value's kind, shapes, dtypes and devices): a save whose state has
the structure of an earlier one copies into the same buffers, once that save is done with them; a save queued
while another with the same structure is in flight gets a set of its own. At most two free sets are kept.

The writer: one daemon thread per process runs the saves one at a time, in call order. Every rank calls
``save`` in the same order, so every rank's writer runs the same saves in the same order, and the collectives of
their agreements (and DCP's own) are ordered on every rank (docs/design.md, "Collective order"). At most one save
is in flight in a process, so at most one per checkpoint directory; a save queued behind another says so in its
handle's ``status`` ("waiting for the save of X to finish"). A synchronous save waits for the writer to be idle
first (its preparation could otherwise remove the staging directory of an asynchronous save of the same target).

The agreement group: the writer's agreements and DCP's gathers and scatters of plans and write results run on
a gloo group of its own, created once per training process group, in the foreground, at the first asynchronous
save on it (``dist.new_group(ranks, backend="gloo", timeout=<the training group's>)``, which every member calls
at that same point of its program). Not on the training group: the writer's collectives would interleave with
training's on it, in an order that differs between ranks. Not through the Store alone: DCP's save needs a
process group for its plan gather/scatter, and an agreement built on Store keys would be a second protocol with
its own deadlines and clean-up; a gloo group gives both with the training group's timeout, over TCP, so a killed
peer's closed connections fail the writer's collective at once (or after the timeout at the latest).

What fails, and how: a peer that dies before the first asynchronous save on a group has created the writer's
group fails that ``save`` call itself (dist.new_group's rendezvous, after the group's timeout). A staging
failure on a rank (a value of a kind that cannot be staged) does not raise in ``save``: that rank's writer still
takes part in the save's first agreement, which then stops it on every rank, and ``result()`` raises the
CheckpointSaveError naming the rank and the value. A rank killed at any point makes
the in-flight save fail on the survivors (CheckpointSaveError from ``result()``), leaving the previous checkpoint
intact (or, killed after rank 0's commit rename, the new one, whole: see _save); its shared memory goes with
the process. ``result(timeout)`` raises TimeoutError naming the checkpoint when the save has not ended in time.

At process exit: an ``atexit`` handler waits for the saves in flight or queued, up to the agreement group's
timeout; a save still running then is abandoned (with a warning): the process ends, the peers' saves fail at
their next agreement, the previous checkpoint stays, and the staging directory left beside it is removed by
the next save. (A process ended by ``os._exit``, as multiprocessing's children are, runs no atexit handler: the
same as a kill.) ``destroy_process_group()`` with a save in flight does not wait for it: torch shuts the
writer's gloo group down with the others, and the save fails with CheckpointSaveError if it still needed it.
"""

from __future__ import annotations

import atexit
import collections
import copy
import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from .. import _C, _torch_compat
from ._errors import CheckpointSaveError
from ._ranks import Ranks
from ._sharded_state import PieceTensor

_ALIGN = 64  # bytes: every staged tensor starts at a multiple of this in its block
_KEEP_FREE_SETS = 2
_WRITER_NICE = 10  # added to the writer thread's nice value (Linux)


# --- the handle ----------------------------------------------------------------------------------------------

class _Progress:
    """What the writer tells one save's handle: the phase it is in (a sentence), then how the save ended."""

    def __init__(self) -> None:
        self.status = "staged"
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.status = "committed" if error is None else f"failed: {error}"
        self.finished.set()


class AsyncSave:
    """One asynchronous save (``shardkit.checkpoint.save(..., async_save=True)``): ``done()``, ``result(timeout)``
    and ``status`` (a sentence: "waiting for the save of X to finish", "preparing", "writing", "agreeing",
    "committing", "committed", "failed: ...")."""

    def __init__(self, target: Path, rank: int, progress: _Progress) -> None:
        self.checkpoint_id = str(target)
        self._rank = rank
        self._progress = progress  # written by the writer thread only

    def __repr__(self) -> str:
        return f"AsyncSave({self.checkpoint_id!r}: {self.status})"

    @property
    def status(self) -> str:
        return self._progress.status

    def done(self) -> bool:
        """Whether the save has ended (committed or failed)."""
        return self._progress.finished.is_set()

    def result(self, timeout: float | None = None) -> None:
        """Waits for the save to end (``timeout`` seconds at most; None: until it ends, which its own deadlines
        bound) and returns None once it committed. Raises the save's CheckpointSaveError where it failed, or
        TimeoutError, naming the checkpoint, where it has not ended in time (it goes on)."""
        if not self._progress.finished.wait(timeout):
            raise TimeoutError(f"shardkit checkpoint save (rank {self._rank}): the asynchronous save of "
                               f"{self.checkpoint_id} has not ended after {timeout} s (it is {self.status})")
        if self._progress.error is not None:
            raise self._progress.error


# --- staging -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One tensor value of the state dict: its key path, kind, and the local tensors whose data is staged."""
    path: str
    kind: str  # "tensor", "piece", "dtensor", "sharded"
    value: torch.Tensor
    locals: tuple[torch.Tensor, ...]


class StagingError(TypeError):
    """A state dict value that an asynchronous save cannot copy into its staging area."""


def _kind_and_locals(path: str, value: torch.Tensor) -> tuple[str, tuple[torch.Tensor, ...]]:
    if isinstance(value, PieceTensor):
        return "piece", (value.local,)
    if _is_dtensor(value):
        return "dtensor", (_torch_compat.dtensor_local(value),)
    if _torch_compat.is_sharded_tensor(value):
        return "sharded", tuple(_torch_compat.sharded_tensor_locals(value))
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise StagingError(f"the value at {path!r} is a {type(value).__module__}.{type(value).__name__}, a tensor "
                           "subclass an asynchronous save cannot stage (it stages plain tensors, PieceTensors, "
                           "DTensors and ShardedTensors): save it synchronously")
    return "tensor", (value,)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _check_stageable(path: str, local: torch.Tensor) -> None:
    if local.layout != torch.strided or local.is_quantized or local.device.type not in ("cpu", "cuda"):
        what = f"{local.layout} {local.dtype}" + (" quantized" if local.is_quantized else "")
        raise StagingError(f"the tensor at {path!r} ({what} on {local.device}) cannot be staged for an asynchronous "
                           "save (dense CPU and CUDA tensors only): save it synchronously")


def _leaves(value: Any, path: str, out: list[_Leaf]) -> None:
    """Every tensor value under ``value``, in the order _rebuild visits them."""
    if isinstance(value, torch.Tensor):
        kind, locals_ = _kind_and_locals(path, value)
        for local in locals_:
            _check_stageable(path, local)
        out.append(_Leaf(path, kind, value, locals_))
    elif isinstance(value, dict):
        for key, item in value.items():
            _leaves(item, f"{path}.{key}" if path else str(key), out)
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            _leaves(item, f"{path}.{i}" if path else str(i), out)


def _rebuild(value: Any, path: str, staged: Iterator[Any]) -> Any:
    """``value`` with every tensor replaced by the next of ``staged`` and every other value deep-copied."""
    if isinstance(value, torch.Tensor):
        return next(staged)
    if isinstance(value, dict):
        out = copy.copy(value)  # the same dict type (OrderedDict, ...), refilled below
        for key, item in value.items():
            out[key] = _rebuild(item, f"{path}.{key}" if path else str(key), staged)
        return out
    if type(value) in (list, tuple):
        return type(value)(_rebuild(item, f"{path}.{i}" if path else str(i), staged) for i, item in enumerate(value))
    try:
        return copy.deepcopy(value)
    except Exception as error:  # noqa: BLE001 - named, with the key, below
        raise StagingError(f"the value at {path!r} (a {type(value).__name__}) cannot be deep-copied for an "
                           f"asynchronous save: {type(error).__name__}: {error}") from error


def _staged_value(leaf: _Leaf, locals_: list[torch.Tensor]) -> Any:
    if leaf.kind == "piece":
        piece = leaf.value
        assert isinstance(piece, PieceTensor)
        return PieceTensor.of(locals_[0], piece.global_shape, piece.begin)
    if leaf.kind == "dtensor":
        return _torch_compat.dtensor_with_local(leaf.value, locals_[0])
    if leaf.kind == "sharded":
        return _torch_compat.sharded_tensor_with_locals(leaf.value, locals_)
    return locals_[0]


Signature = tuple[tuple[str, str, tuple[tuple[tuple[int, ...], torch.dtype, str], ...]], ...]


def _signature(leaves: list[_Leaf]) -> Signature:
    return tuple((leaf.path, leaf.kind, tuple((tuple(t.shape), t.dtype, t.device.type) for t in leaf.locals))
                 for leaf in leaves)


def _shared_memory_is_clean() -> bool:
    """Whether share_memory_() leaves nothing in /dev/shm: torch's file_descriptor strategy unlinks each segment
    as soon as it is created; the file_system strategy keeps a named file there."""
    return torch.multiprocessing.get_sharing_strategy() == "file_descriptor"


class _Buffers:
    """One staging set: a view per local tensor of a signature, carved out of one shared-memory block (CPU
    tensors) and one pinned block (CUDA tensors)."""

    def __init__(self, signature: Signature) -> None:
        specs = [(shape, dtype, device == "cuda") for _, _, locals_ in signature for shape, dtype, device in locals_]
        sizes = [torch.Size(shape).numel() * _itemsize(dtype) for shape, dtype, _ in specs]
        offsets, totals = [], {False: 0, True: 0}
        for (_, _, pinned), nbytes in zip(specs, sizes):
            offsets.append(totals[pinned])
            totals[pinned] += -(-nbytes // _ALIGN) * _ALIGN
        blocks = {False: self._host_block(totals[False]), True: self._pinned_block(totals[True])}
        self.blocks = [block for block in blocks.values() if block is not None]  # the views keep them alive too
        self.views: list[torch.Tensor] = []
        for (shape, dtype, pinned), nbytes, offset in zip(specs, sizes, offsets):
            if nbytes == 0:
                self.views.append(torch.empty(shape, dtype=dtype))
                continue
            block = blocks[pinned]
            assert block is not None
            view = block[offset:offset + nbytes].view(dtype).view(shape)
            self.views.append(_C.exact_storage_alias(view))

    @staticmethod
    def _host_block(nbytes: int) -> torch.Tensor | None:
        if not nbytes:
            return None
        block = torch.empty(nbytes, dtype=torch.uint8)
        return block.share_memory_() if _shared_memory_is_clean() else block

    @staticmethod
    def _pinned_block(nbytes: int) -> torch.Tensor | None:
        if not nbytes:
            return None
        if not torch.cuda.is_available():  # a CUDA tensor was seen, so this cannot happen; say so if it does
            raise StagingError("a CUDA tensor is in the state dict but CUDA is not available: cannot pin staging "
                               "memory for it")
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _StagingPool:
    """Free staging sets by signature (at most _KEEP_FREE_SETS kept, the most recently returned)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: collections.OrderedDict[Signature, list[_Buffers]] = collections.OrderedDict()

    def take(self, signature: Signature) -> _Buffers:
        with self._lock:
            sets = self._free.get(signature)
            if sets:
                buffers = sets.pop()
                if not sets:
                    del self._free[signature]
                return buffers
        return _Buffers(signature)

    def give_back(self, signature: Signature, buffers: _Buffers) -> None:
        with self._lock:
            self._free.setdefault(signature, []).append(buffers)
            self._free.move_to_end(signature)
            while sum(len(sets) for sets in self._free.values()) > _KEEP_FREE_SETS:
                oldest = next(iter(self._free))
                self._free[oldest].pop(0)
                if not self._free[oldest]:
                    del self._free[oldest]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_POOL = _StagingPool()


def copy_into_staging(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The snapshot: every (staging view, live tensor) pair copied; returns once every copy has landed (CUDA
    copies are issued non-blocking on the current streams, which are then synchronized)."""
    cuda_devices = set()
    with torch.no_grad():
        for staged, live in pairs:
            if live.device.type == "cuda":
                cuda_devices.add(live.device)
                staged.copy_(live, non_blocking=True)
            else:
                staged.copy_(live)
    for device in cuda_devices:
        torch.cuda.current_stream(device).synchronize()


@dataclasses.dataclass
class _Staged:
    state: Any = None
    signature: Signature | None = None
    buffers: _Buffers | None = None
    failure: str | None = None

    def release(self) -> None:
        self.state = None
        if self.buffers is not None and self.signature is not None:
            _POOL.give_back(self.signature, self.buffers)
        self.buffers = None


def stage(state_dict: dict[str, Any]) -> _Staged:
    """``state_dict`` copied into a staging set (see the module docstring); a failure is returned, not raised:
    the rank still takes part in the save's first agreement."""
    staged = _Staged()
    try:
        leaves: list[_Leaf] = []
        _leaves(state_dict, "", leaves)
        staged.signature = _signature(leaves)
        staged.buffers = _POOL.take(staged.signature)
        views = iter(staged.buffers.views)
        per_leaf = [[next(views) for _ in leaf.locals] for leaf in leaves]
        copy_into_staging([(view, local) for leaf, views_ in zip(leaves, per_leaf)
                           for view, local in zip(views_, leaf.locals)])
        values = iter([_staged_value(leaf, views_) for leaf, views_ in zip(leaves, per_leaf)])
        staged.state = _rebuild(state_dict, "", values)
    except Exception as error:  # noqa: BLE001 - reported through the save's agreement, on every rank
        staged.release()
        staged.failure = f"{type(error).__name__}: {error}"
    return staged


# --- the writer ----------------------------------------------------------------------------------------------

# The commit protocol a job runs (_save.run_protocol, handed in by _save.save: this module does not import _save,
# which imports it): (state, target, ranks, staging_failure=, phase=).
Protocol = Callable[..., None]


@dataclasses.dataclass
class _Job:
    target: Path
    ranks: Ranks
    staged: _Staged
    handle: AsyncSave
    progress: _Progress
    timeout: timedelta
    protocol: Protocol

    def run(self) -> None:
        error: BaseException | None = None
        try:
            self.protocol(self.staged.state, self.target, self.ranks, staging_failure=self.staged.failure,
                          phase=self._enter)
        except CheckpointSaveError as failed:
            error = failed
        except BaseException as unexpected:  # noqa: BLE001 - the writer lives on; the handle tells
            error = CheckpointSaveError(
                f"shardkit checkpoint save (rank {self.ranks.rank}): the asynchronous save of {self.target} failed "
                f"({type(unexpected).__name__}: {unexpected}); whether it was committed, shardkit.checkpoint.verify "
                "tells")
            error.__cause__ = unexpected
        finally:
            self.staged.release()
        self.progress.finish(error)

    def _enter(self, phase: str) -> None:
        self.progress.status = phase


class _Writer:
    """The process's checkpoint writer: one daemon thread, saves one at a time in call order."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._current: _Job | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: _Job) -> None:
        with self._lock:
            ahead = self._queue[-1] if self._queue else self._current
            if ahead is not None:
                job.progress.status = f"waiting for the save of {ahead.target} to finish"
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="shardkit-checkpoint-writer", daemon=True)
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        _lower_this_threads_priority()
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                job = self._current = self._queue.popleft()
            try:
                job.run()
            finally:
                with self._lock:
                    self._current = None
                    self._lock.notify_all()

    def pending(self) -> list[_Job]:
        with self._lock:
            return ([self._current] if self._current is not None else []) + list(self._queue)

    def wait_idle(self, deadline_s: float) -> list[_Job]:
        """Waits until no save is in flight or queued, ``deadline_s`` seconds at most; returns those left."""
        end = time.monotonic() + deadline_s
        with self._lock:
            while (self._current is not None or self._queue) and time.monotonic() < end:
                self._lock.wait(min(1.0, max(0.0, end - time.monotonic())))
            return ([self._current] if self._current is not None else []) + list(self._queue)

    def forget(self) -> None:
        """In a forked child: the parent's thread and saves are not here."""
        self._lock = threading.Condition()
        self._queue.clear()
        self._current = None
        self._thread = None


def _lower_this_threads_priority() -> None:
    """The writer's CPU work (serializing, CRC32C, copying into the page cache) yields to training's threads where
    cores are short: on Linux a thread's nice value is its own (setpriority on its thread id). Where that cannot
    be done (another OS, a sandbox refusing it) the writer runs at the process's priority."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + _WRITER_NICE))
    except (AttributeError, OSError):
        pass


_WRITER = _Writer()
_AGREEMENT_GROUPS: dict[Any, Any] = {}  # training group -> the writer's gloo group
_EXIT_HANDLER_REGISTERED = False


def _after_fork_in_child() -> None:
    _WRITER.forget()
    _AGREEMENT_GROUPS.clear()
    _POOL.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def agreement_group(process_group: Any) -> Any:
    """The writer's gloo group for ``process_group`` (None: the default group), created here on first use: a
    collective call (dist.new_group) that every member makes at the same point, its first asynchronous save."""
    training = process_group if process_group is not None else _torch_compat.default_group()
    live = set(_torch_compat.live_process_groups())
    for stale in [g for g, mine in _AGREEMENT_GROUPS.items() if g not in live or mine not in live]:
        del _AGREEMENT_GROUPS[stale]  # destroyed since (destroy_process_group takes them all)
    group = _AGREEMENT_GROUPS.get(training)
    if group is None:
        group = dist.new_group(dist.get_process_group_ranks(training), backend="gloo",
                               timeout=_torch_compat.group_timeout(training), use_local_synchronization=True)
        _AGREEMENT_GROUPS[training] = group
    return group


def save_async(state_dict: dict[str, Any], target: Path, process_group: Any, protocol: Protocol) -> AsyncSave:
    """``save(..., async_save=True)``: stage, queue on the writer (which runs ``protocol`` on the staged copy),
    return the handle."""
    global _EXIT_HANDLER_REGISTERED
    foreground = Ranks(process_group)
    if foreground.distributed:
        group = agreement_group(process_group)
        ranks, timeout = Ranks(group), _torch_compat.group_timeout(group)
    else:
        ranks, timeout = foreground, dist.distributed_c10d.default_pg_timeout
    progress = _Progress()
    handle = AsyncSave(target, foreground.rank, progress)
    staged = stage(state_dict)
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_wait_at_exit)  # after torch's and shardkit's own: runs before them
        _EXIT_HANDLER_REGISTERED = True
    _WRITER.submit(_Job(target, ranks, staged, handle, progress, timeout, protocol))
    return handle


def pending_saves() -> list[AsyncSave]:
    """This process's asynchronous saves in flight or queued, oldest first."""
    return [job.handle for job in _WRITER.pending()]


def wait_for_writer(ranks: Ranks) -> None:
    """Before a synchronous save: waits for this process's asynchronous saves to end (their outcome stays with
    their handles), up to the process group's timeout for each; raises CheckpointSaveError where one is still
    running then."""
    jobs = _WRITER.pending()
    if not jobs:
        return
    seconds = sum(job.timeout.total_seconds() for job in jobs)
    left = _WRITER.wait_idle(seconds)
    if left:
        raise CheckpointSaveError(
            f"shardkit checkpoint save (rank {ranks.rank}): an asynchronous save is still in flight after "
            f"{seconds:.0f} s ({left[0].target}: {left[0].handle.status}); a synchronous save waits for it: "
            "nothing was saved")


def _wait_at_exit() -> None:
    """At the interpreter's exit: the saves in flight or queued get up to the agreement group's timeout."""
    jobs = _WRITER.pending()
    if not jobs:
        return
    seconds = max(job.timeout.total_seconds() for job in jobs)
    left = _WRITER.wait_idle(seconds)
    if left:
        warnings.warn(f"shardkit checkpoint: the process exits with {len(left)} asynchronous save(s) unfinished "
                      f"after waiting {seconds:.0f} s ({left[0].target}: {left[0].handle.status}); abandoned: the "
                      "previous checkpoint stays, and the next save removes what this one left", stacklevel=1)

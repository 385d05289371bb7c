"""shardkit under torchft: ``ProcessGroupShardkit``, torchft's reconfigurable process group on shardkit's backend.

    from shardkit.integrations.torchft import ProcessGroupShardkit

    manager = torchft.Manager(pg=ProcessGroupShardkit(timeout=timedelta(seconds=60)), ...)

torchft's Manager calls ``configure(store_addr, replica_id, rank, world_size, quorum_id, ...)`` for every new quorum
of replicas; each call ends the previous group and builds a new shardkit group of the quorum's replicas, through the
same start-up as ``dist.new_group`` (python/shardkit/_startup.py), over the quorum's own Store (the address torchft
gives, a fresh prefix per quorum): shared memory where the replicas share a host, shared memory inside each host and
gloo between hosts (rails or leaders, as on any shardkit group; ``SHARDKIT_HOST_ID`` tells hosts apart) where they do
not. ``comm=shardkit.Quantized(...)`` quantizes the bytes that cross between hosts, as on shardkit's own wrappers (the
same thread-local scope, put around every op here).

What it promises, beyond torchft's ``ProcessGroup`` interface:

- **Isolation.** The group is made *isolated* (``BackendConfig.isolated``): a failure in it (a replica died) stays in
  it. It neither aborts the process's other shardkit groups (the shard group of HSDP, a replica's own data-parallel
  group), as a failed shardkit group otherwise does, nor is aborted by theirs, and it records deaths only in the
  quorum's Store, never in the job's. torchft survives the failure: ``errored()`` reports it, the Manager skips the
  step and configures a new quorum.
- ``abort()`` ends the op in flight at once, on this rank and on its peers on the host (the shared segment's abort
  flag; peers elsewhere through the closed connections and the Store notice), with an error naming the quorum and the
  rank; sends and receives still waiting fail too. Then the group's threads end and it is dropped.
- ``errored()``: the error of the current group's first failed op (a ``RuntimeError`` with the backend's message,
  which names the op, its number and the ranks), after ``abort()`` the abort's until the next configure (as
  torchft's NCCL group), or None.
- ``shutdown()`` ends the group cleanly: queued ops finish (each within its deadline), its threads are joined.
- ``set_timeout()`` applies to the next ``configure`` (its Store and start-up) and, as every op's default deadline,
  to the current group's next ops. An op's own ``opts.timeout`` wins, as on any shardkit group.
- Nothing stays behind a group: no /dev/shm segment (named in the Store, unlinked once every local rank mapped it), no
  thread, no Store connection, whatever the number of configures. Except across hosts, where an op aborted while gloo
  runs it keeps its gloo backend for the process's life (gloo cannot cancel an op; docs/reliability.md).

Ops: every one torchft's Manager and its wrappers issue (allreduce with SUM, AVG and the other reductions,
allreduce_coalesced, allgather, allgather_into_tensor_coalesced, broadcast, reduce_scatter and
reduce_scatter_tensor_coalesced, which torchft's gloo group refuses, alltoall_base, barrier, send and recv), with
shardkit's semantics and errors. CPU tensors; CUDA tensors go where shardkit's backend sends them (its CUDA build's
route; a CPU build refuses them, saying so).

Why a subclass of torchft's ``ProcessGroupWrapper`` (as torchft's own ``ProcessGroupGloo``) rather than its base
``ProcessGroup``: the wrapper already is what torchft's Manager drives (configure's end-then-rebuild, the Store client
from the address, every op forwarded to the current group through ``_run_context``, where the quantization scope
goes); only the group's construction and ending are shardkit's.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BarrierOptions

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("shardkit.integrations.torchft needs torchft (pip install torchft); it was tested with "
                      "torchft 0.2.0") from error

from .. import _C, _startup, _torch_compat
from ..quantized import Quantized, check_group, inter_host_format
from ._torchft_transport import CheckpointTransferError, ChecksummedTransport

__all__ = ["CheckpointTransferError", "ChecksummedTransport", "ProcessGroupShardkit"]

BACKEND_NAME = "torchft-shardkit"
_GROUP_NUMBERS = itertools.count()  # every group this process makes gets its own id (its records, its segment name)


class _Quorum:
    """One configured group: its backend, what names it, and why it ended (set by abort)."""

    def __init__(self, backend: _C.ProcessGroupShardkit, group: dist.ProcessGroup, group_id: str,
                 quorum_id: int | None, rank: int) -> None:
        self.backend = backend
        self.group = group
        self.group_id = group_id
        self.quorum_id = quorum_id
        self.rank = rank
        self.aborted: str | None = None  # the abort's reason
        self.failure: Exception | None = None  # a failed send or receive (collectives: backend.first_failure())
        self.lock = threading.Lock()

    def record(self, error: Exception) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = error


class _PointToPointWork(dist.Work):
    """A send's or receive's Work (gloo's, inside the shardkit backend) that raises where gloo's returns False: an
    abort wakes a waiting gloo send or receive, which then reports only that it did not complete."""

    def __init__(self, work: dist.Work, quorum: _Quorum, what: str) -> None:
        super().__init__()
        self.work = work
        self.quorum = quorum
        self.what = what

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            done = self.work.wait() if timeout is None else self.work.wait(timeout)
        except Exception as error:
            self.quorum.record(error)
            raise
        if not done:
            why = self.quorum.aborted or "it was aborted"
            failure = RuntimeError(f"torchft-shardkit (rank {self.quorum.rank}, quorum {self.quorum.quorum_id}): "
                                   f"{self.what} did not complete: {why}")
            self.quorum.record(failure)
            raise failure
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.work.get_future()


class ProcessGroupShardkit(ProcessGroupWrapper):
    """torchft's reconfigurable process group on shardkit's backend (see the module docstring).

    ``timeout``: the Store's and the start-up's timeout at each configure, and the ops' default deadline.
    ``comm``: ``shardkit.Quantized(...)`` for the bytes that cross between hosts (None: exact)."""

    # Whether the groups it makes are isolated (BackendConfig.isolated). Always, but for the test that shows what
    # isolation prevents (tests/python/test_torchft_process_group.py).
    _isolated = True
    _pg: Any  # torchft's: the current group (a torch ProcessGroup), or None

    def __init__(self, timeout: timedelta = timedelta(seconds=60), *, comm: Quantized | None = None) -> None:
        super().__init__(timeout=timeout)
        if comm is not None and not isinstance(comm, Quantized):
            raise TypeError(f"ProcessGroupShardkit: comm must be a shardkit.Quantized or None, got {comm!r}")
        self._comm = comm
        self._quorum: _Quorum | None = None
        self._aborted_error: Exception | None = None  # what errored() says after abort(), until the next configure
        self._swap = threading.Lock()  # abort() may come from another thread (torchft's timeouts): see abort()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # --- the group's life ---------------------------------------------------------------------------------------
    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        """A new isolated shardkit group of the quorum (ProcessGroupWrapper.configure has ended the old one)."""
        group_id = f"torchft_q{self._quorum_id}_{next(_GROUP_NUMBERS)}"
        given = list(self._global_ranks or [])
        global_ranks = given if len(given) == world_size else list(range(world_size))
        options = _torch_compat.backend_options(store, rank, world_size, self._timeout, group_id, global_ranks)
        devices = ["cpu", "cuda"] if torch.version.cuda is not None else ["cpu"]
        try:
            backend = _startup.create_backend(options, None, isolated=self._isolated)
            group = _torch_compat.process_group_over(backend, store, rank, world_size, group_id, devices)
        except BaseException:
            _startup.forget_group(group_id)  # what a failed start-up recorded (its host topology, gloo Stores)
            raise
        with self._swap:
            self._quorum = _Quorum(backend, group, group_id, self._quorum_id, rank)
            self._aborted_error = None
        if self._comm is not None:
            check_group(self._comm, group, "ProcessGroupShardkit")
        return group

    def abort(self, errored: bool = True) -> None:
        """Ends the current group now: its op in flight (and every later one) fails with an error naming the quorum
        and this rank, its threads end, and it is dropped; errored() reports the abort until the next configure
        (as torchft's NCCL group does). Idempotent.

        Safe from another thread than the ops' (torchft's timeouts abort from a timer): it ends the group that is
        current when it is called, and only that one, even while a configure replaces it."""
        with self._swap:
            quorum, self._quorum = self._quorum, None
            if quorum is not None and self._pg is quorum.group:
                self._pg = None
        if quorum is None:
            return
        quorum.aborted = (f"torchft-shardkit: the process group of quorum {quorum.quorum_id} was aborted by rank "
                          f"{quorum.rank} (replica {self._replica_id})")
        if errored:
            self._aborted_error = RuntimeError(quorum.aborted)
            # torchft's structured error log, as its own groups write it
            self.errors_logger.info("", extra={"job_id": os.environ.get("JOB_ID", "unknown"),
                                               "replica_id": self._replica_id, "rank": self._rank,
                                               "quorum_id": quorum.quorum_id, "error": "process_group_abort"})
        quorum.backend.abort_with(quorum.aborted)
        quorum.backend.shutdown_now()
        _startup.forget_group(quorum.group_id)

    def shutdown(self) -> None:
        """Ends the current group cleanly: queued ops finish (each within its deadline), its threads are joined."""
        with self._swap:
            quorum, self._quorum = self._quorum, None
            if quorum is not None and self._pg is quorum.group:
                self._pg = None
        if quorum is not None:
            quorum.backend.shutdown_now()
            _startup.forget_group(quorum.group_id)

    def errored(self) -> Exception | None:
        """The current group's first failure (an op that failed: a RuntimeError with the backend's message), the
        abort's after abort(), or None."""
        quorum = self._quorum
        if quorum is None:
            return self._aborted_error
        failure = quorum.backend.first_failure()
        if failure is not None:
            return RuntimeError(failure)
        return quorum.failure

    def set_timeout(self, timeout: timedelta) -> None:
        """The next configure's timeout, and the current group's default op deadline from its next op on."""
        super().set_timeout(timeout)
        quorum = self._quorum
        if quorum is not None:
            quorum.backend.set_timeout(timeout)

    # --- ops ----------------------------------------------------------------------------------------------------
    @contextmanager
    def _run_context(self) -> Generator[None, None, None]:
        with inter_host_format(self._comm):  # the op captures the scope as it is issued
            yield

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:
        return super().barrier(opts if opts is not None else BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        quorum = self._current("send")
        return _PointToPointWork(super().send(tensors, dst_rank, tag), quorum, f"send to rank {dst_rank}")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        quorum = self._current("recv")
        return _PointToPointWork(super().recv(tensors, src_rank, tag), quorum, f"recv from rank {src_rank}")

    def _current(self, op: str) -> _Quorum:
        quorum = self._quorum
        if quorum is None:
            raise RuntimeError(f"torchft-shardkit: {op} on a process group that is not configured (configure() first, "
                               "or it was aborted or shut down)")
        return quorum

"""A shardkit group's start-up, bounded: a rank that fails or dies in it makes every peer raise within about a
second, naming it and the reason, instead of waiting out the group's timeout (30 minutes by default).

The start-up (``backend._create_backend``) talks through the group's c10d Store:

- ``shardkit/host/<r>``: group rank ``r`` writes ``"<pid> <host id>"`` first thing, then reads every rank's. From
  here on each rank knows its peers' pids, and watches those on its own host (``_C.process_exited``).
- ``shardkit/shm_name/<h>``: host ``h``'s segment name, drawn by its first rank.
- gloo's own rendezvous (the inner backends), through :class:`WatchedStore`.
- the C++ constructor: the segment's attach protocol and first sync, which watch the same pids and the notice.
- ``shardkit/abort`` (``_C.ABORT_KEY``): the notice. A rank that fails anywhere above, or sees a peer on its host
  exit, writes why (the first writer wins); every wait polls it. So a failure on one host reaches the others.

Every wait polls: the key it waits for, the notice, the pids it watches, and the group's deadline. A rank that
dies before writing its own host key cannot be told from one that is slow to start; that wait ends at the
deadline, as torch's own rendezvous does.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _C

_POLL_FIRST = 0.0005  # seconds between polls at first; doubling up to _POLL_MOST
_POLL_MOST = 0.02


class StartupFailed(RuntimeError):
    """The start-up of a shardkit group failed on this rank or another; the message names which and why."""


class StartupWatch:
    """Every wait of one group's start-up on one rank (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, global_ranks: list[int], timeout: timedelta) -> None:
        self.store = store
        self.rank = rank
        self.global_ranks = global_ranks
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.timeout = timeout
        self.pids: dict[int, int] = {}  # group rank -> pid, as read
        self.hosts: dict[int, str] = {}  # group rank -> host id, as read
        self.finished = False  # once the group exists, WatchedStore stops watching

    def name(self, r: int) -> int:
        return self.global_ranks[r]

    def where(self) -> str:
        return f"shardkit start-up (rank {self.name(self.rank)})"

    # --- waits --------------------------------------------------------------------------------------------
    def wait_for(self, keys: list[str], waiting_for: str, store: dist.Store | None = None) -> None:
        """Returns once every key is set in ``store`` (default: the group's); raises StartupFailed on a notice, a
        local peer's death or the deadline."""
        store = store if store is not None else self.store
        pause = _POLL_FIRST
        while not store.check(keys):
            self.check(waiting_for)
            if time.monotonic() > self.deadline:
                raise StartupFailed(f"{self.where()}: timed out after {self.timeout.total_seconds():.0f} s "
                                    f"{waiting_for}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MOST)

    def get(self, key: str, waiting_for: str) -> bytes:
        self.wait_for([key], waiting_for)
        return self.store.get(key)

    def check(self, waiting_for: str) -> None:
        """Raises StartupFailed if another rank wrote the notice, or a watched peer on this host has exited."""
        if self.store.check([_C.ABORT_KEY]):
            notice = self.store.get(_C.ABORT_KEY).decode(errors="replace")
            raise StartupFailed(f"{self.where()}: the group's start-up failed: {notice}")
        me = self.hosts.get(self.rank)
        dead = [r for r, pid in self.pids.items()
                if r != self.rank and self.hosts.get(r) == me and _C.process_exited(pid)]
        if dead:
            named = ", ".join(f"{self.name(r)} (pid {self.pids[r]})" for r in dead)
            raise StartupFailed(self.publish(f"{self.where()}: rank(s) {named} exited during start-up, while "
                                             f"{waiting_for}"))

    # --- the notice -----------------------------------------------------------------------------------------
    def publish(self, reason: str) -> str:
        """Writes ``reason`` as the group's notice unless one is there; returns the notice that stands."""
        try:
            return self.store.compare_set(_C.ABORT_KEY, "", reason).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the Store may be gone with the rank that hosted it
            return reason

    def failed(self, error: BaseException) -> BaseException:
        """What to raise for ``error`` that ended this rank's start-up: published first, so peers stop waiting.
        This rank's own error as it is where it was the first failure; else the first, naming its rank."""
        if isinstance(error, StartupFailed):
            return error  # published already, or read from the notice
        text = str(error)
        # The C++ start-up's errors name this rank already ("shardkit shm (rank 3): ...").
        mine = text if text.startswith("shardkit") else f"{self.where()}: {type(error).__name__}: {text}"
        first = self.publish(mine)
        if first == mine:
            return error
        return StartupFailed(f"{self.where()}: the group's start-up failed: {first}")

    # --- the host exchange ------------------------------------------------------------------------------------
    def exchange_hosts(self, host: str, size: int) -> list[str]:
        """Every rank's host id (and pid, kept for watching and for messages); this rank's first."""
        self.store.set(f"shardkit/host/{self.rank}", f"{os.getpid()} {host}")
        self.pids[self.rank], self.hosts[self.rank] = os.getpid(), host
        for r in range(size):
            pid, _, their_host = self.get(f"shardkit/host/{r}", f"waiting for rank {self.name(r)} to start").decode() \
                .partition(" ")
            self.pids[r], self.hosts[r] = int(pid), their_host
        return [self.hosts[r] for r in range(size)]


class WatchedStore(dist.Store):
    """A Store whose blocking reads poll the start-up watch: gloo's rendezvous, which waits on the Store for every
    peer's address, ends with the notice or a local death like the start-up's own waits. Once the group exists
    (``watch.finished``) it is a plain proxy."""

    def __init__(self, inner: dist.Store, watch: StartupWatch, what: str) -> None:
        super().__init__()
        self._inner, self._watch, self._what = inner, watch, what

    def _await(self, keys: list[str]) -> None:
        if not self._watch.finished:
            self._watch.wait_for(keys, f"connecting {self._what}", self._inner)

    def get(self, key: str) -> bytes:
        self._await([key])
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._await(keys)
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

"""Start-ups that read only their own entries of a Store that outlives them: the attempt scope.

Why: ``torchrun`` (its c10d rendezvous, ``--standalone`` included) hosts ONE TCPStore in the agent and hands it to
every restart round (torch's ``dynamic_rendezvous.py``: ``use_agent_store`` unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and the workers' ``env://`` rendezvous connects to it with no per-attempt
prefix (``rendezvous.py``: "We create a new TCPStore for every retry so no need to add prefix for each attempt",
which the shared store made untrue). So after a restart every key the killed attempt wrote is still there, under the
same names: a start-up that reads a peer's entry may read the dead attempt's (its pid, its gloo listener's address,
its failure notice) before the live peer has written its own.

The scope: each start-up on a Store first agrees, among the group's ranks, a generation number ``g`` no start-up on
that Store has used before, and then reads and writes only under ``shardkit/attempt/<g>/``. The agreement itself
reads nothing it cannot tell apart from a stale entry:

- group rank 0 draws ``g = store.add("shardkit/attempt/count", 1)`` (a counter: new on every call);
- every other rank ``r`` writes a fresh random nonce ``n`` to ``shardkit/attempt/ask/<r>`` and waits for
  ``shardkit/attempt/answer/<n>`` (a key nobody wrote before: the nonce is new), which holds ``g``; then it writes
  ``shardkit/attempt/<g>/joined/<r>``;
- rank 0 answers every nonce it reads under ``ask/<r>`` (a dead attempt's stale nonce gets an answer nobody waits
  for) until every rank has joined ``g``.

It needs nothing from the environment, so it holds where ``TORCHELASTIC_RESTART_COUNT`` would not: on several
nodes, torchrun's healthy agents restart their workers for a new round without counting a restart, so the count
differs between nodes. It also holds for a group made again on the same Store, and costs a few Store round trips.
A rank that dies during the agreement cannot be told from a slow one: that wait ends at the deadline.

:func:`attempt_store` gives the same scope to torch's own backends (gloo, nccl), whose rendezvous reads a killed
attempt's listener addresses from torchrun's shared Store (``Gloo connectFullMesh failed ... Connection refused``)::

    store, rank, world_size = shardkit.attempt_store()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_ROOT = "shardkit/attempt"
_FIRST_POLL = 0.0005  # seconds; doubled after each empty poll
_SLICE = 0.05  # seconds between polls at most
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default process-group timeout


class AttemptAgreementFailed(RuntimeError):
    """The ranks of a start-up did not agree an attempt scope within the deadline; the message names who waited."""


def _poll(done: Callable[[], bool], deadline: float, timed_out: Callable[[], str]) -> None:
    """Calls ``done`` until it returns True, pausing from _FIRST_POLL doubling up to _SLICE between calls; raises
    AttemptAgreementFailed with ``timed_out()`` once ``deadline`` (time.monotonic()) has passed."""
    pause = _FIRST_POLL
    while not done():
        if time.monotonic() > deadline:
            raise AttemptAgreementFailed(timed_out())
        time.sleep(pause)
        pause = min(2 * pause, _SLICE)


def agree_generation(store: dist.Store, rank: int, size: int, timeout: timedelta, where: str) -> int:
    """The generation number this start-up's ranks agree on ``store`` (new on that Store; see the module
    docstring). ``where`` names the rank in errors."""
    deadline = time.monotonic() + timeout.total_seconds()
    seconds = f"{timeout.total_seconds():.0f} s"
    if rank == 0:
        generation = store.add(f"{_ROOT}/count", 1)
        pending = set(range(1, size))
        answered: set[bytes] = set()

        def everyone_joined() -> bool:
            """Answers every rank's nonce not answered yet (a dead attempt's stale one gets an answer nobody waits
            for); True once every rank has joined ``generation``."""
            for r in sorted(pending):
                if store.check([f"{_ROOT}/{generation}/joined/{r}"]):
                    pending.discard(r)
                    continue
                ask = f"{_ROOT}/ask/{r}"
                if store.check([ask]):
                    nonce = store.get(ask)
                    if nonce not in answered:
                        store.set(f"{_ROOT}/answer/{nonce.decode()}", str(generation))
                        answered.add(nonce)
            return not pending

        _poll(everyone_joined, deadline,
              lambda: f"{where}: timed out after {seconds} waiting for group rank(s) "
                      f"{', '.join(map(str, sorted(pending)))} to join the start-up (attempt generation {generation})")
        return generation
    nonce = secrets.token_hex(12)
    store.set(f"{_ROOT}/ask/{rank}", nonce)
    answer = f"{_ROOT}/answer/{nonce}"
    _poll(lambda: store.check([answer]), deadline,
          lambda: f"{where}: timed out after {seconds} waiting for group rank 0 to start (the start-up's attempt "
                  "agreement)")
    generation = int(store.get(answer))
    store.set(f"{_ROOT}/{generation}/joined/{rank}", "1")
    return generation


def scope(store: dist.Store, generation: int) -> dist.PrefixStore:
    """``store`` seen through generation ``generation``'s prefix."""
    return dist.PrefixStore(f"{_ROOT}/{generation}", store)


def scoped_store(store: dist.Store, rank: int, size: int, timeout: timedelta, where: str
                 ) -> tuple[dist.PrefixStore, int]:
    """``store`` scoped to a generation agreed now by ``size`` ranks, and that generation."""
    generation = agree_generation(store, rank, size, timeout, where)
    return scope(store, generation), generation


def attempt_store(store: dist.Store | None = None, rank: int | None = None, world_size: int | None = None,
                  timeout: timedelta = _DEFAULT_TIMEOUT) -> tuple[dist.Store, int, int]:
    """A Store for ``dist.init_process_group(backend, store=..., rank=..., world_size=...)`` that a restarted attempt
    under torchrun shares with no earlier attempt, and the rank and world size to pass with it.

    For torch's own backends: torchrun keeps one TCPStore across restarts, and their rendezvous reads a killed
    attempt's entries from it (see this module's docstring). Tested with gloo (tests/python/test_restarts.py); nccl
    exchanges its unique id through the same Store, and is not tested here. The shardkit backend needs none of this: its
    start-up scopes itself. Without arguments, ``env://``'s rendezvous as torchrun sets it up (MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE); else the Store given, with ``rank`` and ``world_size`` (both required then).
    Every rank must call it, once per group it makes this way; it returns once all have."""
    if store is None:
        if rank is not None or world_size is not None:
            raise ValueError("shardkit.attempt_store: rank and world_size come from env:// when no store is given; "
                             f"got rank={rank!r}, world_size={world_size!r}")
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
    elif rank is None or world_size is None:
        raise ValueError(f"shardkit.attempt_store: a store needs rank and world_size, got rank={rank!r}, "
                         f"world_size={world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"shardkit.attempt_store: rank {rank} is not in a world of size {world_size}")
    scoped, _ = scoped_store(store, rank, world_size, timeout, f"shardkit.attempt_store (rank {rank})")
    return scoped, rank, world_size

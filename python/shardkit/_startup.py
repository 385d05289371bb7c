"""A shardkit group's start-up: what ``dist.init_process_group("shardkit")`` (and every ``new_group`` on the backend)
runs once per group, through :func:`create_backend`, the creator torch calls. It groups the ranks by host through the
group's Store (``_topology.py`` keeps the result), agrees one shared-memory segment name per host, builds the inner
gloo backends (all ranks: point-to-point and non-hierarchical ops across hosts; host leaders, or every rank's rail:
the inter-host step of hierarchical ops), and constructs the C++ ``ProcessGroupShardkit``.

It promises a bounded start-up: a rank that fails or dies in it makes every peer raise within about a second, naming
it and the reason, instead of waiting out the group's timeout (30 minutes by default); and a group that starts on
every rank or on none.

The start-up talks through the group's c10d Store, and only through its own scope of it: first the group's ranks agree
a generation number no start-up on that Store used before (``_attempt.py``: under ``shardkit/attempt/``), then every
key below lives under ``shardkit/attempt/<generation>/``, and that scoped Store is what the inner gloo backends'
rendezvous, the C++ backend (its failure notices) and, for the default group, the job's death records get. Why:
torchrun keeps one TCPStore across its restarts, holding every key a killed attempt wrote (its pids, its segment's
name, its notice, gloo's addresses); unscoped, a restarted start-up read them and failed on the dead attempt's pids or
listeners. The keys, within the scope:

- ``shardkit/host/<r>``: group rank ``r`` writes ``"<pid> <pid namespace> <host id>"`` first thing, then reads
  every rank's. From here on each rank knows its peers' pids, and watches those on its own host that share its pid
  namespace (``_C.process_exited``; a container sharing the host's /dev/shm but not its pids is not watched).
- ``shardkit/shm_name/<h>``: host ``h``'s segment name, drawn by its first rank. Before drawing it, that rank removes
  any segment named by the last few earlier scopes that is still in /dev/shm (``_remove_stale_segments``: an attempt
  killed between a segment's creation and its last attach leaves it, with nobody left to remove it).
- ``shardkit/inter_host_scheme``: where the group spans hosts, rank 0's SHARDKIT_INTER_HOST (rails or leaders).
- gloo's own rendezvous (the inner backends), through :class:`WatchedStore`.
- the C++ constructor: the segment's attach protocol and first sync, which watch the same pids and the notice.
- ``shardkit/connected``: every rank passes together once its gloo backends are connected, before anything that may
  fail on purpose (a peer still connecting to a rank that gave up would wait out gloo's retries: ``all_connected``).
- ``shardkit/started``: the end, which every rank passes together: a group starts on every rank or on none.
- ``shardkit/abort`` (``_C.ABORT_KEY``): the notice. A rank that fails anywhere above, or sees a peer on its host
  exit, writes why (the first writer wins); every wait polls it. So a failure on one host reaches the others.

Every wait polls the Store for its keys (``check``: one round trip that never waits on the server), sleeping between
polls from ``_FIRST_POLL`` up to ``_SLICE`` seconds, and between polls looks at the pids it watches, the notice and
the group's deadline. It never lets a Store wait time out: torch's TCPStore client logs a warning for each timed-out
wait (``[c10d] waitForInput: poll for socket ... timed out``), which a start-up in slices printed once per empty slice
on every rank. A rank that dies before writing its own host key cannot be told from one that is slow to start; that
wait ends at the deadline, as torch's own rendezvous does; so does one that dies in the generation agreement, which
comes before the pids are known.

Environment:
  SHARDKIT_SHM_SLOT_BYTES   bytes per rank and buffer in the shared segment (default 1 MiB); collectives
                            of any size are chunked through it.
  SHARDKIT_SHM_TAG          a label put into the shared-memory segment names (letters, digits, '_'), so
                            that a job's segments can be told apart in /dev/shm (the test suite uses it).
  SHARDKIT_P2P_DIRECT_BYTES the smallest send/recv between two ranks of one host that the receiver reads from
                            the sender's memory (default 2 MiB; csrc/comm/local_p2p.h); the same on every rank.
  SHARDKIT_P2P_DIRECT_READ  0: those messages' bytes come over gloo after the descriptor (default 1).
  (SHARDKIT_HOST_ID and SHARDKIT_INTER_HOST: see _topology.py.)
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _C, _attempt, _topology, _torch_compat
from ._group_backend import cpu_backend

_SLICE = 0.2  # seconds between polls at most: a death is seen within about this (plus the Store's round trip)
_FIRST_POLL = 0.0005  # seconds; doubled after each empty poll, so a key set at once costs a fraction of a slice
_EXPLAIN_WITHIN = 1.0  # seconds a failed connection waits for its cause to show
_GLOO_CONNECT = timedelta(seconds=2)  # gloo's pair connects, once every address is known (see connect_gloo)


def _pid_namespace() -> str:
    """This process's pid namespace ("" where /proc cannot tell): pids mean the same only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


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
        self.namespaces: dict[int, str] = {}  # group rank -> pid namespace, as read
        self.finished = False  # once the group exists, WatchedStore stops watching
        # The WatchedStores gloo's rendezvous went through: gloo may use its Store again later (TORCH_GLOO_LAZY_INIT
        # connects at the first op), and a Python Store whose object is gone cannot answer. Kept with the group.
        self.kept_stores: list[dist.Store] = []
        self.segment_name: str | None = None  # this host's segment, once agreed
        self.generation = 0  # the start-up's attempt scope (_attempt.py); `store` is seen through it
        self.unscoped_store: dist.Store = store  # the Store as torch gave it: earlier start-ups' scopes are there

    def name(self, r: int) -> int:
        return self.global_ranks[r]

    def where(self) -> str:
        return f"shardkit start-up (rank {self.name(self.rank)})"

    # --- waits --------------------------------------------------------------------------------------------
    def wait_for(self, keys: list[str], waiting_for: str, store: dist.Store | None = None) -> None:
        """Returns once every key is set in ``store`` (default: the group's); raises StartupFailed on a notice, a
        local peer's death or the deadline."""
        store = store if store is not None else self.store
        pause = _FIRST_POLL
        while not store.check(keys):
            self.check(waiting_for)
            if time.monotonic() > self.deadline:
                raise StartupFailed(f"{self.where()}: timed out after {self.timeout.total_seconds():.0f} s "
                                    f"{waiting_for}")
            time.sleep(pause)
            pause = min(2 * pause, _SLICE)

    def get(self, key: str, waiting_for: str) -> bytes:
        self.wait_for([key], waiting_for)
        return self.store.get(key)

    def check(self, waiting_for: str) -> None:
        """Raises StartupFailed if another rank wrote the notice, or a watched peer on this host has exited."""
        if self.store.check([_C.ABORT_KEY]):
            notice = self.store.get(_C.ABORT_KEY).decode(errors="replace")
            raise StartupFailed(f"{self.where()}: the group's start-up failed: {notice}")
        dead = [r for r, pid in self.watched().items() if _C.process_exited(pid)]
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

    def explain(self, error: Exception, doing: str) -> Exception:
        """The cause of ``error``, a connection that failed while ``doing`` (gloo's rendezvous): a watched peer's
        death or the notice, where either shows within _EXPLAIN_WITHIN seconds (a killed peer's sockets close a
        moment before its pid reads as gone); else ``error`` itself."""
        deadline = time.monotonic() + _EXPLAIN_WITHIN
        while True:
            try:
                self.check(doing)
            except StartupFailed as cause:
                return cause
            if time.monotonic() >= deadline:
                return error
            time.sleep(0.02)

    def all_reached(self, stage: str, size: int, waiting_for: str) -> None:
        """Returns once every rank of the group has reached ``stage``; raises StartupFailed, as every wait here,
        where one failed or died on the way. A counter per stage, and the key its last rank sets for the n-th
        start-up on this Store (a group re-made on it counts on)."""
        count = self.store.add(f"shardkit/{stage}", 1)
        generation = (count - 1) // size
        if count % size == 0:
            self.store.set(f"shardkit/{stage}/all/{generation}", "1")
        self.wait_for([f"shardkit/{stage}/all/{generation}"], waiting_for)

    def all_connected(self, size: int) -> None:
        """Every rank has its gloo backends connected. Until then no rank may fail on purpose: gloo connects each
        pair with retries that nothing can interrupt, so a peer that gave up (the notice) while this rank still
        connects to it would hold this rank there ~10 s before its error shows (seen in CI: a /dev/shm without room
        failed rank 0 in the segment's creation while rank 1 was still connecting to rank 3, which had read the
        notice and left)."""
        self.all_reached("connected", size, "waiting for every rank to connect its gloo backends")

    def all_started(self, size: int) -> None:
        """The start-up's end: returns once every rank of the group has reached it (a group half started on some
        hosts would leave their ranks to learn of it only at their first collective)."""
        self.all_reached("started", size, "waiting for every rank to finish its start-up")

    def watched(self) -> dict[int, int]:
        """{group rank: pid} of the peers read so far whose pids this rank can watch: on its host, in its pid
        namespace."""
        return {r: pid for r, pid in self.pids.items()
                if r != self.rank and self.hosts.get(r) == self.hosts[self.rank]
                and self.namespaces.get(r) == self.namespaces[self.rank]}

    def pids_to_watch(self) -> list[int]:
        """Every group rank's pid as the C++ start-up and liveness checks take them: the pid, or -1 (never watched)
        for a peer on this host in another pid namespace. Other hosts' pids only name their ranks in messages."""
        return [-1 if self.hosts[r] == self.hosts[self.rank] and self.namespaces[r] != self.namespaces[self.rank]
                else self.pids[r] for r in range(len(self.pids))]

    def failed(self, error: BaseException) -> BaseException:
        """What to raise for ``error`` that ended this rank's start-up: published first, so peers stop waiting.
        This rank's own error as it is where it was the first failure; else the first, naming its rank. (A caller
        raises an interrupt, KeyboardInterrupt or SystemExit, as it is: it only publishes it.)"""
        if self.segment_name is not None:
            # The host's creator may have made the segment and died, or be about to give up: the start-up failed
            # for every rank, and whoever knows the name removes it (nothing may stay in /dev/shm).
            _C.remove_segment_name(self.segment_name)
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
        namespace = _pid_namespace().replace(" ", "_")
        self.store.set(f"shardkit/host/{self.rank}", f"{os.getpid()} {namespace or '-'} {host}")
        self.pids[self.rank], self.namespaces[self.rank], self.hosts[self.rank] = os.getpid(), namespace or "-", host
        for r in range(size):
            pid, their_namespace, their_host = self.get(
                f"shardkit/host/{r}", f"waiting for rank {self.name(r)} to start").decode().split(" ", 2)
            self.pids[r], self.namespaces[r], self.hosts[r] = int(pid), their_namespace, their_host
        return [self.hosts[r] for r in range(size)]


def connect_gloo(watch: StartupWatch, store: dist.Store, rank: int, size: int, timeout: timedelta, what: str
                 ) -> dist.ProcessGroupGloo:
    """A gloo backend whose rendezvous goes through a WatchedStore of ``store``; a failed connection is reported by
    its cause where one shows (StartupWatch.explain). Returns the backend and keeps the Store for its life.

    Once every peer's address is in the Store, gloo connects to each peer's listener, retrying for as long as its
    timeout, where nothing else can interrupt it: a peer that gave up meanwhile (its listener gone) would hold this
    rank there for the group's whole timeout. So it connects with _GLOO_CONNECT at most (a live listener answers in
    milliseconds), and gets the group's timeout for its operations afterwards (where this torch can set it). torch
    retries a failed connect a few times, each up to that timeout: a peer that dies inside this window of a few
    milliseconds is reported after ~10 s rather than within a second."""
    watched = WatchedStore(store, watch, what)
    settable = _torch_compat.gloo_timeout_settable()
    try:
        backend = dist.ProcessGroupGloo(watched, rank, size, min(timeout, _GLOO_CONNECT) if settable else timeout)
    except RuntimeError as error:
        raise watch.explain(error, f"connecting {what}") from error
    if settable:
        _torch_compat.set_gloo_timeout(backend, timeout)
    watch.kept_stores.append(watched)
    return backend


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


# --- the creator: what init_process_group runs for each shardkit group -------------------------------------------
_DEFAULT_SLOT_BYTES = 1 << 20
# The smallest point-to-point message between ranks of one host that takes the direct route (local_p2p.h).
_DEFAULT_P2P_DIRECT_BYTES = 2 << 20
# How many earlier start-ups on a group's Store a host's first rank looks at for segments left in /dev/shm
# (_remove_stale_segments): a run of attempts each killed before it got that far would need more.
_SWEPT_GENERATIONS = 8
# The Stores each group's gloo rendezvous went through (start-up watch wrappers, by group name): kept for the
# group's life, since gloo may use its Store again later (TORCH_GLOO_LAZY_INIT connects at the first op), and a
# Python Store whose object is gone cannot answer it.
_GLOO_STORES: dict[str, list[dist.Store]] = {}


def _positive_env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _slot_bytes() -> int:
    return _positive_env_int("SHARDKIT_SHM_SLOT_BYTES", _DEFAULT_SLOT_BYTES)


def _p2p_settings() -> tuple[int, bool]:
    """SHARDKIT_P2P_DIRECT_BYTES (the smallest send/recv between ranks of one host that the receiver reads from the
    sender's memory; every rank must use the same) and SHARDKIT_P2P_DIRECT_READ (0: such messages' bytes come
    over gloo instead), see csrc/comm/local_p2p.h."""
    threshold = _positive_env_int("SHARDKIT_P2P_DIRECT_BYTES", _DEFAULT_P2P_DIRECT_BYTES)
    read = os.environ.get("SHARDKIT_P2P_DIRECT_READ", "1").strip()
    if read not in ("0", "1"):
        raise ValueError(f"SHARDKIT_P2P_DIRECT_READ must be 0 or 1, got {read!r}")
    return threshold, read == "1"


def _name_part(text: str, limit: int) -> str:
    """`text` made safe for a shared-memory segment name: letters, digits and '_', at most `limit` chars."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in text)[:limit]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _agree_inter_host_scheme(watch: StartupWatch, rank: int) -> str:
    """SHARDKIT_INTER_HOST as rank 0 reads it (every rank must build the same inter-host groups)."""
    key = "shardkit/inter_host_scheme"
    if rank == 0:
        scheme = _topology.requested_inter_host_scheme()
        watch.store.set(key, scheme)
        return scheme
    return watch.get(key, "waiting for rank 0 to say how collectives cross hosts").decode()


def _agree_p2p_direct_bytes(watch: StartupWatch, rank: int, mine: int) -> None:
    """Every rank must route a message alike (csrc/comm/local_p2p.h): SHARDKIT_P2P_DIRECT_BYTES compared with rank
    0's."""
    key = "shardkit/p2p_direct_bytes"
    if rank == 0:
        watch.store.set(key, str(mine))
        return
    theirs = int(watch.get(key, "waiting for rank 0's SHARDKIT_P2P_DIRECT_BYTES").decode())
    if theirs != mine:
        raise ValueError(f"{watch.where()}: SHARDKIT_P2P_DIRECT_BYTES is {mine} here but {theirs} on rank "
                         f"{watch.name(0)}: every rank must use the same (a send/recv's route depends on it)")


def _agree_segment_name(watch: StartupWatch, local_rank: int, host_index: int, group_id: str) -> str:
    """Each host's first rank draws a name unique to this job, group and host; its peers read it."""
    key = f"shardkit/shm_name/{host_index}"
    if local_rank == 0:
        tag = _name_part(os.environ.get("SHARDKIT_SHM_TAG", ""), 32)
        name = (f"/shardkit-{tag + '-' if tag else ''}{os.getpid()}-{secrets.token_hex(6)}-"
                f"{group_id or 'default'}-h{host_index}")
        watch.store.set(key, name)
        return name
    return watch.get(key, "waiting for the host's first rank to name the shared-memory segment").decode()


def create_backend(options: _torch_compat.BackendOptions, pg_options, *, isolated: bool = False
                   ) -> _C.ProcessGroupShardkit:
    """The creator registered with torch (backend.register_backend): the group's backend, or on every rank the
    error of the rank that failed first (StartupWatch.failed).

    ``isolated`` (never from torch; shardkit's torchft process group passes it): a group whose failures stay its
    own (``BackendConfig.isolated``): it records deaths in its own Store only, not the job's, and neither aborts
    the process's other groups when it fails nor is aborted by theirs."""
    if pg_options is not None:
        raise ValueError(f"the shardkit backend takes no pg_options, got {pg_options!r}")
    store, rank, size = options.store, options.group_rank, options.group_size
    timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(seconds=options.timeout)
    # The default group is told no ranks: its ranks are the job's.
    global_ranks = list(options.global_ranks_in_group) or list(range(size))
    # Everything below reads and writes only this start-up's scope of the Store (_attempt.py: torchrun's Store
    # outlives a killed attempt, and holds its entries).
    try:
        store, generation = _attempt.scoped_store(store, rank, size, timeout,
                                                  f"shardkit start-up (rank {global_ranks[rank]})")
    except _attempt.AttemptAgreementFailed as error:
        raise StartupFailed(str(error)) from error
    watch = StartupWatch(store, rank, global_ranks, timeout)
    watch.generation = generation
    watch.unscoped_store = options.store
    try:
        backend = _start(options, watch, global_ranks, timeout, isolated)
    except Exception as error:  # whatever ends the start-up, the peers must hear of it
        raise watch.failed(error) from error
    except BaseException as error:  # an interrupt: the peers hear of it, the caller gets it as it is
        watch.failed(error)
        raise
    finally:
        watch.finished = True
    return backend


def _job_store(own: dist.Store, is_default_group: bool) -> dist.Store:
    """Where this group records deaths for the whole job (csrc/comm/failure_notices.h): the default group's Store,
    as its shardkit backend holds it; the group's own where it is the default group, the default group is not
    shardkit's, or there is none (a group built outside init_process_group: shardkit's torchft process group)."""
    if not is_default_group and dist.is_initialized():
        world = cpu_backend(_torch_compat.default_group())
        if isinstance(world, _C.ProcessGroupShardkit):
            return world.job_store()
    return own


def _remove_stale_segments(watch: StartupWatch, num_hosts: int) -> None:
    """Removes the names of the segments that the last _SWEPT_GENERATIONS start-ups on this Store agreed, where
    they are still in /dev/shm: a start-up killed between the segment's creation and its last rank's attach (where
    the creator unlinks it) leaves it there, and nobody of its attempt is left to remove it. A segment's name is in
    the Store before the segment exists; names are unique (pid and random), so a name is only ever found on its own
    host, and an earlier start-up on this Store has ended before this one starts (torchrun stops every worker of an
    attempt before the next; a group made again in one process was destroyed first)."""
    for generation in range(max(1, watch.generation - _SWEPT_GENERATIONS), watch.generation):
        earlier = _attempt.scope(watch.unscoped_store, generation)
        for host in range(num_hosts):
            key = f"shardkit/shm_name/{host}"
            if earlier.check([key]):
                _C.remove_segment_name(earlier.get(key).decode())


def forget_group(group_id: str) -> None:
    """Drops what this module and _topology.py keep for the group ``group_id`` (its gloo rendezvous Stores, its
    host records), once the group has ended: for groups made and ended many times in one process (shardkit's torchft
    process group makes one per quorum), whose kept Stores would otherwise hold a Store connection each."""
    _GLOO_STORES.pop(str(group_id), None)
    _topology.forget_group(str(group_id))


def _start(options, watch: StartupWatch, global_ranks: list[int], timeout: timedelta,
           isolated: bool = False) -> _C.ProcessGroupShardkit:
    store, rank, size = watch.store, options.group_rank, options.group_size
    group_id = _name_part(str(options.group_id), 40)
    topology = _topology.HostTopology.from_host_ids(watch.exchange_hosts(_topology.host_id(), size))
    _topology.record_topology(str(options.group_id), topology)

    config = _C.BackendConfig()
    config.local_rank = topology.local_of[rank]
    config.local_size = topology.local_size(rank)
    config.num_hosts = topology.num_hosts
    config.host_index = topology.host_of[rank]
    config.host_of = topology.host_of
    config.local_of = topology.local_of
    config.global_ranks = global_ranks
    config.pids = watch.pids_to_watch()
    if config.local_rank == 0:
        _remove_stale_segments(watch, topology.num_hosts)
    config.shm_name = watch.segment_name = _agree_segment_name(watch, config.local_rank, config.host_index, group_id)
    config.slot_bytes = _slot_bytes()
    # torchrun's count of ranks on this machine: with simulated hosts (or several jobs' groups) more
    # processes compete for the cores than this host's group holds, and waits should spin less.
    config.processes_on_machine = _env_int("LOCAL_WORLD_SIZE", 0)
    config.timeout = timeout
    config.isolated = isolated
    config.p2p_direct_bytes, config.p2p_direct_read = _p2p_settings()
    _agree_p2p_direct_bytes(watch, rank, config.p2p_direct_bytes)

    fallback = connect_gloo(watch, dist.PrefixStore("shardkit/gloo", store), rank, size, timeout,
                            "the inner gloo backend")
    inter_host = None
    if topology.num_hosts > 1:
        config.rails = topology.can_use_rails() and _agree_inter_host_scheme(watch, rank) == "rails"
        _topology.record_scheme(str(options.group_id), "rails" if config.rails else "leaders")
        if config.local_rank == 0 or config.rails:  # this rank's rail (local rank 0's: the host leaders')
            what = (f"rail {config.local_rank}'s gloo backend" if config.local_rank
                    else "the host leaders' gloo backend")
            inter_host = connect_gloo(watch, dist.PrefixStore(f"shardkit/rail{config.local_rank}", store),
                                      config.host_index, topology.num_hosts, timeout, what)
    _GLOO_STORES[str(options.group_id)] = watch.kept_stores
    watch.all_connected(size)
    job_store = store if isolated else _job_store(store, not options.global_ranks_in_group)
    backend = _C.ProcessGroupShardkit(rank, size, config, store, fallback, inter_host, job_store)
    watch.all_started(size)
    return backend

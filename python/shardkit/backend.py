"""Registration of the ``"shardkit"`` torch.distributed backend.

``dist.init_process_group("shardkit")`` calls :func:`_create_backend` once per group. It groups the ranks
by host through the group's Store, agrees one shared-memory segment name per host, builds the inner gloo
backends (all ranks: point-to-point and non-hierarchical ops across hosts; host leaders: the inter-host
step of hierarchical ops), and constructs the C++ ``ProcessGroupShardkit``. Every wait of that start-up is
bounded by a failure or death anywhere in it (``_startup.py``).

Environment:
  SHARDKIT_SHM_SLOT_BYTES   bytes per rank and buffer in the shared segment (default 1 MiB); collectives
                            of any size are chunked through it.
  SHARDKIT_HOST_ID          overrides the host identity (default: hostname + boot id), e.g. to simulate
                            several hosts on one machine in tests.
  SHARDKIT_SHM_TAG          a label put into the shared-memory segment names (letters, digits, '_'), so
                            that a job's segments can be told apart in /dev/shm (the test suite uses it).
  SHARDKIT_INTER_HOST       how large collectives cross hosts: "rails" (default; where hosts hold equal
                            numbers of consecutive ranks, local rank k of every host talks to local rank k of
                            the others) or "leaders" (each host's first rank carries all its traffic). Rank 0's
                            setting holds for the whole group.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import socket
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _C, _exchange, _startup, _torch_compat

BACKEND_NAME = "shardkit"
_DEFAULT_SLOT_BYTES = 1 << 20
# Each group's host topology by group name, as its creator computed it: host_topology() reads it, so tests
# (e.g. the two-host namespace test) can check how ranks were grouped without a hook into the C++ backend.
_TOPOLOGIES: dict[str, "HostTopology"] = {}
# How each group's large collectives cross hosts ("rails" or "leaders"; absent on one host), by group name.
_SCHEMES: dict[str, str] = {}
# The Stores each group's gloo rendezvous went through (start-up watch wrappers, by group name): kept for the
# group's life, since gloo may use its Store again later (TORCH_GLOO_LAZY_INIT connects at the first op), and a
# Python Store whose object is gone cannot answer it.
_GLOO_STORES: dict[str, list[dist.Store]] = {}


def _slot_bytes() -> int:
    raw = os.environ.get("SHARDKIT_SHM_SLOT_BYTES", str(_DEFAULT_SLOT_BYTES))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"SHARDKIT_SHM_SLOT_BYTES must be a positive integer, got {raw!r}")
    return value


def _name_part(text: str, limit: int) -> str:
    """`text` made safe for a shared-memory segment name: letters, digits and '_', at most `limit` chars."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in text)[:limit]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def host_id() -> str:
    """This machine's identity: ranks with equal ids share /dev/shm."""
    override = os.environ.get("SHARDKIT_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclasses.dataclass(frozen=True)
class HostTopology:
    """How a group's ranks sit on hosts. Hosts are numbered by their lowest rank."""

    host_of: list[int]  # host index of each rank
    local_of: list[int]  # rank's position among its host's ranks

    @classmethod
    def from_host_ids(cls, ids: list[str]) -> "HostTopology":
        order: dict[str, int] = {}
        host_of, local_of, counts = [], [], []
        for host in ids:
            index = order.setdefault(host, len(order))
            if index == len(counts):
                counts.append(0)
            host_of.append(index)
            local_of.append(counts[index])
            counts[index] += 1
        return cls(host_of, local_of)

    @property
    def num_hosts(self) -> int:
        return max(self.host_of) + 1

    def local_size(self, rank: int) -> int:
        return self.host_of.count(self.host_of[rank])

    def leaders(self) -> list[int]:
        return [rank for rank, local in enumerate(self.local_of) if local == 0]

    def can_use_rails(self) -> bool:
        """Several hosts, each holding the same number (2+) of consecutive ranks: every local rank can have a
        rail (an inter-host group of the ranks at its position on every host)."""
        hosts = [[r for r, h in enumerate(self.host_of) if h == host] for host in range(self.num_hosts)]
        return (self.num_hosts > 1 and len({len(ranks) for ranks in hosts}) == 1 and len(hosts[0]) > 1
                and all(ranks[-1] - ranks[0] + 1 == len(ranks) for ranks in hosts))


_INTER_HOST_SCHEMES = ("rails", "leaders")


def _inter_host_scheme(watch: _startup.StartupWatch, rank: int) -> str:
    """SHARDKIT_INTER_HOST as rank 0 reads it (every rank must build the same inter-host groups)."""
    key = "shardkit/inter_host_scheme"
    if rank == 0:
        scheme = os.environ.get("SHARDKIT_INTER_HOST", "rails") or "rails"
        if scheme not in _INTER_HOST_SCHEMES:
            raise ValueError(f"SHARDKIT_INTER_HOST must be one of {_INTER_HOST_SCHEMES}, got {scheme!r}")
        watch.store.set(key, scheme)
        return scheme
    return watch.get(key, "waiting for rank 0 to say how collectives cross hosts").decode()


def _agree_segment_name(watch: _startup.StartupWatch, local_rank: int, host_index: int, group_id: str) -> str:
    """Each host's first rank draws a name unique to this job, group and host; its peers read it."""
    key = f"shardkit/shm_name/{host_index}"
    if local_rank == 0:
        tag = _name_part(os.environ.get("SHARDKIT_SHM_TAG", ""), 32)
        name = f"/shardkit-{tag + '-' if tag else ''}{os.getpid()}-{secrets.token_hex(6)}-{group_id or 'default'}-h{host_index}"
        watch.store.set(key, name)
        return name
    return watch.get(key, "waiting for the host's first rank to name the shared-memory segment").decode()


def _create_backend(options: _torch_compat.BackendOptions, pg_options) -> dist.Backend:
    if pg_options is not None:
        raise ValueError(f"the shardkit backend takes no pg_options, got {pg_options!r}")
    store, rank, size = options.store, options.group_rank, options.group_size
    timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(seconds=options.timeout)
    # The default group is told no ranks: its ranks are the job's.
    global_ranks = list(options.global_ranks_in_group) or list(range(size))
    watch = _startup.StartupWatch(store, rank, global_ranks, timeout)
    try:
        backend = _start(options, watch, global_ranks, timeout)
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
    as its shardkit backend holds it; the group's own where it is the default group, or the default group is not
    shardkit's."""
    if not is_default_group:
        world = cpu_backend(_torch_compat.default_group())
        if isinstance(world, _C.ProcessGroupShardkit):
            return world.job_store()
    return own


def _start(options, watch: _startup.StartupWatch, global_ranks: list[int], timeout: timedelta) -> dist.Backend:
    store, rank, size = options.store, options.group_rank, options.group_size
    group_id = _name_part(str(options.group_id), 40)
    topology = HostTopology.from_host_ids(watch.exchange_hosts(host_id(), size))
    _TOPOLOGIES[str(options.group_id)] = topology

    config = _C.BackendConfig()
    config.local_rank = topology.local_of[rank]
    config.local_size = topology.local_size(rank)
    config.num_hosts = topology.num_hosts
    config.host_index = topology.host_of[rank]
    config.host_of = topology.host_of
    config.local_of = topology.local_of
    config.global_ranks = global_ranks
    config.pids = watch.pids_to_watch()
    config.shm_name = watch.segment_name = _agree_segment_name(watch, config.local_rank, config.host_index, group_id)
    config.slot_bytes = _slot_bytes()
    # torchrun's count of ranks on this machine: with simulated hosts (or several jobs' groups) more
    # processes compete for the cores than this host's group holds, and waits should spin less.
    config.processes_on_machine = _env_int("LOCAL_WORLD_SIZE", 0)
    config.timeout = timeout

    fallback = _startup.connect_gloo(watch, dist.PrefixStore("shardkit/gloo", store), rank, size, timeout,
                                     "the inner gloo backend")
    inter_host = None
    if topology.num_hosts > 1:
        config.rails = topology.can_use_rails() and _inter_host_scheme(watch, rank) == "rails"
        _SCHEMES[str(options.group_id)] = "rails" if config.rails else "leaders"
        if config.local_rank == 0 or config.rails:  # this rank's rail (local rank 0's: the host leaders')
            what = (f"rail {config.local_rank}'s gloo backend" if config.local_rank
                    else "the host leaders' gloo backend")
            inter_host = _startup.connect_gloo(watch, dist.PrefixStore(f"shardkit/rail{config.local_rank}", store),
                                               config.host_index, topology.num_hosts, timeout, what)
    _GLOO_STORES[str(options.group_id)] = watch.kept_stores
    watch.all_connected(size)
    job_store = _job_store(store, not options.global_ranks_in_group)
    backend = _C.ProcessGroupShardkit(rank, size, config, store, fallback, inter_host, job_store)
    watch.all_started(size)
    return backend


@atexit.register
def _shut_down_at_exit() -> None:
    """Shuts down the backends of groups nobody destroyed (destroy_process_group() is optional in torch), while the
    interpreter still runs: their worker threads finish what is queued and end. One left running into the
    interpreter's finalization would drop a tensor there (taking the GIL), be ended mid-destructor, and abort the
    process at exit."""
    if not dist.is_available() or not dist.is_initialized():
        return
    for group in _torch_compat.live_process_groups():  # the groups not destroyed yet
        backend = cpu_backend(group)
        if isinstance(backend, _C.ProcessGroupShardkit):
            backend.shutdown_now()


def host_topology(group: dist.ProcessGroup | None = None) -> HostTopology:
    """How the shardkit backend of ``group`` (default: the world group) grouped its ranks by host."""
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)  # WORLD is None before init_process_group
    if name not in _TOPOLOGIES:
        raise ValueError(f"process group {name!r} has no shardkit backend in this process")
    return _TOPOLOGIES[name]


def inter_host_scheme(group: dist.ProcessGroup | None = None) -> str | None:
    """How the shardkit backend of ``group`` (default: the world group) moves large collectives between hosts:
    "rails" (local rank k of every host with local rank k of the others), "leaders" (each host's first rank), or
    None where the group is on one host. See docs/backend.md, "Across hosts"."""
    host_topology(group)  # the same error for a group without a shardkit backend
    pg = group if group is not None else dist.group.WORLD
    return _SCHEMES.get(pg.group_name)


def inter_host_bytes(group: dist.ProcessGroup | None = None) -> int:
    """Payload bytes this rank has sent to other hosts through ``group``'s shardkit backend (default: the world's) in
    point-to-point exchanges: every rails op, every reduce-scatter and every quantized op (``shardkit.Quantized``)
    crosses that way; the leader scheme's exact allreduce, all-gather, broadcast and reduce run as gloo collectives
    and are not counted. 0 on one host."""
    host_topology(group)  # the same error for a group without a shardkit backend
    return cpu_backend(group).inter_host_bytes()


def host_groups(what: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's two subgroups of the world: the ranks on its host, and the ranks at its position on every
    host (hosts told apart by host_id()). A collective over the world group: every rank creates every group,
    in the same order. Every host must hold the same number of ranks; `what` names the caller in that error."""
    world = _torch_compat.default_group()
    me = dist.get_rank()
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(_exchange.all_gather_object(host_id(), world)):
        by_host.setdefault(host, []).append(rank)
    sizes = {host: len(ranks) for host, ranks in by_host.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{what} (rank {me}): needs the same number of ranks on every host, got {sizes}")
    on_host = across_hosts = None
    for ranks in by_host.values():
        group = dist.new_group(ranks)
        if me in ranks:
            on_host, position = group, ranks.index(me)
    for index in range(len(next(iter(by_host.values())))):
        group = dist.new_group([ranks[index] for ranks in by_host.values()])
        if index == position:
            across_hosts = group
    return on_host, across_hosts


# --- zero-copy memory -------------------------------------------------------------------------------------
class ZeroCopyUnavailableWarning(UserWarning):
    """Zero-copy memory (shared memory that every rank of a group maps, from which collectives read the peers'
    data where it lies) could not be had; ordinary memory is used instead, with the same results. The message says
    why. Silence it with ``warnings.filterwarnings("ignore", category=shardkit.ZeroCopyUnavailableWarning)``."""


def cpu_backend(group: dist.ProcessGroup | None = None) -> Any:
    """The backend that runs ``group``'s (default: the world's) collectives on CPU tensors, None where it has none
    (a group of "cuda:nccl" only). Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps every backend in a checking
    wrapper (a private type with ``wrapped_pg``): the backend inside it."""
    group = group if group is not None else _torch_compat.default_group()
    try:
        backend = _torch_compat.group_backend(group, torch.device("cpu"))
    except RuntimeError:
        return None
    while hasattr(backend, "wrapped_pg"):
        backend = backend.wrapped_pg
    return backend


def compare_identities_across_hosts(group: dist.ProcessGroup | None) -> None:
    """Has ``group``'s shardkit backend compare every collective's identity across hosts from now on (csrc/comm/
    hierarchical_engine.h; inside a host it is compared always); nothing for another backend. Every rank of the group
    calls it at the same point among the group's collectives (FSDP and DDP do, at construction)."""
    backend = cpu_backend(group)
    if isinstance(backend, _C.ProcessGroupShardkit):
        backend.compare_identities_across_hosts()


def zero_copy_unavailable(group: dist.ProcessGroup | None = None) -> str | None:
    """Why ``group`` (default: the world) can have no zero-copy memory at all, or None where it can (if /dev/shm
    has the room): its CPU backend is not shardkit's, or its ranks are on several hosts. The same answer on every
    rank of the group, found without communication."""
    group = group if group is not None else _torch_compat.default_group()
    if not isinstance(cpu_backend(group), _C.ProcessGroupShardkit):
        return f"the group's backend is {dist.get_backend(group)}, not shardkit's"
    hosts = host_topology(group).num_hosts
    return f"the group's ranks are on {hosts} hosts, which share no memory" if hosts > 1 else None


def shared_buffer(nbytes: int, group: dist.ProcessGroup | None = None, *, who: str = "shardkit.backend.shared_buffer",
                  what: str = "the buffer") -> torch.Tensor | None:
    """A collective over ``group`` (default: the world): ``nbytes`` of host memory, a uint8 tensor, that every rank
    of the group maps from the others; an allreduce of a tensor lying in it, or a reduce-scatter whose input lies
    in it, reads the peers' data there instead of copying it through the group's slots (same results). Every rank
    calls it with the same ``nbytes``, in the same place among the group's collectives.

    Where there is none, returns None on every rank and warns (warn_zero_copy_unavailable: "{who} (rank r): no
    zero-copy memory for {what} (n bytes per rank): why; ..."): /dev/shm has not the room, the group spans hosts
    or its backend is not shardkit's (zero_copy_unavailable; then no collective is issued)."""
    why = zero_copy_unavailable(group)
    if why is None:
        memory, why = cpu_backend(group).shared_buffer(nbytes)
        if memory is not None:
            return memory
    warn_zero_copy_unavailable(who, f"{what} ({nbytes} bytes per rank)", why)  # attributed to our caller
    return None


def warn_zero_copy_unavailable(who: str, what: str, why: str, stacklevel: int = 1) -> None:
    """Warns ``"{who} (rank r): no zero-copy memory for {what}: {why}; ordinary memory is used, with the same
    results"`` (a ZeroCopyUnavailableWarning; r: the global rank), attributed to the frame ``stacklevel`` levels
    above the caller (1: the caller's caller)."""
    warnings.warn(f"{who} (rank {dist.get_rank()}): no zero-copy memory for {what}: {why}; ordinary memory is used, "
                  "with the same results", ZeroCopyUnavailableWarning, stacklevel=stacklevel + 2)


def register_backend() -> None:
    """Register ``"shardkit"`` with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # devices must be a list: a plain string would be iterated letter by letter. A CPU-only torch gets no
    # "cuda" entry: torch code that asks a backend's device map for its accelerator (ShardedTensor, used by
    # torch.distributed.checkpoint) would otherwise call torch.cuda.current_device() and fail.
    devices = ["cpu", "cuda"] if torch.version.cuda is not None else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=devices)


# --- the direct allreduce -----------------------------------------------------------------------------------
_DIRECT: dict[int, tuple[dist.ProcessGroup, Any]] = {}  # id(group) -> (group, its shardkit CPU backend)
# ReduceOp.SUM and its kin are RedOpType values; pybind converts one to a ReduceOp object on every call (about
# 1 µs, a sixth of a small allreduce). These are converted once and found by identity (hashing a pybind enum
# costs half a microsecond); a ReduceOp object (PREMUL_SUM) passes as is.
_REDUCE_OPS = tuple((kind, dist.ReduceOp(kind)) for kind in dist.ReduceOp.RedOpType.__members__.values()
                    if kind != dist.ReduceOp.RedOpType.PREMUL_SUM)


def _as_reduce_op(op: Any) -> Any:
    for kind, converted in _REDUCE_OPS:
        if op is kind:
            return converted
    return op


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.distributed.all_reduce(tensor, op, group)`` for a dense CPU tensor on a shardkit group, synchronous,
    in place, returning ``tensor``: the same collective (validation, numbering, order with every other
    collective of the group, results and errors), reached without torch's Python wrapper, its dispatcher, a
    Work or a Future. For latency-bound loops of small allreduces, where those cost more than the reduction
    (docs/backend.md, "Speed"); everything else should call ``torch.distributed.all_reduce``. A collective: every rank
    of ``group`` calls it in the same order as its other collectives."""
    group = group if group is not None else _torch_compat.default_group()
    entry = _DIRECT.get(id(group))
    if entry is None or entry[0] is not group:
        backend = cpu_backend(group)
        if not isinstance(backend, _C.ProcessGroupShardkit):
            raise TypeError(f"shardkit.all_reduce_: the group's CPU backend is {type(backend).__name__}, not "
                            "shardkit's; use torch.distributed.all_reduce")
        entry = _DIRECT[id(group)] = (group, backend)
    entry[1].allreduce_now(tensor, _as_reduce_op(op))
    return tensor

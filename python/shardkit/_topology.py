"""How a shardkit group's ranks sit on hosts, and how its large collectives cross between them.

It promises: a host identity per machine (``host_id``; ranks with equal ids share /dev/shm); the grouping a group's
start-up computed from those ids (``HostTopology``: hosts numbered by their lowest rank, each rank's host and place
on it, the host leaders, whether the group can have rails), recorded per group and read back with
``host_topology(group)``; the inter-host scheme each group settled on (``inter_host_scheme``, "rails" or
"leaders") and what a rank sent across hosts (``inter_host_bytes``); and ``host_groups``, the per-host and
across-host subgroups of the world that HYBRID_SHARD builds. The start-up (``_startup.py``) records what it agreed
here; nothing here talks to a group's Store.

Environment:
  SHARDKIT_HOST_ID          overrides the host identity (default: hostname + boot id), e.g. to simulate
                            several hosts on one machine in tests.
  SHARDKIT_INTER_HOST       how large collectives cross hosts: "rails" (default; where hosts hold equal
                            numbers of consecutive ranks, local rank k of every host talks to local rank k of
                            the others) or "leaders" (each host's first rank carries all its traffic). Rank 0's
                            setting holds for the whole group (the start-up passes it on).
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch.distributed as dist

from . import _exchange, _torch_compat
from ._group_backend import cpu_backend

INTER_HOST_SCHEMES = ("rails", "leaders")
# Each group's host topology by group name, as its creator computed it: host_topology() reads it, so tests
# (e.g. the two-host namespace test) can check how ranks were grouped without a hook into the C++ backend.
_TOPOLOGIES: dict[str, HostTopology] = {}
# How each group's large collectives cross hosts ("rails" or "leaders"; absent on one host), by group name.
_SCHEMES: dict[str, str] = {}


def host_id() -> str:
    """This machine's identity: ranks with equal ids share /dev/shm. The host name and boot id tell machines apart;
    the device number of the file system mounted at /dev/shm tells apart containers on one machine that share
    both (Kubernetes pods with ``hostNetwork: true`` run under the node's host name, each with its own /dev/shm)
    and keeps together those that share it (one pod's containers, or ``--ipc=host``)."""
    override = os.environ.get("SHARDKIT_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = -1
    return f"{socket.gethostname()}/{boot}/{shm}"


@dataclasses.dataclass(frozen=True)
class HostTopology:
    """How a group's ranks sit on hosts. Hosts are numbered by their lowest rank."""

    host_of: list[int]  # host index of each rank
    local_of: list[int]  # rank's position among its host's ranks

    @classmethod
    def from_host_ids(cls, ids: list[str]) -> HostTopology:
        order: dict[str, int] = {}
        host_of: list[int] = []
        local_of: list[int] = []
        counts: list[int] = []
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


def requested_inter_host_scheme() -> str:
    """SHARDKIT_INTER_HOST as this process reads it (the start-up takes rank 0's for the whole group)."""
    scheme = os.environ.get("SHARDKIT_INTER_HOST", "rails") or "rails"
    if scheme not in INTER_HOST_SCHEMES:
        raise ValueError(f"SHARDKIT_INTER_HOST must be one of {INTER_HOST_SCHEMES}, got {scheme!r}")
    return scheme


def record_topology(group_name: str, topology: HostTopology) -> None:
    """The start-up's record of how the group ``group_name`` grouped its ranks (host_topology reads it)."""
    _TOPOLOGIES[group_name] = topology


def record_scheme(group_name: str, scheme: str) -> None:
    """The start-up's record of how the group ``group_name``, on several hosts, crosses them (inter_host_scheme)."""
    _SCHEMES[group_name] = scheme


def forget_group(group_name: str) -> None:
    """Drops the records of the group ``group_name``, which has ended (a torchft process group makes a new group
    for every quorum: their records must not pile up)."""
    _TOPOLOGIES.pop(group_name, None)
    _SCHEMES.pop(group_name, None)


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
    pg = group if group is not None else _torch_compat.default_group()
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
    assert on_host is not None and across_hosts is not None, "every rank is on one host and at one position"
    return on_host, across_hosts

"""A rank's place in the job, from the launcher that started it: SLURM's ``srun`` without torchrun.

torch's default rendezvous (``env://``) reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). ``srun`` sets none of them; it sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``,
... instead. This module promises:

- ``slurm_placement()``: the rank, world size, node, place on the node and rendezvous address that ``srun``'s
  variables give this process (``SlurmPlacement``), or an error naming the variable that is missing or malformed;
- the rendezvous ``slurm://``, for ``init_process_group(..., init_method="slurm://")``: it builds the job's
  TCPStore from that placement, so every rank started by ``srun python train.py`` joins one group with no
  launcher in between. Installing shardkit registers it with torch (``_shardkit_autoload``), like the backend's
  name; it serves any backend, not only shardkit's.

The rendezvous address: ``MASTER_ADDR`` where set, else the first host of the step's node list (where SLURM puts
task 0 under its default block distribution). The port: the URL's (``slurm://?port=29500``), else ``MASTER_PORT``,
else 15000 + the job id's last four digits — the port Lightning's SLURM environment derives, so two jobs sharing a
node rarely collide and a job's ranks agree without talking. A process that torchrun started (it sets
``TORCHELASTIC_RUN_ID``; ``srun torchrun ...``) takes torchrun's variables instead: under torchrun ``SLURM_PROCID``
numbers the torchrun agents, not the ranks.

shardkit's backend itself needs no launcher variable beyond the rendezvous: it finds which ranks share a host (and
each rank's place on it) by exchanging host identities when a group starts (``_topology.py``), so neither
``LOCAL_RANK`` (which Kubeflow's PyTorchJob does not set) nor ``SLURM_LOCALID`` is read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

SCHEME = "slurm"
# Lightning's SLURMEnvironment derives its default port this way (15000 + the job id's last four digits).
_PORT_BASE = 15000


@dataclasses.dataclass(frozen=True)
class SlurmPlacement:
    """Where ``srun`` put this process: its rank among all tasks of the step, and its place on its node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int


class SlurmEnvironmentError(RuntimeError):
    """``srun``'s variables are missing or malformed in a process that asked for the ``slurm://`` rendezvous."""


def _required(environ: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    raise SlurmEnvironmentError(
        f"slurm:// rendezvous: {' or '.join(names)} is not set: this process was not started by srun (under sbatch, "
        f"start the ranks with `srun python train.py`, one task per rank)")


def _integer(environ: Mapping[str, str], *names: str) -> int:
    value = _required(environ, *names)
    try:
        return int(value)
    except ValueError:
        raise SlurmEnvironmentError(f"slurm:// rendezvous: {names[0]}={value!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, expanded: ``"node[07-09,12],gpu1"`` -> ``"node07"``,
    ``"rack[2-3]-n[01-04]"`` -> ``"rack2-n01"`` (every bracket takes its first value, zero padding kept)."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for index, char in enumerate(text):  # the first entry: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    entry = text[:end]
    host = re.sub(r"\[([^\]]*)\]", lambda match: re.split(r"[-,]", match.group(1))[0], entry)
    if not host or "[" in host or "]" in host:
        raise SlurmEnvironmentError(f"slurm:// rendezvous: cannot read the node list {nodelist!r}")
    return host


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks-per-node list expanded, one count per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise SlurmEnvironmentError(f"slurm:// rendezvous: cannot read the tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_placement(environ: Mapping[str, str] = os.environ, port: int | None = None) -> SlurmPlacement:
    """This process's place in the job, from ``srun``'s variables (the step's where both the step's and the job's
    are set: a job may run several steps of different shapes)."""
    rank = _integer(environ, "SLURM_PROCID")
    world_size = _integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if not 0 <= rank < world_size:
        raise SlurmEnvironmentError(f"slurm:// rendezvous: SLURM_PROCID={rank} is outside the step's "
                                    f"{world_size} tasks")
    node_rank = _integer(environ, "SLURM_NODEID")
    counts = tasks_per_node(_required(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if not 0 <= node_rank < len(counts):
        raise SlurmEnvironmentError(f"slurm:// rendezvous: SLURM_NODEID={node_rank} is outside the tasks per node "
                                    f"{counts}")
    master_addr = environ.get("MASTER_ADDR", "").strip() or first_host(
        _required(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if port is None:
        if environ.get("MASTER_PORT", "").strip():
            port = _integer(environ, "MASTER_PORT")
        else:
            job = _required(environ, "SLURM_JOB_ID", "SLURM_JOBID")
            if not job[-4:].isdigit():
                raise SlurmEnvironmentError(f"slurm:// rendezvous: SLURM_JOB_ID={job!r} gives no port: set "
                                            f"MASTER_PORT or pass slurm://?port=N")
            port = _PORT_BASE + int(job[-4:])
    return SlurmPlacement(rank=rank, world_size=world_size, local_rank=_integer(environ, "SLURM_LOCALID"),
                          local_world_size=counts[node_rank], node_rank=node_rank, num_nodes=len(counts),
                          master_addr=master_addr, master_port=port)


def rendezvous_handler(url: str, timeout: timedelta = timedelta(minutes=10), **kwargs: object
                       ) -> Iterator[tuple[dist.Store, int, int]]:
    """torch's rendezvous for ``slurm://`` (``torch.distributed.rendezvous.register_rendezvous_handler``): the
    job's TCPStore, hosted by rank 0 at the placement's address, with this process's rank and the world size."""
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # srun torchrun ...: torchrun's variables name the ranks
        from torch.distributed.rendezvous import rendezvous

        yield from rendezvous("env://", timeout=timeout,
                              **{k: int(v) for k, v in query.items() if k in ("rank", "world_size")})
        return
    placement = slurm_placement(port=int(query["port"]) if "port" in query else None)
    # torch passes its rank= and world_size= arguments on in the URL; they must agree with srun's.
    for key, value in (("rank", placement.rank), ("world_size", placement.world_size)):
        if key in query and int(query[key]) != value:
            raise SlurmEnvironmentError(f"slurm:// rendezvous: init_process_group({key}={query[key]}) disagrees "
                                        f"with srun's {value} (SLURM_PROCID / SLURM_NTASKS)")
    store = dist.TCPStore(placement.master_addr, placement.master_port, placement.world_size,
                          placement.rank == 0, timeout=timeout, multi_tenant=True)
    yield store, placement.rank, placement.world_size
    raise RuntimeError("slurm:// rendezvous cannot run again in one process (as env://)")

"""Simulated hosts for ``benchmarks/collectives.py --hosts HxR``: hierarchical allreduce vs flat gloo.

H "hosts" of R ranks each run on this one machine: every rank sets ``SHARDKIT_HOST_ID = rank // R`` in its
environment before creating its process group, so the shardkit backend groups the ranks into H hosts and
runs its hierarchical allreduce (reduce within the host through shared memory, allreduce among the H host
leaders over gloo, broadcast within the host). The anchor is plain gloo over all H·R ranks in the same job,
with the repetitions of the two interleaved so both see the same machine load.

What the ratio means: the "network" between simulated hosts is loopback TCP on the same cores, far faster
than a real one, so it measures what the hierarchy saves — gloo traffic among H leaders instead of all
H·R ranks, and shared memory instead of TCP inside a host — not what a cluster would see.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from _common import format_size, format_table, format_us
from _harness import add_target, init_groups, time_interleaved

# The hierarchical allreduce must beat flat gloo by this factor at every size of at least LARGE_BYTES.
TARGET_SPEEDUP = 3.0
LARGE_BYTES = 16 << 20


def parse_hosts(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (2 hosts, 2 ranks per host)."""
    try:
        hosts, per_host = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--hosts: expected HOSTSxRANKS such as 2x2, got {text!r}") from None
    if hosts < 2 or per_host < 1:
        raise ValueError(f"--hosts: need at least 2 hosts of at least 1 rank, got {text!r}")
    return hosts, per_host


def topology_name(hosts: int, per_host: int) -> str:
    return f"{hosts}x{per_host}"


def hosts_rank_main(rank: int, world: int, store: str, cfg: Any, per_host: int) -> list[dict[str, Any]] | None:
    """One rank of the simulated-hosts job; rank 0 returns the rows (f32 allreduce, both backends)."""
    os.environ["SHARDKIT_HOST_ID"] = f"bench-host-{rank // per_host}"  # read when the group is created
    gloo = init_groups(rank, world, store, cfg.pg_timeout_s)
    topology = topology_name(world // per_host, per_host)
    rows = []
    for size in cfg.sizes:
        if rank == 0:
            print(f"{topology} hosts: allreduce f32 {format_size(size)}", file=sys.stderr, flush=True)
        numel = size // 4
        # Correctness first: small integers, exact in any order, must come out the same on both backends.
        results = []
        for group in (None, gloo):
            t = (torch.arange(numel) % 7 + rank + 1).to(torch.float32)
            dist.all_reduce(t, group=group)
            results.append(t)
        if not torch.equal(results[0], results[1]):
            raise AssertionError(f"rank {rank}: hierarchical allreduce {format_size(size)} differs from gloo")
        mine, theirs = torch.zeros(numel), torch.zeros(numel)
        timings = time_interleaved(
            {"shardkit": lambda: dist.all_reduce(mine), "gloo": lambda: dist.all_reduce(theirs, group=gloo)},
            {"shardkit": lambda: dist.barrier(), "gloo": lambda: dist.barrier(group=gloo)}, gloo, cfg.timing)
        for backend, timing in timings.items():
            algbw = size / timing.seconds / 1e9
            rows.append({"topology": topology, "world": world, "backend": backend, "op": "allreduce",
                         "dtype": "f32", "size_bytes": size, "latency_s": timing.seconds, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * 2 * (world - 1) / world, "iters": timing.iters,
                         "samples_s": timing.samples})
    return rows if rank == 0 else None


def _row(rows: Sequence[dict[str, Any]], topology: str, backend: str, size: int) -> dict[str, Any] | None:
    for row in rows:
        if (row.get("topology"), row["backend"], row["size_bytes"]) == (topology, backend, size):
            return row
    return None


def print_hosts(rows: Sequence[dict[str, Any]], hosts: int, per_host: int, sizes: Sequence[int]) -> None:
    topology = topology_name(hosts, per_host)
    table = []
    for size in sizes:
        sk, gl = _row(rows, topology, "shardkit", size), _row(rows, topology, "gloo", size)
        assert sk is not None and gl is not None
        table.append([format_size(size), format_us(sk["latency_s"]), f"{sk['algbw_GBps']:.3f}",
                      format_us(gl["latency_s"]), f"{gl['algbw_GBps']:.3f}",
                      f"{gl['latency_s'] / sk['latency_s']:.1f}x"])
    print(f"\n=== {hosts} simulated hosts × {per_host} ranks (SHARDKIT_HOST_ID = rank // {per_host}): f32 allreduce, "
          f"shardkit hierarchical vs flat gloo over {hosts * per_host} ranks (repetitions interleaved) ===")
    print(format_table(["size", "shardkit µs", "algbw GB/s", "gloo µs", "gloo algbw", "gloo/shardkit"], table))


def hosts_targets(rows: Sequence[dict[str, Any]], hosts: int, per_host: int, sizes: Sequence[int]
                  ) -> list[dict[str, Any]]:
    """Hierarchical ≥ TARGET_SPEEDUP × flat gloo, judged on the smallest speedup over the sizes ≥ 16M."""
    topology = topology_name(hosts, per_host)
    large = [s for s in sizes if s >= LARGE_BYTES]
    speedups = []
    for size in large:
        sk, gl = _row(rows, topology, "shardkit", size), _row(rows, topology, "gloo", size)
        if sk is not None and gl is not None:
            speedups.append(gl["latency_s"] / sk["latency_s"])
    checks: list[dict[str, Any]] = []
    print(f"(judged at {', '.join(format_size(s) for s in large) or 'no measured size'}: the sizes ≥ "
          f"{format_size(LARGE_BYTES)})")
    add_target(checks, f"{topology} simulated hosts, f32 allreduce ≥ {format_size(LARGE_BYTES)}: hierarchical ≥ "
               f"{TARGET_SPEEDUP:g}× flat gloo (smallest speedup)", min(speedups) if speedups else None,
               TARGET_SPEEDUP, True, "×")
    return checks

"""What checking collectives' identities across hosts costs: an all-gather and a reduce-scatter carrying an FSDP
unit's identity on a group that compares identities across hosts (as FSDP and DDP set their groups up), against
the same collectives on a group of the same ranks that does not, interleaved in the same job (``python benchmarks/
identity_check.py``; results in ``benchmarks/results/identity_check.json``).

On one host the identity rides in the shared-memory op header on both groups: the two should take the same time.
Across (simulated) hosts the checking group's host leaders all-gather a fixed-size fingerprint over gloo before
every op's inter-host steps (csrc/comm/hierarchical_engine.h): one small gloo all-gather more per op. Simulated
hosts talk over loopback TCP on the same cores, so the absolute cost is this machine's gloo latency, not a
network's; the figure to take away is that cost per op beside the op's own time.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import format_size, format_table, format_us, parse_size
from _harness import ForeignLoad, TimingConfig, init_groups, launch_ranks, machine_info, time_interleaved, write_json

RESULTS = Path(__file__).parent / "results" / "identity_check.json"
# torch 2.13 renamed them (the old names warn); 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
TOPOLOGIES = {"1x2": (1, 2), "2x1": (2, 1), "2x2": (2, 2)}  # hosts x ranks per host
DEFAULT_SIZES = ("64K", "1M", "16M")  # bytes per rank: a small unit to a large one


def _rank_main(rank: int, world: int, store: str, per_host: int, sizes: list[int], timing: TimingConfig
               ) -> list[dict[str, Any]] | None:
    os.environ["SHARDKIT_HOST_ID"] = f"bench-host-{rank // per_host}"
    init_groups(rank, world, store, 300, gloo=False)
    from shardkit._collective_identity import collectives_for
    from shardkit.backend import compare_identities_across_hosts

    checking = dist.new_group(list(range(world)))  # the same ranks, comparing identities across hosts
    compare_identities_across_hosts(checking)
    rows = []
    for size in sizes:
        numel = size // 4
        shard, full = torch.ones(numel), torch.empty(numel * world)
        scattered = torch.empty(numel)

        def call(op: str, group: Any) -> Callable[[], None]:
            def run() -> None:
                with collectives_for("FSDP unit 'bench' (the benchmark's unit)"):
                    if op == "all_gather":
                        all_gather_single(full, shard, group=group)
                    else:
                        reduce_scatter_single(scattered, full, group=group)
            return run

        calls, barriers = {}, {}
        for op in ("all_gather", "reduce_scatter"):
            for name, group in ((op, None), (f"{op} checked", checking)):
                calls[name] = call(op, group)
                barriers[name] = functools.partial(dist.barrier, group=group)
        timings = time_interleaved(calls, barriers, None, timing)
        for op in ("all_gather", "reduce_scatter"):
            plain, checked = timings[op], timings[f"{op} checked"]
            rows.append({"op": op, "size_bytes": size, "plain_s": plain.seconds, "checked_s": checked.seconds,
                         "ratio": checked.seconds / plain.seconds, "added_s": checked.seconds - plain.seconds,
                         "plain_samples_s": plain.samples, "checked_samples_s": checked.samples})
    return rows if rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="bytes per rank (e.g. 64K 1M)")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    timing = TimingConfig(reps=args.reps, point_s=1.0)
    results: dict[str, Any] = {"machine": machine_info(), "topologies": {}}
    with ForeignLoad() as load:
        for name in args.topologies:
            hosts, per_host = TOPOLOGIES[name]
            print(f"{name}: {hosts} host(s) x {per_host} rank(s)", file=sys.stderr, flush=True)
            rows = launch_ranks(_rank_main, hosts * per_host, per_host, sizes, timing)[0]
            results["topologies"][name] = rows
            table = [[r["op"], format_size(r["size_bytes"]), format_us(r["plain_s"]), format_us(r["checked_s"]),
                      format_us(r["added_s"]), f"{r['ratio']:.3f}x"] for r in rows]
            print(f"\n=== {name} ({hosts} simulated host(s) x {per_host} rank(s)): a group comparing identities across "
                  f"hosts vs one that does not, both carrying an identity; interleaved, "
                  f"median of {args.reps} ===")
            print(format_table(["op", "per rank", "plain µs", "checked µs", "added µs", "ratio"], table))
    results["foreign_load_cores"] = load.cores
    print(f"\nforeign load: {load.cores:.2f} cores; wrote {write_json(RESULTS, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

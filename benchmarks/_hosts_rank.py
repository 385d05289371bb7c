"""One rank of benchmarks/hosts.py, started by torchrun on each namespace host: times the collectives that cross
the hosts' shaped links on the shardkit backend (its hierarchical engine, with rails and with the leader scheme:
SHARDKIT_INTER_HOST) and on torch's gloo, interleaved.

    _hosts_rank.py OUT.json --bytes N --reps R

Rank 0 writes OUT.json: the host topology shardkit found, and per (op, backend) the slowest rank's seconds of
each repetition. A repetition of each (op, backend) runs before the next repetition of any, the order rotating,
after a gloo barrier; each result is checked against the exact answer (small integers in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import shardkit  # noqa: F401  (registers the backend)
from shardkit.backend import host_topology

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--bytes", type=int, required=True, help="the larger side of each op, per rank")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    os.environ["SHARDKIT_INTER_HOST"] = "rails"
    dist.init_process_group("shardkit", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["SHARDKIT_INTER_HOST"] = "leaders"
    leaders = dist.new_group(backend="shardkit")
    gloo = dist.new_group(backend="gloo")
    groups = {"shardkit": dist.group.WORLD, "shardkit-leaders": leaders, "gloo": gloo}
    n = args.bytes // 4 // world * world  # elements of the larger side, a multiple of world
    big, small = torch.empty(n), torch.empty(n // world)

    def run(op: str, group) -> None:
        if op == "all_reduce":
            big.fill_(rank + 1)
            dist.all_reduce(big, group=group)
            assert big[0].item() == world * (world + 1) / 2 and big[-1].item() == big[0].item()
        elif op == "all_gather_into_tensor":
            small.fill_(rank + 1)
            dist.all_gather_into_tensor(big, small, group=group)
            assert big[0].item() == 1 and big[-1].item() == world
        else:
            big.fill_(rank + 1)
            dist.reduce_scatter_tensor(small, big, group=group)
            assert small[0].item() == world * (world + 1) / 2

    pairs = [(op, backend) for op in OPS for backend in groups]
    for op, backend in pairs:  # warm-up: connections, shared buffers, page faults
        run(op, groups[backend])
    seconds = {f"{op}/{backend}": [] for op, backend in pairs}
    for rep in range(args.reps):
        shift = rep % len(pairs)
        for op, backend in pairs[shift:] + pairs[:shift]:
            dist.barrier(group=gloo)
            start = time.perf_counter()
            run(op, groups[backend])
            seconds[f"{op}/{backend}"].append(time.perf_counter() - start)
    flat = torch.tensor([s for key in seconds for s in seconds[key]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=gloo)  # the slowest rank's time
    if rank == 0:
        values = iter(flat.tolist())
        result = {"world": world, "elements": n, "bytes": n * 4,
                  "host_of": list(host_topology(dist.group.WORLD).host_of),
                  "seconds": {key: [next(values) for _ in range(args.reps)] for key in seconds}}
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

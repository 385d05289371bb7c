"""One rank of benchmarks/hosts.py, started by torchrun on each namespace host: times the collectives that cross
the hosts' shaped links on the shardkit backend (its hierarchical engine, with rails and with the leader scheme:
SHARDKIT_INTER_HOST; and rails with int8 inter-host bytes: shardkit.Quantized) and on torch's gloo, interleaved.

    _hosts_rank.py OUT.json --bytes N --reps R

Rank 0 writes OUT.json: the host topology shardkit found, per (op, backend) the slowest rank's seconds of each
repetition, and per (op, shardkit backend) the bytes each rank sent to other hosts in one op
(shardkit.backend.inter_host_bytes). A repetition of each (op, backend) runs before the next repetition of any, the
order rotating, after a gloo barrier; each result is checked against the exact answer (small integers in float32).
That holds for int8 too: the fills are constant (rank + 1), so every block's absmax codes as 127 and comes back
exactly (c / 127 * 127 rounds to c in f32 for the partial sums 1..10 these ranks send), and so do the sums.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import shardkit
from _harness import agree_max, rotated  # the benchmarks folder, the script's own (not a package)
from shardkit.backend import host_topology, inter_host_bytes
from shardkit.quantized import inter_host_format

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
# The quantized column: the default (rails) group, every op inside this wire format.
INT8 = shardkit.Quantized(weights="int8", grads="int8", block=256)


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
    groups = {"shardkit": dist.group.WORLD, "shardkit-int8": dist.group.WORLD, "shardkit-leaders": leaders,
              "gloo": gloo}
    formats = {"shardkit-int8": INT8}  # the others run exact
    counted = [b for b in groups if b != "gloo"]  # inter_host_bytes is the shardkit backend's counter
    n = args.bytes // 4 // world * world  # elements of the larger side, a multiple of world
    big, small = torch.empty(n), torch.empty(n // world)

    def run(op: str, backend: str) -> None:
        group = groups[backend]
        with inter_host_format(formats[backend]) if backend in formats else contextlib.nullcontext():
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
        run(op, backend)
    seconds = {f"{op}/{backend}": [] for op, backend in pairs}
    sent = {f"{op}/{backend}": [] for op, backend in pairs if backend in counted}  # this rank's bytes per rep
    for rep in range(args.reps):
        for op, backend in rotated(pairs, rep):
            dist.barrier(group=gloo)
            before = inter_host_bytes(groups[backend]) if backend in counted else 0
            start = time.perf_counter()
            run(op, backend)
            seconds[f"{op}/{backend}"].append(time.perf_counter() - start)
            if backend in counted:
                sent[f"{op}/{backend}"].append(inter_host_bytes(groups[backend]) - before)
    flat = agree_max([s for key in seconds for s in seconds[key]], gloo)  # the slowest rank's time
    # Every rank's bytes per op: the largest of its repetitions (they are equal: the op's sizes fix them).
    mine = torch.tensor([max(sent[key]) for key in sent] + [min(sent[key]) for key in sent], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=gloo)
    if rank == 0:
        values = iter(flat)
        wire = {}
        for i, key in enumerate(sent):
            by_rank = [int(t[i]) for t in everyone]
            wire[key] = {"rank0": by_rank[0], "max": max(by_rank), "by_rank": by_rank,
                         "same_every_rep": all(int(t[i]) == int(t[len(sent) + i]) for t in everyone)}
        result = {"world": world, "elements": n, "bytes": n * 4,
                  "host_of": list(host_topology(dist.group.WORLD).host_of),
                  "seconds": {key: [next(values) for _ in range(args.reps)] for key in seconds},
                  "inter_host_bytes_per_op": wire}
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A first shardkit job: `torchrun --standalone --nproc_per_node=2 examples/collectives_demo.py`.

Initialises the "shardkit" backend (shared memory between the ranks of this host), runs a few
collectives, checks each result against what torch.distributed promises, and times a 16 MiB allreduce
next to gloo's in the same job.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import shardkit  # noqa: F401  (registers the "shardkit" backend)


def timed_allreduce(tensor: torch.Tensor, group, repeats: int = 5) -> float:
    dist.all_reduce(tensor, group=group)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor, group=group)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    dist.init_process_group("shardkit")
    rank, world = dist.get_rank(), dist.get_world_size()

    grads = torch.full((4,), float(rank + 1))
    dist.all_reduce(grads, op=dist.ReduceOp.AVG)
    assert torch.allclose(grads, torch.full((4,), (world + 1) / 2))

    gathered = [torch.empty(2, dtype=torch.long) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, rank * rank]))
    assert [g.tolist() for g in gathered] == [[r, r * r] for r in range(world)]

    settings = torch.tensor([0.1, float(rank)], dtype=torch.float64)  # rank 0's learning rate and rank
    dist.broadcast(settings, src=0)
    assert settings.tolist() == [0.1, 0.0]

    gloo = dist.new_group(backend="gloo")
    big = torch.randn(4 << 20)  # 16 MiB of float32
    shardkit_s = timed_allreduce(big.clone(), None)
    gloo_s = timed_allreduce(big.clone(), gloo)
    if rank == 0:
        print(f"shardkit demo: {world} ranks, allreduce/allgather/broadcast all correct")
        print(f"16 MiB allreduce: shardkit {shardkit_s * 1e3:.2f} ms, gloo {gloo_s * 1e3:.2f} ms "
              f"({gloo_s / shardkit_s:.1f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

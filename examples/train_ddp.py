"""Train a small model with shardkit: `torchrun --standalone --nproc_per_node=2 examples/train_ddp.py`.

The switch from torch's DDP is one line (shardkit.DistributedDataParallel); the process group is shardkit's
shared-memory backend. Each rank trains on its own shard of a synthetic regression task; at the end every
rank checks that all replicas hold bitwise identical parameters.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import shardkit


def make_data(rank: int, world: int, samples: int = 4096, features: int = 32):
    """A fixed random linear teacher plus noise; rank r takes every world-th sample."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(features, 1, generator=g)
    x = torch.randn(samples, features, generator=g)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(samples, 1, generator=g)
    return x[rank::world], y[rank::world]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    dist.init_process_group("shardkit")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different inits on purpose: DDP broadcasts rank 0's at construction
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    model = shardkit.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = make_data(rank, world)

    start = time.perf_counter()
    for step in range(args.steps):
        i = (step * args.batch) % (x.shape[0] - args.batch)
        loss = nn.functional.mse_loss(model(x[i:i + args.batch]), y[i:i + args.batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step:4d}  loss {mean_loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(r, replicas[0]) for r in replicas)
    if rank == 0:
        print(f"{world} ranks, {args.steps} steps in {elapsed:.1f} s; replicas identical: {identical}")
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()

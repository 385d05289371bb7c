"""One rank as ``srun python train.py`` starts it: SLURM's variables only, none of torchrun's (test_launchers.py).

The process joins the job through ``init_process_group("shardkit", init_method="slurm://")`` before importing
shardkit (the backend's name and the rendezvous come from the wheel's autoload entry point), then trains a small
model with shardkit's DDP on the world group and torch's DDP on a gloo group over the same ranks, and writes what
it saw to ``<out>/rank<R>.json``: SLURM's placement, shardkit's host grouping, ``shardkit.auto``'s memory budget,
both runs' losses and parameters.

    python srun_rank.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def train(make_ddp, group: dist.ProcessGroup, rank: int) -> tuple[list[float], list[list[float]]]:
    torch.manual_seed(0)
    model = make_ddp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().flatten().tolist() for p in model.parameters()]


def main(out_dir: str) -> None:
    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    assert not present, f"torchrun's variables are set: {present}"
    assert "shardkit" not in sys.modules
    dist.init_process_group("shardkit", init_method="slurm://")
    rank = dist.get_rank()

    import shardkit
    from shardkit import launchers, strategy
    from shardkit.backend import host_topology

    topology = host_topology()
    placement = launchers.slurm_placement()
    model = nn.Linear(4, 4)
    plan = strategy.agreed_plan(list(model.parameters()), "adam", None, dist.group.WORLD)
    with open("/proc/meminfo") as meminfo:
        available_gb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 2**20
    gloo = dist.new_group(backend="gloo")
    ours = train(lambda m, g: shardkit.DistributedDataParallel(m), dist.group.WORLD, rank)
    reference = train(lambda m, g: nn.parallel.DistributedDataParallel(m, process_group=g), gloo, rank)
    record = {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(),
              "placement": placement.__dict__, "host_of": topology.host_of, "local_of": topology.local_of,
              "budget_gb": plan.budget_gb, "available_gb": available_gb, "ours": ours, "reference": reference}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

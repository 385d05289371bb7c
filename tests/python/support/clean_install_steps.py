"""A few training steps of shardkit's DDP (zero_stage 0), ZeRO-1, ZeRO-2 and FSDP, each against torch's DDP.

Run under torchrun by tests/python/test_clean_install.py, from a venv that holds only torch and the shardkit
wheel (no numpy, no pytest), so it imports nothing but torch and shardkit. On every rank, one seeded model
goes into torch's DDP with a plain AdamW on a gloo group (the oracle; torch's DDP needs no numpy) and into
shardkit's DDP on the "shardkit" group with AdamW or shardkit.ZeroRedundancyOptimizer(AdamW); both take the
same per-rank batches (ranks differ in data and batch size). After the steps the parameters must match
torch's (fp32: rtol 1e-5, atol 1e-6) and, under ZeRO, consolidate_state_dict(to=0) + state_dict() on rank 0
must match the plain optimizer's state; shardkit's FullyShardedDataParallel (FULL_SHARD, one unit per Linear)
must give the same full state dict. Prints one line per stage and rank; raises on any mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shardkit

STEPS = 3


def say(line: str) -> None:
    """One write per line: both ranks share torchrun's stdout, and print() may write the newline separately."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5 + rank, 8, generator=g), torch.randn(5 + rank, 4, generator=g)


def train(ddp: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()


def check_stage(stage: int, rank: int, gloo: dist.ProcessGroup) -> None:
    ref = TorchDDP(model(), process_group=gloo)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    ours = shardkit.DistributedDataParallel(model(), zero_stage=stage)
    if stage == 0:
        opt = torch.optim.AdamW(ours.parameters(), lr=0.01)
    else:
        opt = shardkit.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    train(ref, ref_opt, rank)
    train(ours, opt, rank)
    for (name, want), got in zip(ref.module.named_parameters(), ours.module.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage}, {name}: {m}")
    what = "parameters"
    if stage > 0:
        opt.consolidate_state_dict(to=0)  # every rank takes part; rank 0 gets the whole state
        if rank == 0:
            got_state, want_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
            assert sorted(got_state) == sorted(want_state), (sorted(got_state), sorted(want_state))
            for index, want in want_state.items():
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(got_state[index][key], want[key], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"stage {stage}, state {index}.{key}: {m}")
            what = "parameters and consolidated optimizer state"
    say(f"rank {rank}: zero_stage={stage}: {what} match torch DDP after {STEPS} steps")


def check_fsdp(rank: int, gloo: dist.ProcessGroup) -> None:
    ref = TorchDDP(model(), process_group=gloo)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    ours = shardkit.FullyShardedDataParallel(model(), auto_wrap_policy={nn.Linear})
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01)
    train(ref, ref_opt, rank)
    train(ours, opt, rank)
    full = ours.state_dict()
    for name, want in ref.module.state_dict().items():
        torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"fsdp, {name}: {m}")
    say(f"rank {rank}: FullyShardedDataParallel: parameters match torch DDP after {STEPS} steps")


def main() -> None:
    dist.init_process_group("shardkit")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    if rank == 0:
        say(f"shardkit from {shardkit.__file__}")
    for stage in (0, 1, 2):
        check_stage(stage, rank, gloo)
    check_fsdp(rank, gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

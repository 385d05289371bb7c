"""The train loop test_ray_train.py hands to Ray Train's TorchTrainer; it runs in each Ray worker.

Nothing of shardkit is imported at module level: Ray's TorchConfig makes the process group by the backend's name
before the loop starts, so ``backend="shardkit"`` must be found through torch's extension autoloading (the wheel's
``torch.backends`` entry point), as in a user's loop. The loop imports shardkit only for its wrappers, after the
group exists.

Each rank writes what it saw and trained to ``<out>/<tag>-rank<r>.json``: the backend, the env vars Ray set, which
modules were loaded when the loop started, and per front (DDP, then fully_shard per layer and root) the losses and a
sha256 of every parameter's bytes (gathered whole with ``full_tensor()`` for fully_shard) after the last step.
With ``kill_at``, rank 1 SIGKILLs itself in that step of the DDP run (see ``_die_just_after_a_poll``); the files
``<tag>-rank1-killed.json`` and ``<tag>-rank0-failed.json`` then say when it died and when and how rank 0 failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
D_IN, D_HIDDEN, D_OUT, ROWS = 8, 32, 4, 16
REPLY_GRACE_S = 0.3  # after the poll that took its report, rank 1 lets the poll's reply leave before dying


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_HIDDEN), nn.Tanh(),
                         nn.Linear(D_HIDDEN, D_OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(ROWS, D_IN, generator=g), torch.randn(ROWS, D_OUT, generator=g)


def digest(module: nn.Module) -> str:
    """sha256 over every parameter's name and bytes, whole (DTensors gathered with full_tensor())."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in module.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(whole.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(wrapped: nn.Module, rank: int, config: dict[str, Any]) -> list[float]:
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(wrapped(x), y)
        if config.get("kill_at") == step:
            _die_just_after_a_poll(rank, config)
        loss.backward()  # DDP's gradient allreduce: where rank 0 waits for a rank that died
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _die_just_after_a_poll(rank: int, config: dict[str, Any]) -> None:
    """Rank 1 SIGKILLs itself between its forward and its backward, just after Ray's controller polled the workers;
    rank 0 goes on into the backward's allreduce and fails there.

    Ray Train V2 fails the run on the first poll (every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s) that finds any error,
    with the errors of that poll only. Dying just after a poll leaves rank 0 the interval (shardkit needs up to 0.2 s to
    see the pid gone) to fail before the next poll, so that poll finds both errors. How: both ranks report twice.
    ray.train.report's queue holds one report and a poll takes one, so the second put returns only once a poll took
    the first (or at once when a poll took it during the cross-rank barrier between the two): either way just after
    a poll."""
    import ray.train

    for i in range(2):
        ray.train.report({"sync": i})
    if rank != 1:
        return
    polled = time.time()
    time.sleep(REPLY_GRACE_S)
    note = {"pid": os.getpid(), "polled": polled, "killed": time.time()}
    Path(config["out"], f"{config['tag']}-rank1-killed.json").write_text(json.dumps(note))
    os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``. ``config``: out (a folder), tag (the files' prefix), backend (the one
    TorchConfig names, asserted here), wrappers ("shardkit" or "torch": whose DistributedDataParallel and
    fully_shard), kill_at (the step of the DDP run in which rank 1 kills itself; absent: none)."""
    started = time.time()
    loaded_at_start = sorted(m for m in sys.modules if "shardkit" in m and "." not in m)
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    assert backend == config["backend"], f"rank {rank}: the process group's backend is {backend!r}"
    seen: dict[str, Any] = {
        "backend": backend,
        "world": world,
        "pid": os.getpid(),
        "loaded_at_start": loaded_at_start,
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                                "MASTER_ADDR", "OMP_NUM_THREADS", "TORCH_DEVICE_BACKEND_AUTOLOAD",
                                                "SHARDKIT_SHM_TAG")},
        "initial_sha256": digest(model()),
    }
    if config["wrappers"] == "shardkit":
        import shardkit

        seen["shardkit_file"] = shardkit.__file__
        ddp_class, shard = shardkit.DistributedDataParallel, shardkit.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
        from torch.nn.parallel import DistributedDataParallel as ddp_class
    # where each wrapper is defined (shardkit.fully_shard carries torch's __module__: functools.wraps)
    seen["wrappers"] = [f"{ddp_class.__module__}.{ddp_class.__name__}", shard.__code__.co_filename]

    ddp = ddp_class(model())
    try:
        seen["ddp"] = {"losses": _train(ddp, rank, config), "sha256": digest(ddp.module)}
    except Exception as error:
        failed = {"failed": time.time(), "error": f"{type(error).__name__}: {error}"}
        Path(config["out"], f"{config['tag']}-rank{rank}-failed.json").write_text(json.dumps(failed))
        raise

    sharded = model()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            shard(layer)
    shard(sharded)
    seen["fully_shard"] = {"losses": _train(sharded, rank, {}), "sha256": digest(sharded)}
    seen["seconds"] = time.time() - started
    Path(config["out"], f"{config['tag']}-rank{rank}.json").write_text(json.dumps(seen))

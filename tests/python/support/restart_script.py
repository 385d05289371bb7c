"""A training job that a rank kills (SIGKILL) so that torchrun restarts it: tests/python/test_restarts.py and
tests/chaos/restart_cycles.py run it under ``torchrun --max-restarts N``.

    restart_script.py --front F[,F...] --markers DIR [--kill-at STEP] [--kills N] [--seed S] [--steps N]

``--front``, one or several (comma-separated: a killed attempt ``A`` trains the ``A % len``-th, the last attempt
trains each in turn, on one group; so one job covers several fronts' kill and restart with fewer interpreter
start-ups): ``fully_shard`` (shardkit.fully_shard), ``fsdp`` (shardkit.FullyShardedDataParallel), ``zero2``
(shardkit.DistributedDataParallel(zero_stage=2) with ZeroRedundancyOptimizer), ``ddp``
(shardkit.DistributedDataParallel), all on the "shardkit" backend; ``torch_fsdp2`` (torch's fully_shard) and
``torch_ddp`` (torch's DistributedDataParallel) on torch's gloo, started on ``shardkit.attempt_store()`` unless
``--plain-gloo`` (init_process_group("gloo") as torch's docs show: the failure the work-around is for).

The attempt is torchrun's TORCHELASTIC_RESTART_COUNT. Attempts below ``--kills`` (default 1) are killed: with
``--kill-at STEP``, rank 1 kills itself after STEP optimizer steps; else (``--seed``) a rank drawn from the seed and
the attempt kills itself, at a moment drawn from them: in 3 of 10 attempts a time since the process began (0 to
``--max-delay`` seconds: in the imports, the start-up or training), else after a training step (0 to 11); the others
train until torchrun stops them. The last attempt trains ``--steps`` steps of each front to the end.

Each rank writes ``DIR/attempt<A>.rank<R>.began`` first (the wall time of the process's start and its pid),
``.started`` once its group has started (after a first barrier: the wall time, and the seconds since the process
began), ``.error`` where it raised (the wall time and the error), ``.done`` at the end (each front's final loss); a
victim writes ``DIR/attempt<A>.killed`` (the wall time and its rank) just before it kills itself.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from pathlib import Path

_BEGAN = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

FRONTS = ("fully_shard", "fsdp", "zero2", "ddp", "torch_fsdp2", "torch_ddp")


def kill_self(markers: Path, attempt: int, rank: int) -> None:
    (markers / f"attempt{attempt}.killed").write_text(f"{time.time():.6f} {rank}")
    os.kill(os.getpid(), signal.SIGKILL)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def wrap(front: str, module: torch.nn.Module):
    """The model as the front trains it, and its optimizer."""
    import shardkit

    if front == "fully_shard":
        for layer in (module[0], module[2]):
            shardkit.fully_shard(layer)
        wrapped = shardkit.fully_shard(module)
    elif front == "fsdp":
        wrapped = shardkit.FullyShardedDataParallel(module)
    elif front == "zero2":
        wrapped = shardkit.DistributedDataParallel(module, zero_stage=2)
        return wrapped, shardkit.ZeroRedundancyOptimizer(wrapped.parameters(), torch.optim.SGD, lr=0.05)
    elif front == "ddp":
        wrapped = shardkit.DistributedDataParallel(module)
    elif front == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (module[0], module[2]):
            fully_shard(layer)
        wrapped = fully_shard(module)
    elif front == "torch_ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(module)
    else:
        raise ValueError(f"unknown front {front!r}")
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", required=True)
    parser.add_argument("--markers", type=Path, required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--plain-gloo", action="store_true")
    args = parser.parse_args()
    fronts = args.front.split(",")
    if not fronts or any(front not in FRONTS for front in fronts) or len({f.startswith("torch_") for f in fronts}) > 1:
        parser.error(f"--front: one or more of {FRONTS}, all shardkit's or all torch's, got {args.front!r}")
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    began = time.time() - (time.monotonic() - _BEGAN)
    (args.markers / f"attempt{attempt}.rank{rank}.began").write_text(f"{began:.6f} {os.getpid()}")
    killed = attempt < args.kills
    kill_at = None
    if killed and args.kill_at is not None:
        kill_at = args.kill_at if rank == 1 else None
    elif killed:
        draw = random.Random(args.seed * 1000 + attempt)
        victim, by_time, delay, step = (draw.randrange(world), draw.random() < 0.3, draw.uniform(0.0, args.max_delay),
                                        draw.randrange(12))
        if rank == victim and by_time:
            threading.Timer(max(0.0, delay - (time.monotonic() - _BEGAN)), kill_self,
                            (args.markers, attempt, rank)).start()
        elif rank == victim:
            kill_at = step
    try:
        train(args, fronts, attempt, rank, world, killed, kill_at)
    except Exception as error:
        # For tests/chaos/restart_cycles.py: when this rank failed, and why (a failure before the attempt's kill,
        # or one naming an earlier attempt's pid, is a restart that did not start up).
        (args.markers / f"attempt{attempt}.rank{rank}.error").write_text(f"{time.time():.6f} {error}")
        raise


def train(args: argparse.Namespace, fronts: list[str], attempt: int, rank: int, world: int, killed: bool,
          kill_at: int | None) -> None:
    import shardkit

    if fronts[0].startswith("torch_"):
        if args.plain_gloo:
            dist.init_process_group("gloo")
        else:
            store, rank, world = shardkit.attempt_store()
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("shardkit")
    dist.barrier()  # every rank's start-up is through
    (args.markers / f"attempt{attempt}.rank{rank}.started").write_text(
        f"{time.time():.6f} {time.monotonic() - _BEGAN:.3f}")
    losses = []
    for front in [fronts[attempt % len(fronts)]] if killed else fronts:
        wrapped, optimizer = wrap(front, model())
        generator = torch.Generator().manual_seed(100 + rank)
        step = 0
        while True:
            if kill_at is not None and step == kill_at:
                kill_self(args.markers, attempt, rank)
            inputs = torch.randn(8, 16, generator=generator)
            loss = wrapped(inputs).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if not killed and step == args.steps:
                break
            if killed:
                time.sleep(0.01)  # until this rank, a peer or torchrun ends the process
        losses.append(f"{front} {loss.item()!r}")
    (args.markers / f"attempt{attempt}.rank{rank}.done").write_text("\n".join(losses))
    # torch's gloo worker completes a Work's future before it drops its own reference, and dropping the last one
    # needs the GIL (the Work's captured thread-local state holds a Python object): a worker still there when the
    # interpreter finalizes ends the process in std::terminate (seen: torch's DDP on gloo, 1 run in 4 on a 2-core
    # VM). Sleeping releases the GIL and lets it finish first.
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""How long a checkpoint save blocks training: shardkit's asynchronous save against its synchronous one and torch's
``dcp.async_save`` (thread and process), on a >= 1 GB state at world 2; and a training step's time while an
asynchronous save is in flight against without.

    python benchmarks/checkpoint_async.py                  # 1 GB, 1 warm-up + 3 timed rounds (~2 minutes)
    python benchmarks/checkpoint_async.py --gb 0.2 --rounds 1

The state: ``--tensors`` float32 DTensors (Shard(0) over a CPU device mesh of both ranks, on the shardkit
backend), ``--gb`` in all, random values (checkpoint_integrity.py's). Four saves, each on every rank after a
barrier, into a removed directory:

  shardkit async     shardkit.checkpoint.save(state, DIR, async_save=True): staging copy (into buffers reused
                     from the warm-up round on), then the handle; the writer thread does the rest
  shardkit sync      shardkit.checkpoint.save(state, DIR): the whole commit protocol (the anchor)
  dcp async thread   torch.distributed.checkpoint.async_save(state, checkpoint_id=DIR) (default: thread)
  dcp async process  the same with async_checkpointer_type=AsyncCheckpointerType.PROCESS

"blocking" is the time until the call returns (the slowest rank's); "to durable" until the save has ended
(result()). An asynchronous save is waited for, untimed, before the next operation. Rounds rotate the order.

The step: ``--step-matmuls`` float32 1024x1024 matmuls and one 4 MiB all-reduce on the default (shardkit) group,
a stand-in for a training step's compute and gradient exchange. Its time without a save (median of 8 steps)
against its time while a shardkit asynchronous save of the state is in flight (every step that starts before
the save has ended; median), each round. The machine's other load is recorded (ForeignLoad): on 2 shared
cores the writer thread (CRC32C, writes, fsync) competes with the step for the CPU.

Targets (issue #39): shardkit async blocking <= 0.1x shardkit sync; step during a save <= 1.2x without.

Results: ``benchmarks/results/checkpoint_async.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import filesystem_of, format_table  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    add_target,
    agree_max,
    init_groups,
    interleaved_rounds,
    launch_ranks,
    machine_info,
    rank0_progress,
    write_json,
    wrote,
)
from checkpoint_integrity import dtensor_state  # noqa: E402

SAVES = ("shardkit async", "shardkit sync", "dcp async thread", "dcp async process")


def _step_fn(matmuls: int) -> Callable[[], None]:
    a = torch.rand(1024, 1024)
    b = torch.rand(1024, 1024)
    grads = torch.rand(1 << 20)

    def step() -> None:
        c = a
        for _ in range(matmuls):
            c = torch.tanh(c @ b)
        dist.all_reduce(grads)  # the default (shardkit) group: training's
        grads.mul_(0.5)

    return step


def _rank(rank: int, world: int, store: str, scratch: str, total_bytes: int, tensors: int, rounds: int,
          warmup: int, matmuls: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from shardkit import checkpoint

    bench = init_groups(rank, world, store, 600)
    progress = rank0_progress(rank, "checkpoint_async: ")
    state = dtensor_state(rank, world, total_bytes, tensors)
    step = _step_fn(matmuls)

    def path(name: str) -> str:
        return os.path.join(scratch, name.replace(" ", "-"))

    def start(name: str) -> Callable[[], None]:
        """Starts save ``name``; returns what waits for it to end."""
        if name == "shardkit sync":
            checkpoint.save(state, path(name))
            return lambda: None
        if name == "shardkit async":
            return checkpoint.save(state, path(name), async_save=True).result
        kind = AsyncCheckpointerType.PROCESS if name == "dcp async process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save(state, checkpoint_id=path(name), async_checkpointer_type=kind)
        return future.result

    blocking: dict[str, list[float]] = {name: [] for name in SAVES}
    durable: dict[str, list[float]] = {name: [] for name in SAVES}
    failed: dict[str, str] = {}
    step_alone: list[float] = []
    step_during: list[float] = []
    steps_during: list[int] = []
    for _r, order, timed in interleaved_rounds(SAVES, warmup, rounds, progress, label="round", done=" done"):
        for name in order:
            if name in failed:
                continue
            if rank == 0:
                shutil.rmtree(path(name), ignore_errors=True)
                os.sync()
            dist.barrier(group=bench)
            began = time.perf_counter()
            try:
                wait = start(name)
                returned = time.perf_counter()
                wait()
            except Exception:  # noqa: BLE001 - a save that fails is a failed row, with its reason
                failed[name] = traceback.format_exc(limit=4)[-1500:]
                continue
            ended = time.perf_counter()
            if timed:
                blocking[name].append(returned - began)
                durable[name].append(ended - began)
        # the step, alone and during a shardkit async save
        dist.barrier(group=bench)
        alone = []
        for _ in range(8):
            t0 = time.perf_counter()
            step()
            alone.append(time.perf_counter() - t0)
        if rank == 0:
            shutil.rmtree(path("shardkit async"), ignore_errors=True)
            os.sync()
        dist.barrier(group=bench)
        handle = checkpoint.save(state, path("shardkit async"), async_save=True)
        during = []
        while True:  # at least one step; the same count on every rank: agreed after each on the bench group
            t0 = time.perf_counter()
            step()
            during.append(time.perf_counter() - t0)
            flag = torch.tensor([0 if handle.done() else 1])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=bench)
            if not int(flag):
                break
        handle.result()
        if timed:
            step_alone.append(statistics.median(alone))
            step_during.append(statistics.median(during))
            steps_during.append(len(during))
    agreed_failures = [None] * world
    dist.all_gather_object(agreed_failures, failed, group=bench)
    return {"blocking": {n: agree_max(v, bench) if n not in failed else [] for n, v in blocking.items()},
            "durable": {n: agree_max(v, bench) if n not in failed else [] for n, v in durable.items()},
            "step_alone": agree_max(step_alone, bench), "step_during": agree_max(step_during, bench),
            "steps_during": steps_during, "failed": {k: v for f in agreed_failures for k, v in (f or {}).items()},
            "bytes_per_rank": sum(v.to_local().nbytes for v in state["model"].values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (10^9 bytes), over both ranks")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--step-matmuls", type=int, default=2)
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "checkpoint_async.json")
    args = p.parse_args(argv)
    total = int(args.gb * 1e9)
    machine = machine_info()
    scratch = Path(tempfile.mkdtemp(prefix="shardkit-ckpt-async-", dir=args.scratch))
    try:
        with ForeignLoad() as load:
            per_rank = launch_ranks(_rank, 2, str(scratch), total, args.tensors, args.rounds, args.warmup,
                                    args.step_matmuls, timeout=3600, daemon=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = per_rank[0]
    checkpoint_bytes = sum(r["bytes_per_rank"] for r in per_rank)
    medians = {n: statistics.median(v) for n, v in result["blocking"].items() if v}
    durable = {n: statistics.median(v) for n, v in result["durable"].items() if v}
    rows = [[n, f"{medians[n] * 1e3:.0f} ms", f"{min(result['blocking'][n]) * 1e3:.0f} ms",
             f"{durable[n] * 1e3:.0f} ms"] for n in SAVES if n in medians]
    print(f"checkpoint of {checkpoint_bytes / 1e9:.2f} GB at world 2 ({args.rounds} rounds; scratch on "
          f"{filesystem_of(str(args.scratch))}; other load {load.cores or 0:.2f} cores)")
    print(format_table(["save", "blocking (median)", "blocking (best)", "to durable (median)"], rows))
    for name, why in result["failed"].items():
        print(f"{name}: FAILED: {why.strip().splitlines()[-1]}")
    ratio = medians["shardkit async"] / medians["shardkit sync"]
    step_ratio = statistics.median(result["step_during"]) / statistics.median(result["step_alone"])
    print(f"step during an async save: {statistics.median(result['step_during']) * 1e3:.0f} ms, without: "
          f"{statistics.median(result['step_alone']) * 1e3:.0f} ms ({result['steps_during']} steps per save)")
    targets: list[dict[str, Any]] = []
    add_target(targets, "shardkit async save's blocking time ÷ shardkit sync save's (1 GB, world 2)", ratio, 0.1,
               higher_is_better=False, unit="×")
    add_target(targets, "training step during an async save ÷ without", step_ratio, 1.2, higher_is_better=False,
               unit="×")
    write_json(args.out, {"machine": machine, "scratch_filesystem": filesystem_of(str(args.scratch)),
                          "foreign_load_cores": load.cores, "world": 2, "checkpoint_bytes": checkpoint_bytes,
                          "tensors": args.tensors, "rounds": args.rounds, "warmup": args.warmup,
                          "blocking_s": result["blocking"], "durable_s": result["durable"],
                          "median_blocking_s": medians, "median_durable_s": durable, "failed": result["failed"],
                          "step_alone_s": result["step_alone"], "step_during_s": result["step_during"],
                          "steps_during": result["steps_during"], "async_over_sync_blocking": ratio,
                          "step_during_over_alone": step_ratio, "targets": targets})
    print(wrote(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What shardkit's checkpoint commit point and checksums cost: save and load of a 1 GB checkpoint at world 2,
shardkit.checkpoint against plain torch.distributed.checkpoint in the same run, and the raw CRC32C throughput.

    python benchmarks/checkpoint_integrity.py                  # 1 GB, 7 timed rounds (~2 minutes)
    python benchmarks/checkpoint_integrity.py --gb 0.1 --rounds 2

The state: ``--tensors`` float32 DTensors (Shard(0) over a CPU device mesh of both ranks, on the shardkit
backend), ``--gb`` in all, so each rank holds and writes half; random values. Five operations, each on every
rank, each after a barrier, its time the slowest rank's:

  save         shardkit.checkpoint.save(state, DIR_A): staging, CRC32C while writing, fsync, manifest, rename
  dcp save     torch.distributed.checkpoint.save(state, checkpoint_id=DIR_B): the anchor (fsync'ed too)
  load         shardkit.checkpoint.load(skeleton, DIR_A, strict=False): every file's CRC32C checked (each rank
               reads half), then dcp.load
  load verify=False   the same with sizes checked only
  dcp load     torch.distributed.checkpoint.load(skeleton, checkpoint_id=DIR_B): the anchor

Saves go into removed directories (the removal is not timed), so both write a fresh checkpoint; loads read
files just written (from the page cache, as a resume right after a save would). Before every operation rank 0
calls sync(), so an earlier operation's dirty pages are not flushed inside the next one. The skeleton is filled
with NaN before every load and compared bit for bit with the state after it (untimed): a load that misses
anything fails the run. A warm-up round first; then in round r the five take turns in an order rotated by r;
medians over rounds, ratios of medians (shardkit / plain DCP) and medians of the per-round ratios.

The raw throughput: shardkit._C.crc32c over one in-memory buffer of ``--gb`` bytes in this process (one core),
median of 5.

Results: ``benchmarks/results/checkpoint_integrity.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import filesystem_of, format_table  # noqa: E402  (the benchmarks folder is not a package)
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    agree_max,
    init_groups,
    interleaved_rounds,
    launch_ranks,
    machine_info,
    rank0_progress,
    rotated,
    round_ratios,
    write_json,
    wrote,
)

OPERATIONS = ("save", "dcp save", "load", "load verify=False", "dcp load")


def dtensor_state(rank: int, world: int, total_bytes: int, tensors: int) -> dict[str, Any]:
    """A checkpoint's worth of ``total_bytes`` over the ranks: ``tensors`` row-sharded float32 DTensors under
    "model" (also benchmarks/checkpoint_async.py's state)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, total_bytes // tensors // 4 // 1024 // world * world)
    generator = torch.Generator().manual_seed(rank)
    local = [torch.rand(rows // world, 1024, generator=generator) for _ in range(tensors)]
    return {"model": {f"w{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)}}


def _skeleton(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k].to_local().view(torch.int32), b["model"][k].to_local().view(torch.int32))
               for k in a["model"])


def _rank(rank: int, world: int, store: str, scratch: str, total_bytes: int, tensors: int, rounds: int,
          warmup: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from shardkit import checkpoint

    init_groups(rank, world, store, 600, gloo=False)
    progress = rank0_progress(rank, "checkpoint_integrity: ")
    state = dtensor_state(rank, world, total_bytes, tensors)
    skeleton = _skeleton(state)
    a, b = os.path.join(scratch, "shardkit"), os.path.join(scratch, "dcp")

    def fresh(path: str) -> Callable[[], None]:
        def remove() -> None:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        return remove

    def nan_skeleton() -> None:
        for value in skeleton["model"].values():
            value.to_local().fill_(float("nan"))

    ops: dict[str, tuple[Callable[[], None], Callable[[], Any]]] = {  # (untimed before, timed)
        "save": (fresh(a), lambda: checkpoint.save(state, a)),
        "dcp save": (fresh(b), lambda: dcp.save(state, checkpoint_id=b)),
        "load": (nan_skeleton, lambda: checkpoint.load(skeleton, a, strict=False)),
        "load verify=False": (nan_skeleton, lambda: checkpoint.load(skeleton, a, strict=False, verify=False)),
        "dcp load": (nan_skeleton, lambda: dcp.load(skeleton, checkpoint_id=b)),
    }
    def saves_alternate_loads_rotate(names: Sequence[str], r: int) -> list[str]:
        saves = list(names[:2]) if r % 2 == 0 else list(reversed(names[:2]))
        return saves + rotated(names[2:], r)

    times: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    for _round_index, order, timed_round in interleaved_rounds(OPERATIONS, warmup, rounds, progress, label="round",
                                                              done=" done", order=saves_alternate_loads_rotate):
        for name in order:
            before, timed = ops[name]
            before()
            if rank == 0:
                os.sync()
            dist.barrier()
            start = time.perf_counter()
            timed()
            seconds = time.perf_counter() - start
            if "load" in name and not _same(skeleton, state):
                raise RuntimeError(f"rank {rank}: {name} did not load the saved values")
            if timed_round:
                times[name].append(seconds)
    agreed = {name: agree_max(samples, None) for name, samples in times.items()}
    return {"times": agreed, "bytes_per_rank": sum(v.to_local().nbytes for v in state["model"].values())}


def crc_throughput(total_bytes: int, reps: int = 5) -> dict[str, Any]:
    from shardkit import _C

    data = os.urandom(total_bytes)
    _C.crc32c(data)  # first touch and dispatch
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        _C.crc32c(data)
        seconds.append(time.perf_counter() - start)
    return {"isa": _C.crc32c_isa(), "bytes": total_bytes, "seconds": seconds,
            "gb_per_s": total_bytes / statistics.median(seconds) / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (10^9 bytes), over both ranks")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "checkpoint_integrity.json")
    args = p.parse_args(argv)
    total = int(args.gb * 1e9)
    machine = machine_info()
    scratch = Path(tempfile.mkdtemp(prefix="shardkit-ckpt-integrity-", dir=args.scratch))
    try:
        with ForeignLoad() as load:
            per_rank = launch_ranks(_rank, 2, str(scratch), total, args.tensors, args.rounds, args.warmup,
                                    timeout=3600)
        crc = crc_throughput(total)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    times = per_rank[0]["times"]
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    pairs = {"save / dcp save": ("save", "dcp save"), "load / dcp load": ("load", "dcp load"),
             "load verify=False / dcp load": ("load verify=False", "dcp load")}
    ratios = {label: medians[ours] / medians[anchor] for label, (ours, anchor) in pairs.items()}
    # The rounds interleave, so a round's pair ran under the same load: the median of per-round ratios too.
    per_round = {label: statistics.median(round_ratios(times[ours], times[anchor]))
                 for label, (ours, anchor) in pairs.items()}
    checkpoint_bytes = sum(r["bytes_per_rank"] for r in per_rank)
    rows = [[name, f"{medians[name] * 1e3:.0f} ms", f"{min(times[name]) * 1e3:.0f} ms",
             f"{checkpoint_bytes / medians[name] / 1e9:.2f} GB/s"] for name in OPERATIONS]
    print(f"checkpoint of {checkpoint_bytes / 1e9:.2f} GB at world 2 ({args.rounds} rounds; scratch on "
          f"{filesystem_of(str(args.scratch))}; other load {load.cores or 0:.2f} cores)")
    print(format_table(["operation", "median", "best", "GB/s (median)"], rows))
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x (median of per-round ratios {per_round[name]:.2f}x)")
    print(f"CRC32C ({crc['isa']}): {crc['gb_per_s']:.1f} GB/s on one core")
    write_json(args.out, {"machine": machine, "scratch_filesystem": filesystem_of(str(args.scratch)),
                          "foreign_load_cores": load.cores, "world": 2, "checkpoint_bytes": checkpoint_bytes,
                          "tensors": args.tensors, "rounds": args.rounds, "warmup": args.warmup,
                          "seconds": times, "median_s": medians, "ratios": ratios,
                          "median_of_round_ratios": per_round, "crc32c": crc})
    print(wrote(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

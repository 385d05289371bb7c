"""What the flight recorder costs: a 4 KB all-reduce at world 2 on a shardkit group that records its collectives
(SHARDKIT_TRACE_BUFFER's default, 2000 entries) against the same all-reduce on a group of the same ranks that records
nothing (SHARDKIT_TRACE_BUFFER=0), interleaved in the same job (``python benchmarks/trace.py``; results in
``benchmarks/results/trace.json``). Target: recording costs at most 1% (ratio <= 1.01).

Recording is three short critical sections per op (issued, started, ended: a slot copy and two field updates in a
preallocated ring, csrc/comm/trace.h) and three clock reads; a 4 KB all-reduce is where that is the largest share
of an op's time. On a small shared machine the interleaved ratio moves by more than 1% from run to run, so the
recording's own cost is also measured alone (``_C.trace_cost_ns``: the same three calls on a private ring, in a
loop) and given as a share of the unrecorded all-reduce's time.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import format_table, format_us
from _harness import (
    ForeignLoad,
    TimingConfig,
    add_target,
    describe_paired,
    init_groups,
    launch_ranks,
    load_note,
    machine_info,
    paired_summary,
    round_ratios,
    time_interleaved,
    write_json,
)

RESULTS = Path(__file__).parent / "results" / "trace.json"


def _rank_main(rank: int, world: int, store: str, numel: int, timing: TimingConfig) -> dict[str, Any] | None:
    sync = init_groups(rank, world, store, 300)
    # Four groups of the same ranks, made alike, created recording / off / off / recording so that neither setting
    # gets the groups made first; only the recorder differs (SHARDKIT_TRACE_BUFFER is read when a group is created).
    groups = {}
    for name in ("recording a", "off a", "off b", "recording b"):
        os.environ["SHARDKIT_TRACE_BUFFER"] = "2000" if name.startswith("recording") else "0"
        groups[name] = dist.new_group(list(range(world)))
    os.environ.pop("SHARDKIT_TRACE_BUFFER")
    data = {name: torch.ones(numel) for name in groups}
    calls = {name: functools.partial(dist.all_reduce, data[name], group=groups[name]) for name in groups}
    barriers = {name: functools.partial(dist.barrier, group=groups[name]) for name in groups}
    timings = time_interleaved(calls, barriers, sync, timing)
    if rank != 0:
        return None
    on = [(a + b) / 2 for a, b in zip(timings["recording a"].samples, timings["recording b"].samples)]
    off = [(a + b) / 2 for a, b in zip(timings["off a"].samples, timings["off b"].samples)]
    on_s, off_s = statistics.median(on), statistics.median(off)
    return {"recording_s": on_s, "off_s": off_s, "ratio": on_s / off_s, "round_ratios": round_ratios(on, off),
            "paired": paired_summary(on, off), "recording_samples_s": on, "off_samples_s": off,
            "per_group_s": {name: t.seconds for name, t in timings.items()}, "iters": timings["off a"].iters}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=4096, help="all-reduce size in bytes (float32)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--point-s", type=float, default=3.0, help="time of all repetitions of one configuration")
    args = parser.parse_args()
    timing = TimingConfig(reps=args.reps, point_s=args.point_s, max_iters=20000)
    machine = machine_info()
    with ForeignLoad() as load:
        row = launch_ranks(_rank_main, 2, args.bytes // 4, timing)[0]
    from shardkit import _C

    cost_ns = min(_C.trace_cost_ns(200_000, 2000) for _ in range(3))  # the quietest of three loops
    row["record_cost_ns"] = cost_ns
    row["record_share"] = cost_ns * 1e-9 / row["off_s"]
    print(f"=== {args.bytes} B all-reduce, world 2, shardkit backend: recording (SHARDKIT_TRACE_BUFFER=2000) vs off "
          f"(=0), two groups each; interleaved, median of {args.reps} repetitions of {row['iters']} calls ===")
    print(format_table(["recording µs", "off µs", "ratio"],
                       [[format_us(row["recording_s"]), format_us(row["off_s"]), f"{row['ratio']:.4f}x"]]))
    print(f"ratio of medians {row['ratio']:.4f}×" + describe_paired(row["round_ratios"]))
    print("per group: " + ", ".join(f"{name} {format_us(t)} µs" for name, t in row["per_group_s"].items()))
    print(f"recording alone: {cost_ns:.0f} ns per op = {100 * row['record_share']:.3f}% of the unrecorded all-reduce "
          f"({format_us(row['off_s'])} µs)")
    note = load_note(load.cores, machine, "the run")
    if note:
        print(note)
    checks: list[dict[str, Any]] = []
    add_target(checks, "recording cost (ratio of medians, recording / off)", row["ratio"], 1.01, False, "x")
    add_target(checks, "recording cost measured alone (1 + its share of the op)", 1 + row["record_share"], 1.01, False,
               "x")
    payload = {"machine": machine, "bytes": args.bytes, "reps": args.reps, "result": row, "targets": checks,
               "foreign_load_cores": load.cores}
    print(f"wrote {write_json(RESULTS, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

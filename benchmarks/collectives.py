"""Collective latency and bandwidth: shardkit vs gloo, in the same job on the same machine.

    python benchmarks/collectives.py                  # world 2 and 4, 4K … 64M (a few minutes)
    python benchmarks/collectives.py --quick          # fewer sizes, shorter timing (seconds)
    python benchmarks/collectives.py --world 2 --sizes 4K 1M --iters 200
    python benchmarks/collectives.py --hosts 2x2      # 2 simulated hosts × 2 ranks: hierarchical vs flat gloo
    python benchmarks/collectives.py --peer deepspeed # allreduce against DeepSpeed's CPU shm op (make bench-peers)

Each world size is one job of spawned ranks (file:// rendezvous in a temp dir, no ports) whose default
group is shardkit and which also holds a gloo group over the same ranks, so both backends see the same
processes, buffers and machine state. Measured: allreduce (f32, bf16, f16), allgather, reduce_scatter and
broadcast (f32). "Size" is the per-rank buffer in bytes as in nccl-tests: the allreduce/broadcast tensor,
the allgather output, the reduce_scatter input.

Half precision per byte: after the table, shardkit's allreduce is timed again in f32, bf16 and f16 with the
repetitions of the three interleaved (see ``time_interleaved``), so that their algbw — bytes per second, the
per-byte speed — can be compared on a machine whose load drifts. ``SHARDKIT_REDUCE_ISA`` (avx512_bf16,
avx512, avx2, scalar) picks the reduction kernels, e.g. to see a CPU without AVX-512 on one that has it.
``--hosts HxR`` runs the simulated-hosts job of ``_collectives_hosts.py`` instead of the world sizes.

  algbw = size / latency
  busbw = algbw × factor (allreduce 2(n-1)/n; allgather, reduce_scatter (n-1)/n; broadcast 1) — the
          per-rank link traffic a bandwidth-optimal algorithm needs, comparable across world sizes.

It also measures the memory-bandwidth bound (every rank copying a large buffer at once) and from it the
fastest a large allreduce could run with shardkit's data movement (see :func:`allreduce_bound`), then
checks the targets of the issue. Results: ``benchmarks/results/collectives.{json,png}``; a run replaces the
series it measured and keeps the others (a ``--world 2`` run keeps the world-4 and simulated-host rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _collectives_hosts import hosts_rank_main, hosts_targets, parse_hosts, print_hosts  # noqa: E402
from _common import Series, format_size, format_table, format_us, parse_size, plot_panels  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    Timing,
    TimingConfig,
    add_target,
    agree_max,
    announce,
    init_groups,
    launch_ranks,
    load_note,
    machine_info,
    merge_results,
    rank0_progress,
    time_collective,
    time_interleaved,
    utc_now,
    write_json,
    wrote,
)

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast")
DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
ALLREDUCE_DTYPES = ("f32", "bf16", "f16")  # the other ops run in f32 only
BACKENDS = ("shardkit", "gloo")
DEFAULT_SIZES = ("4K", "64K", "1M", "16M", "64M")
QUICK_SIZES = ("4K", "1M", "64M")

# torch 2.13 renamed the single-tensor collectives; older versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw factor: how many times each rank's link carries `size` in an optimal algorithm."""
    if op == "allreduce":
        return 2 * (world - 1) / world
    if op in ("allgather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    dtype: str
    size: int  # bytes, nccl-tests' meaning (see the module docstring)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    sizes: tuple[int, ...]
    ops: tuple[str, ...]
    timing: TimingConfig
    copy_bytes: int     # buffer each rank copies to measure memory bandwidth
    copy_reps: int
    pg_timeout_s: float
    pin: bool = False   # pin rank r to usable core r % cores (its threads inherit it)


def cases_for(cfg: BenchConfig) -> list[Case]:
    return [Case(op, dtype, size) for op in cfg.ops
            for dtype in (ALLREDUCE_DTYPES if op == "allreduce" else ("f32",)) for size in cfg.sizes]


# --- the collectives ---------------------------------------------------------------------------------------

def make_buffers(case: Case, world: int, fill: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) for one case; ``fill(numel)`` makes an input. In-place ops return the same tensor twice."""
    numel = case.size // torch.tensor([], dtype=DTYPES[case.dtype]).element_size()
    if case.op == "allgather":
        return fill(numel // world), torch.empty(numel, dtype=DTYPES[case.dtype])
    if case.op == "reduce_scatter":
        return fill(numel), torch.empty(numel // world, dtype=DTYPES[case.dtype])
    tensor = fill(numel)
    return tensor, tensor


def make_call(op: str, inp: torch.Tensor, out: torch.Tensor, group: Any) -> Callable[[], None]:
    """One blocking collective on ``group`` (None = the default group, i.e. shardkit)."""
    if op == "allreduce":
        return lambda: dist.all_reduce(inp, group=group)
    if op == "allgather":
        return lambda: _all_gather_single(out, inp, group=group)
    if op == "reduce_scatter":
        return lambda: _reduce_scatter_single(out, inp, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(inp, src=0, group=group)
    raise ValueError(f"unknown op {op!r}")


def check_against_gloo(case: Case, rank: int, world: int, gloo: Any) -> None:
    """Run the case once on each backend with rank-dependent data and require identical results.

    Guards the timing against measuring a collective that silently does the wrong thing. The values are
    small integers, exact in bf16 and f16 and in any summation order.
    """
    dtype = DTYPES[case.dtype]
    results = []
    for group in (None, gloo):
        inp, out = make_buffers(case, world, lambda n: ((torch.arange(n) % 7) + rank + 1).to(dtype))
        make_call(case.op, inp, out, group)()
        results.append(out)
    if not torch.equal(results[0], results[1]):
        bad = (results[0] != results[1]).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"rank {rank}: shardkit {case.op} {case.dtype} {format_size(case.size)} differs "
                             f"from gloo at elements {bad}")


# --- memory bandwidth and the allreduce bound ------------------------------------------------------------

def copy_windows(nbytes: int, reps: int, group: Any) -> list[float]:
    """Every rank copies ``nbytes`` (``dst.copy_(src)``, one thread) at the same time, ``reps`` times.

    Returns each rep's window: the slowest rank's time, as all start together after a barrier. With more
    ranks than cores a window includes time slicing, which is exactly the sharing a collective on those
    ranks sees too.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    own = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        dst.copy_(src)
        own.append(time.perf_counter() - start)
    return agree_max(own, group)


def copy_bandwidth(nbytes: int, world: int, windows: Sequence[float]) -> dict[str, Any]:
    """Aggregate rate: the bytes all ranks read plus wrote in a window.

    The bound uses the best window: other load only ever slows a copy down, so the fastest one is the
    closest to what the memory system can do (on a shared machine the median can be 2x slower, which would
    flatter the efficiency). The median is recorded too.
    """
    moved = world * 2 * nbytes
    median, best = statistics.median(windows), min(windows)
    return {"copy_bytes": nbytes, "reps": len(windows), "processes": world, "window_s": list(windows),
            "aggregate_GBps": moved / best / 1e9, "aggregate_GBps_median": moved / median / 1e9,
            "per_process_GBps": moved / best / 1e9 / world}


def allreduce_bound(size: int, world: int, aggregate_GBps: float) -> dict[str, float]:
    """Fastest an allreduce of ``size`` bytes can run, from the memory traffic of shardkit's algorithm.

    The large-message allreduce (reduce-scatter + all-gather through the shared slots), per rank, with
    S = size and N = world:
      copy its input into its shared slot        read S (input)          write S (slot)
      reduce its 1/N slice over all N slots      read S (N slots × S/N)  write S/N (slot)
      copy the whole result out of the slots     read S (slots)          write S (output)
    = (5 + 1/N)·S bytes. The input and output are user buffers far larger than any cache, so their 2S must
    go through DRAM; the other (3 + 1/N)·S touch the slots, which are reused every chunk (N ranks × 2
    buffers × SHARDKIT_SHM_SLOT_BYTES, a few MiB) and so stay in the caches. All N ranks share one memory
    system, and the DRAM part is exactly what the copy test does (every rank reads S and writes S at once):

        time ≥ N · 2S / aggregate copy bandwidth     (= one concurrent S-byte copy per rank)

    Charging all (5 + 1/N)·S to DRAM gives a longer time ("all-DRAM model"): what the algorithm would
    take if the slots were as large as the message. Measured times on the 2-core machines beat it (it is
    no bound for the chunked algorithm); it is reported for reference.
    """
    bandwidth = aggregate_GBps * 1e9
    per_rank = (5 + 1 / world) * size
    bound_s = world * 2 * size / bandwidth
    return {"bytes_per_rank": per_rank, "dram_bytes_per_rank": 2 * size, "bound_s": bound_s,
            "bound_algbw_GBps": size / bound_s / 1e9, "all_dram_model_s": world * per_rank / bandwidth}


# --- one rank ----------------------------------------------------------------------------------------------

def rank_main(rank: int, world: int, store: str, cfg: BenchConfig) -> dict[str, Any] | None:
    import shardkit

    if cfg.pin:
        # Before init, so the backend's worker thread and gloo's threads inherit the mask.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})

    gloo = init_groups(rank, world, store, cfg.pg_timeout_s)
    barriers: dict[str, Callable[[], None]] = {"shardkit": lambda: dist.barrier(),
                                               "gloo": lambda: dist.barrier(group=gloo)}
    groups = {"shardkit": None, "gloo": gloo}

    progress = rank0_progress(rank)

    # The memory bandwidth is measured right before and after the largest f32 allreduce, so that the bound
    # and the time it is compared with see the same machine state (other load drifts over a run).
    bound_case = Case("allreduce", "f32", max(cfg.sizes)) if "allreduce" in cfg.ops else None
    windows: list[float] = []
    if bound_case is None:
        windows += copy_windows(cfg.copy_bytes, cfg.copy_reps, gloo)

    rows: list[dict[str, Any]] = []
    last_label = ""
    for case in cases_for(cfg):
        label = f"world {world}: {case.op} {case.dtype}:"
        if label != last_label:
            progress(("\n" if last_label else "") + label, end="")
            last_label = label
        progress(f" {format_size(case.size)}", end="")
        check_against_gloo(case, rank, world, gloo)
        # Zeros keep the in-place allreduce's values fixed over thousands of calls (no overflow to inf,
        # no denormals), the same data for both backends.
        inp, out = make_buffers(case, world, lambda n: torch.zeros(n, dtype=DTYPES[case.dtype]))
        if case == bound_case:
            windows += copy_windows(cfg.copy_bytes, cfg.copy_reps // 2, gloo)
        timings: dict[str, Timing] = {}
        for backend in BACKENDS:
            call = make_call(case.op, inp, out, groups[backend])
            timings[backend] = time_collective(call, barriers[backend], gloo, cfg.timing)
        if case == bound_case:
            windows += copy_windows(cfg.copy_bytes, cfg.copy_reps - cfg.copy_reps // 2, gloo)
        for backend, timing in timings.items():
            algbw = case.size / timing.seconds / 1e9
            rows.append({"world": world, "backend": backend, "op": case.op, "dtype": case.dtype,
                         "size_bytes": case.size, "latency_s": timing.seconds, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * bus_factor(case.op, world), "iters": timing.iters,
                         "samples_s": timing.samples})
    progress("", "\n")
    memory = copy_bandwidth(cfg.copy_bytes, world, windows)
    compare = compare_dtypes(world, cfg, barriers["shardkit"], gloo, progress) if "allreduce" in cfg.ops else []
    zero_copy = compare_zero_copy(world, cfg, barriers["shardkit"], gloo, progress) if "allreduce" in cfg.ops else []
    isa = shardkit._C.reduce_isa()
    return ({"memory": memory, "rows": rows, "dtype_compare": compare, "zero_copy": zero_copy, "reduce_isa": isa}
            if rank == 0 else None)


def compare_zero_copy(world: int, cfg: BenchConfig, barrier: Callable[[], None], gloo: Any,
                      progress: Callable[..., None]) -> list[dict[str, Any]]:
    """shardkit's f32 allreduce of an ordinary tensor against the same allreduce of a tensor in a shared buffer
    (``shardkit.backend.shared_buffer``: the peers' buffers are reduced where they lie, no copy through the slots —
    what DDP's zero-copy buckets use), repetitions interleaved, at the sizes past the small-message limit (32 KiB)."""
    from shardkit.backend import shared_buffer

    sizes = [s for s in cfg.sizes if s > 32 * 1024]
    shared = shared_buffer(max(sizes)) if sizes else None
    if shared is None:
        return []
    out = []
    progress(f"world {world}: allreduce in a shared buffer vs an ordinary tensor, interleaved:", end="")
    for size in sizes:
        progress(f" {format_size(size)}", end="")
        ordinary = torch.zeros(size // 4)
        inside = shared[:size].view(torch.float32)
        inside.zero_()
        calls = {"copying": lambda: dist.all_reduce(ordinary), "zero_copy": lambda: dist.all_reduce(inside)}
        timings = time_interleaved(calls, {k: barrier for k in calls}, gloo, cfg.timing)
        out.append({"world": world, "size_bytes": size, "latency_s": {k: t.seconds for k, t in timings.items()},
                    "iters": {k: t.iters for k, t in timings.items()},
                    "samples_s": {k: t.samples for k, t in timings.items()}})
    progress("", "\n")
    return out


def compare_dtypes(world: int, cfg: BenchConfig, barrier: Callable[[], None], gloo: Any,
                   progress: Callable[..., None]) -> list[dict[str, Any]]:
    """shardkit's allreduce in every dtype of ALLREDUCE_DTYPES at each size, repetitions interleaved.

    algbw is bytes per second, so ``algbw[bf16] / algbw[f32]`` is bf16's per-byte speed relative to f32's
    (1.0: a bf16 tensor of half the elements takes the same time as an f32 one of the same bytes). Twice the
    usual repetitions, as the ratios are what this is for.
    """
    timing = dataclasses.replace(cfg.timing, reps=2 * cfg.timing.reps, point_s=2 * cfg.timing.point_s)
    out = []
    progress(f"world {world}: allreduce per byte, dtypes interleaved:", end="")
    for size in cfg.sizes:
        progress(f" {format_size(size)}", end="")
        tensors = {d: torch.zeros(size // torch.tensor([], dtype=DTYPES[d]).element_size(), dtype=DTYPES[d])
                   for d in ALLREDUCE_DTYPES}
        calls = {d: (lambda t=t: dist.all_reduce(t)) for d, t in tensors.items()}
        timings = time_interleaved(calls, {d: barrier for d in calls}, gloo, timing)
        out.append({"world": world, "size_bytes": size,
                    "latency_s": {d: t.seconds for d, t in timings.items()},
                    "algbw_GBps": {d: size / t.seconds / 1e9 for d, t in timings.items()},
                    "iters": {d: t.iters for d, t in timings.items()},
                    "samples_s": {d: t.samples for d, t in timings.items()}})
    progress("", "\n")
    return out


# --- reporting ---------------------------------------------------------------------------------------------

def find_row(rows: Sequence[dict[str, Any]], world: int, backend: str, op: str, dtype: str,
             size: int) -> dict[str, Any] | None:
    for row in rows:
        if (row["world"], row["backend"], row["op"], row["dtype"], row["size_bytes"]) == (world, backend, op,
                                                                                         dtype, size):
            return row
    return None


def print_world(world: int, rows: Sequence[dict[str, Any]], memory: dict[str, Any], cfg: BenchConfig
                ) -> dict[str, Any] | None:
    """The table for one world size, then the memory bound; returns the bound of the largest allreduce."""
    table = []
    for case in cases_for(cfg):
        sk = find_row(rows, world, "shardkit", case.op, case.dtype, case.size)
        gl = find_row(rows, world, "gloo", case.op, case.dtype, case.size)
        assert sk is not None and gl is not None
        table.append([case.op, case.dtype, format_size(case.size), format_us(sk["latency_s"]),
                      f"{sk['algbw_GBps']:.3f}", f"{sk['busbw_GBps']:.3f}", format_us(gl["latency_s"]),
                      f"{gl['algbw_GBps']:.3f}", f"{gl['latency_s'] / sk['latency_s']:.1f}x"])
    print(f"\n=== world {world}: shardkit vs gloo (same job; latency = median of {cfg.timing.reps} reps, "
          f"slowest rank) ===")
    print(format_table(["op", "dtype", "size", "shardkit µs", "algbw GB/s", "busbw GB/s", "gloo µs",
                        "gloo algbw", "gloo/shardkit"], table, left=2))

    where = f" around the {format_size(max(cfg.sizes))} f32 allreduce" if "allreduce" in cfg.ops else ""
    print(f"\nmemory bandwidth{where}: {world} processes each copying {format_size(memory['copy_bytes'])} at once "
          f"(dst.copy_(src), 1 thread): aggregate {memory['aggregate_GBps']:.2f} GB/s read+write "
          f"(best of {memory['reps']}; median {memory['aggregate_GBps_median']:.2f}), "
          f"{memory['per_process_GBps']:.2f} GB/s per process")
    if "allreduce" not in cfg.ops:
        return None
    size = max(cfg.sizes)
    measured = find_row(rows, world, "shardkit", "allreduce", "f32", size)
    assert measured is not None
    bound = allreduce_bound(size, world, memory["aggregate_GBps"])
    efficiency = bound["bound_s"] / measured["latency_s"]
    s, n = format_size(size), world
    print(f"bound for a {s} f32 allreduce: per rank the shm algorithm moves (5 + 1/N)·S = {5 + 1 / n:.2f} × {s}\n"
          f"  (copy in: read S + write S; reduce own 1/N slice: read S + write S/N; copy out: read S + write S);\n"
          f"  only the user buffers' 2S (read input, write output) must go through DRAM — the slot traffic "
          f"stays in cache (slots are reused every chunk) —\n"
          f"  and {n} ranks share the memory system → time ≥ {n} × 2 × {s} / {memory['aggregate_GBps']:.2f} GB/s"
          f" = {bound['bound_s'] * 1e3:.2f} ms (algbw ≤ {bound['bound_algbw_GBps']:.2f} GB/s);\n"
          f"  measured {measured['latency_s'] * 1e3:.2f} ms → efficiency {efficiency:.0%} "
          f"(all-DRAM model, {n} × {5 + 1 / n:.2f} × {s} through DRAM: {bound['all_dram_model_s'] * 1e3:.2f} ms,"
          f" {bound['all_dram_model_s'] / measured['latency_s']:.0%} of measured)")
    return {"size_bytes": size, **bound, "measured_s": measured["latency_s"], "efficiency": efficiency}


def print_dtype_compare(world: int, compare: Sequence[dict[str, Any]], isa: str) -> None:
    if not compare:
        return
    table = []
    for entry in compare:
        bw = entry["algbw_GBps"]
        table.append([format_size(entry["size_bytes"]), *(f"{bw[d]:.3f}" for d in ALLREDUCE_DTYPES),
                      *(f"{bw[d] / bw['f32']:.2f}" for d in ALLREDUCE_DTYPES[1:])])
    print(f"\n--- world {world}: bf16/f16 per-byte vs f32 — shardkit allreduce algbw (median), the dtypes' "
          f"repetitions interleaved in rotating order; reduce ISA {isa} ---")
    print(format_table(["size", *(f"{d} GB/s" for d in ALLREDUCE_DTYPES),
                        *(f"{d}/f32" for d in ALLREDUCE_DTYPES[1:])], table))


def print_zero_copy(world: int, zero_copy: Sequence[dict[str, Any]], bound: dict[str, Any] | None) -> None:
    if not zero_copy:
        return
    table = []
    for entry in zero_copy:
        lat = entry["latency_s"]
        efficiency = (f"{bound['bound_s'] / lat['zero_copy']:.0%}"
                      if bound and bound["size_bytes"] == entry["size_bytes"] else "")
        table.append([format_size(entry["size_bytes"]), format_us(lat["copying"]), format_us(lat["zero_copy"]),
                      f"{lat['copying'] / lat['zero_copy']:.2f}×",
                      f"{entry['size_bytes'] / lat['zero_copy'] / 1e9:.3f}", efficiency])
    print(f"\n--- world {world}: f32 allreduce of an ordinary tensor (copying through the slots) vs one in a shared "
          f"buffer (zero-copy), medians, repetitions interleaved ---")
    print(format_table(["size", "copying µs", "zero-copy µs", "speedup", "zero-copy algbw GB/s",
                        "of the bound"], table))


def check_targets(rows: Sequence[dict[str, Any]], bounds: dict[int, dict[str, Any] | None],
                  compare: Sequence[dict[str, Any]], zero_copy: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The issue's targets for this 2-core machine class; a target whose point was not measured is SKIP."""
    k4, m64 = 4 << 10, 64 << 20
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, higher_is_better: bool, unit: str) -> None:
        add_target(checks, name, value, limit, higher_is_better, unit)

    def get(world: int, backend: str, size: int) -> dict[str, Any] | None:
        return find_row(rows, world, backend, "allreduce", "f32", size)

    sk, gl = get(2, "shardkit", k4), get(2, "gloo", k4)
    add("world 2, 4K f32 allreduce latency ≤ 15 µs", sk and sk["latency_s"] * 1e6, 15, False, " µs")
    add("world 2, 4K f32 allreduce ≥ 20× faster than gloo",
        sk and gl and gl["latency_s"] / sk["latency_s"], 20, True, "×")
    big = get(2, "shardkit", m64)
    add("world 2, 64M f32 allreduce algbw ≥ 1.5 GB/s", big and big["algbw_GBps"], 1.5, True, " GB/s")
    bound = bounds.get(2)
    eff = bound["efficiency"] if big and bound and bound["size_bytes"] == m64 else None
    add("world 2, 64M f32 allreduce ≥ 80% of the memory-bandwidth bound", eff and eff * 100, 80, True, " %")
    shared = next((e for e in zero_copy if (e["world"], e["size_bytes"]) == (2, m64)), None)
    add("world 2, 64M f32 allreduce in a shared buffer (zero-copy) ≥ 90% of the memory-bandwidth bound",
        shared and bound and bound["size_bytes"] == m64 and bound["bound_s"] / shared["latency_s"]["zero_copy"] * 100,
        90, True, " %")
    sk4 = get(4, "shardkit", k4)
    add("world 4, 4K f32 allreduce latency ≤ 100 µs", sk4 and sk4["latency_s"] * 1e6, 100, False, " µs")
    # Half precision at least as fast per byte: algbw (bytes/s) at least f32's, from the interleaved timing.
    same = next((e for e in compare if (e["world"], e["size_bytes"]) == (2, m64)), None)
    for half in ALLREDUCE_DTYPES[1:]:
        add(f"world 2, 64M {half} allreduce algbw ≥ f32's (interleaved; {half}/f32)",
            same and same["algbw_GBps"][half] / same["algbw_GBps"]["f32"], 1.0, True, "×")
    return checks


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a row measured: rows with the same key replace each other when results are merged."""
    return (row.get("topology", f"1x{row['world']}"), row["world"], row["backend"], row["op"], row["dtype"],
            row["size_bytes"])


def plot(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Latency vs size: one panel per single-host world size in ``rows``, one per simulated-host topology."""
    panels: dict[str, list[Series]] = {}
    for topology in sorted({row_key(r)[0] for r in rows}, key=lambda t: (t.startswith("1x") is False, t)):
        series = []
        for op in OPS:
            for dtype in (ALLREDUCE_DTYPES if op == "allreduce" else ("f32",)):
                for backend, style in (("shardkit", "-"), ("gloo", "--")):
                    pts = sorted((r["size_bytes"], r["latency_s"] * 1e6) for r in rows if row_key(r)[0] == topology
                                 and (r["backend"], r["op"], r["dtype"]) == (backend, op, dtype))
                    if pts:
                        series.append(Series(f"{op} {dtype} {backend}", [p[0] for p in pts], [p[1] for p in pts],
                                             color_key=f"{op} {dtype}", linestyle=style,
                                             marker="o" if backend == "shardkit" else "x"))
        hosts, per_host = topology.split("x")
        title = f"world {per_host}" if hosts == "1" else f"{hosts} simulated hosts × {per_host} ranks"
        panels[title] = series
    return plot_panels(path, panels, xlabel="size (bytes per rank)", ylabel="latency (µs)",
                       suptitle="shardkit (solid) vs gloo (dashed), CPU collectives",
                       xtick_labels=lambda x: format_size(int(x)))


# --- main --------------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)")
    p.add_argument("--sizes", nargs="+", default=None,
                   help=f"per-rank sizes, e.g. 4K 1M 64M (default: {' '.join(DEFAULT_SIZES)})")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--iters", type=int, default=None,
                   help="calls per repetition for small sizes (default 1000, --quick 200); large sizes "
                        "use fewer so each point takes about --point-seconds")
    p.add_argument("--reps", type=int, default=None, help="repetitions per point (default 5, --quick 3)")
    p.add_argument("--point-seconds", type=float, default=None,
                   help="target time per point and backend (default 0.5, --quick 0.15)")
    p.add_argument("--quick", action="store_true", help=f"sizes {' '.join(QUICK_SIZES)} and shorter timing")
    p.add_argument("--pin", action="store_true",
                   help="pin rank r to core r %% cores (default: the OS places ranks, as under torchrun); "
                        "gloo's I/O threads then share their rank's core, which slows gloo")
    p.add_argument("--hosts", default=None, metavar="HxR",
                   help="instead of --world: H simulated hosts of R ranks (SHARDKIT_HOST_ID = rank // R), "
                        "f32 allreduce, shardkit's hierarchical path against flat gloo over all H·R ranks")
    p.add_argument("--peer", choices=["deepspeed"], default=None,
                   help="instead of the table: f32 allreduce against DeepSpeed's CPU shm allreduce, run from the "
                        "venv `make bench-peers` makes, in interleaved rounds (see _peer_compare.py)")
    p.add_argument("--rounds", type=int, default=3, help="--peer: interleaved rounds (default 3)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for collectives.json/png")
    return p.parse_args(argv)


def run_worlds(args: argparse.Namespace, cfg: BenchConfig, machine: dict[str, Any]) -> dict[str, Any]:
    """The single-host jobs, one per world size; returns this run's part of the results."""
    rows: list[dict[str, Any]] = []
    compares: list[dict[str, Any]] = []
    zero_copies: list[dict[str, Any]] = []
    memories: dict[int, dict[str, Any]] = {}
    bounds: dict[int, dict[str, Any] | None] = {}
    seconds: dict[str, float] = {}
    foreign_cores: dict[str, float | None] = {}
    isa = "?"
    for world in args.world:
        t0 = time.monotonic()
        with ForeignLoad() as load:
            result = launch_ranks(rank_main, world, cfg, timeout=900.0)[0]
        seconds[f"world_{world}"] = time.monotonic() - t0
        foreign_cores[str(world)] = load.cores
        rows.extend(result["rows"])
        compares.extend(result["dtype_compare"])
        memories[world] = result["memory"]
        isa = result["reduce_isa"]
        bounds[world] = print_world(world, result["rows"], result["memory"], cfg)
        print_dtype_compare(world, result["dtype_compare"], isa)
        zero_copies.extend(result["zero_copy"])
        print_zero_copy(world, result["zero_copy"], bounds[world])
        if (note := load_note(load.cores, machine, "this world's run")):
            print(note)

    print("\n=== targets (2-core machine class) ===")
    checks = check_targets(rows, bounds, compares, zero_copies)
    return {
        "config": {"worlds": args.world, "sizes": list(cfg.sizes), "ops": list(cfg.ops),
                   "timing": dataclasses.asdict(cfg.timing), "copy_bytes": cfg.copy_bytes,
                   "quick": args.quick, "pin": cfg.pin, "omp_num_threads": 1,
                   "shm_slot_bytes_env": os.environ.get("SHARDKIT_SHM_SLOT_BYTES"), "reduce_isa": isa},
        "memory_bandwidth": {str(w): m for w, m in memories.items()},
        "allreduce_bound": {str(w): b for w, b in bounds.items()},
        "rows": rows,
        "dtype_compare": compares,
        "zero_copy": zero_copies,
        "targets": checks,
        "foreign_load_cores": foreign_cores,
        "seconds": seconds,
    }


def run_hosts(args: argparse.Namespace, cfg: BenchConfig, hosts: int, per_host: int) -> dict[str, Any]:
    """The simulated-hosts job (``--hosts``); returns this run's part of the results."""
    world = hosts * per_host
    t0 = time.monotonic()
    with ForeignLoad() as load:
        rows = launch_ranks(hosts_rank_main, world, cfg, per_host, timeout=900.0)[0]
    elapsed = time.monotonic() - t0
    print_hosts(rows, hosts, per_host, cfg.sizes)
    if (note := load_note(load.cores, None, "the run", noisy="")):
        print(note)
    print("\n=== targets (simulated hosts) ===")
    checks = hosts_targets(rows, hosts, per_host, cfg.sizes)
    topology = f"{hosts}x{per_host}"
    return {
        "hosts_config": {topology: {"sizes": list(cfg.sizes), "timing": dataclasses.asdict(cfg.timing),
                                    "host_id": f"SHARDKIT_HOST_ID = bench-host-<rank // {per_host}>"}},
        "rows": rows,
        "targets": checks,
        "foreign_load_cores": {f"hosts_{topology}": load.cores},
        "seconds": {f"hosts_{topology}": elapsed},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        sizes = tuple(sorted({parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))}))
        hosts = parse_hosts(args.hosts) if args.hosts else None
    except ValueError as error:
        raise SystemExit(str(error)) from None
    for world in ([hosts[0] * hosts[1]] if hosts else args.world):
        if world < 2:
            raise SystemExit(f"--world: a collective needs at least 2 ranks, got {world}")
        for size in sizes:
            # every op must split the buffer into `world` equal parts of whole f32 (and 2-byte) elements
            if size % (world * 4):
                raise SystemExit(f"--sizes: {size} bytes is not a multiple of 4·world = {4 * world}")
    quick = args.quick
    if args.peer:
        import _peer_compare

        timing = TimingConfig(max_iters=args.iters or 1000, reps=args.reps or 5, point_s=args.point_seconds or 0.5)
        return _peer_compare.run(args.world, list(sizes), timing, args.rounds, args.out)
    cfg = BenchConfig(
        sizes=sizes,
        ops=tuple(op for op in OPS if op in args.ops),
        timing=TimingConfig(max_iters=args.iters or (200 if quick else 1000), reps=args.reps or (3 if quick else 5),
                            point_s=args.point_seconds or (0.15 if quick else 0.5),
                            warmup_s=0.02 if quick else 0.05),
        copy_bytes=max(max(sizes), 64 << 20),
        copy_reps=5 if quick else 10,
        pg_timeout_s=120.0,
        pin=args.pin,
    )

    machine = machine_info()
    what = f"{args.hosts} simulated hosts" if hosts else f"worlds {args.world}"
    announce("shardkit collectives benchmark", machine, f"{what}, sizes {' '.join(format_size(s) for s in sizes)}",
             cores_in_warning=True)
    part = run_hosts(args, cfg, *hosts) if hosts else run_worlds(args, cfg, machine)
    elapsed = time.monotonic() - started
    for entry in (*part["rows"], *part.get("dtype_compare", ()), *part.get("zero_copy", ())):
        entry["run"] = machine["date"]  # which run measured it, once results of several runs are merged

    path = args.out / "collectives.json"
    merged = merge_results(path, {
        "benchmark": "collectives",
        "machine": machine,
        **part,
        "runs": {machine["date"]: {"git_commit": machine["git_commit"], "cpu_model": machine["cpu_model"],
                                   "load_avg_1m": machine["load_avg_1m"], "argv": list(argv or sys.argv[1:]),
                                   "reduce_isa_env": os.environ.get("SHARDKIT_REDUCE_ISA"), "seconds": elapsed}},
        "finished": utc_now(),
    }, row_keys={"rows": row_key, "dtype_compare": lambda e: (e["world"], e["size_bytes"]),
                 "zero_copy": lambda e: (e["world"], e["size_bytes"]),
                 "targets": lambda t: t["target"]})
    merged.get("seconds", {}).pop("total", None)  # from files before per-run totals; each run's is in "runs"
    write_json(path, merged)
    png_path = plot(merged["rows"], args.out / "collectives.png")
    print("\n" + wrote(path, png_path) + " (this run's series replaced, the others kept)")
    print(f"total {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

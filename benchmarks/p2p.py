"""Point-to-point and all-to-all: shardkit vs gloo, in the same job on the same machine.

    python benchmarks/p2p.py                          # worlds 2 and 4, 4K … 64M (1–2 minutes when quiet)
    python benchmarks/p2p.py --quick                  # sizes 4K and 1M, shorter timing (about 20 s)
    python benchmarks/p2p.py --worlds 2 --sizes 4K 1M --ops a2a_even a2a_uneven

What pipeline parallelism (torch.distributed.pipelining) and expert parallelism (MoE dispatch) ask of a
backend, besides the collectives of ``collectives.py``:

- ``p2p_stream`` (world 2 only): rank 0 sends, rank 1 receives, each call one message that both ranks wait for,
  issued as ``dist.batch_isend_irecv([P2POp(isend | irecv, ...)])`` as pipelining's schedules issue them. Calls
  follow each other without a barrier, so this is a stream: the sender may run ahead of the receiver by what
  the transport buffers, and the per-call time is the stream's time per message (the slower rank's).
- ``p2p_exchange`` (world 2 only): both ranks ``batch_isend_irecv`` a send to and a receive from the other at
  once and wait for both (two pipeline stages swapping activations and gradients). "Size" is what each rank
  sends (and receives).
- ``a2a_even``: ``all_to_all_single`` with even splits, each rank sending size/world bytes to every rank.
- ``a2a_uneven``: ``all_to_all_single`` with a fixed skewed pattern, as MoE dispatch has: rank r sends peer p a
  share proportional to 1 + (r + p) % world (rounded down to whole elements, the rest to itself); the output
  splits follow from the same formula, so every rank also receives ``size`` bytes in total.

"Size" is the per-rank buffer in bytes (f32): the message for p2p, the ``all_to_all_single`` input (and output).

Where each runs on shardkit (csrc/comm/backend.cpp): ``ProcessGroupShardkit::send`` / ``recv`` of at least
SHARDKIT_P2P_DIRECT_BYTES (2 MiB) between two ranks of one host take the direct route (csrc/comm/local_p2p.h):
the sender copies the tensor into a staging buffer and sends a descriptor over gloo, the receiver reads the bytes
from the sender's memory with process_vm_readv and sends a receipt back; smaller messages go to the inner gloo
backend (``inner_->all_ranks(...)->send(...)``), so below the threshold the ratio should be about 1. Neither backend
declares coalescing, so ``batch_isend_irecv`` issues its ops one by one on both.

``all_to_all_single`` (``alltoall_base``) runs on the shared-memory engine (``ShmEngine::alltoall`` →
``ShmGroup::alltoall``, csrc/core/shm_collectives.cpp): a round that exchanges the split counts, then rounds in
which every rank copies its part for each peer into its shared slot (SHARDKIT_SHM_SLOT_BYTES / world bytes per
peer, 1 MiB / world by default), syncs, and copies its parts out of the peers' slots: two copies of ``size`` bytes
per rank, in ⌈largest split / slot share⌉ rounds.

How: one job of spawned ranks per world size (file:// rendezvous, no ports) whose default group is shardkit and
which also holds a gloo group over the same ranks (``_harness.init_groups``), so both backends see the same
processes, buffers and machine state. Each row is first run once on both backends with rank-dependent data and
the results compared (the received tensors must be equal, and equal to what was sent). Then shardkit, gloo and
a bound are timed with their repetitions interleaved in rotating order (``_harness.time_interleaved``): each
repetition a barrier of that backend, then a loop of calls; a repetition's time per call is the slowest rank's.

  latency  median over repetitions (quartiles kept); ratio = shardkit / gloo latency (below 1: shardkit faster),
           with the per-repetition ratios' median and middle half, which interleaving makes comparable
  algbw    size / latency (bytes each rank sends per second)
  memcpy   the bound: ``dst.copy_(src)`` of ``size`` bytes on rank 0 alone (one thread; the other ranks wait),
           timed interleaved with the two backends in every row. A transfer between processes moves at least
           those bytes once, so latency / memcpy says how far an op is from the memory bound (for all_to_all at
           world 4, where every rank copies at once, the one-rank copy flatters the bound).

Results: ``benchmarks/results/p2p.json`` (machine, config, one row per op, world and size with both backends'
latencies, quartiles, algbw, the ratio and the memcpy bound); a run replaces the rows it measured and keeps the
others. No plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import format_size, format_table, format_us, parse_size  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    TimingConfig,
    announce,
    init_groups,
    launch_ranks,
    load_note,
    machine_info,
    merge_results,
    paired_summary,
    quartiles,
    rank0_progress,
    time_interleaved,
    utc_now,
    write_json,
    wrote,
)

OPS = ("p2p_stream", "p2p_exchange", "a2a_even", "a2a_uneven")
P2P_OPS = ("p2p_stream", "p2p_exchange")  # world 2 only
BACKENDS = ("shardkit", "gloo")
DEFAULT_SIZES = ("4K", "64K", "1M", "16M", "64M")
QUICK_SIZES = ("4K", "1M")
DTYPE = torch.float32
ELEM = 4  # bytes per f32 element


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    sizes: tuple[int, ...]
    ops: tuple[str, ...]
    timing: TimingConfig
    pg_timeout_s: float


def ops_for(world: int, ops: Sequence[str]) -> list[str]:
    return [op for op in ops if op not in P2P_OPS or world == 2]


# --- splits and buffers ------------------------------------------------------------------------------------

def uneven_splits(numel: int, world: int, rank: int) -> tuple[list[int], list[int]]:
    """(input splits, output splits) in elements for ``a2a_uneven`` on ``rank``.

    Rank r sends peer p ``base · w(r, p)`` elements with w(r, p) = 1 + (r + p) % world and
    base = numel // Σ_p w(r, p) (the sum, world(world + 1)/2, is the same for every r); what rounding leaves goes
    to r itself. w is symmetric, so rank r receives ``base · w(p, r)`` from each peer p and the same remainder
    from itself: ``numel`` elements in and out, with every rank computing its output splits from the formula.
    """
    weights = [1 + (rank + p) % world for p in range(world)]
    base = numel // (world * (world + 1) // 2)
    send = [base * w for w in weights]
    send[rank] += numel - sum(send)
    recv = [base * (1 + (p + rank) % world) for p in range(world)]
    recv[rank] += numel - sum(recv)
    return send, recv


@dataclasses.dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor
    in_splits: list[int] | None = None
    out_splits: list[int] | None = None


def make_buffers(op: str, size: int, world: int, rank: int, fill: Callable[[int], torch.Tensor]) -> Buffers:
    numel = size // ELEM
    if op == "a2a_uneven":
        in_splits, out_splits = uneven_splits(numel, world, rank)
        return Buffers(fill(numel), torch.empty(numel, dtype=DTYPE), in_splits, out_splits)
    return Buffers(fill(numel), torch.empty(numel, dtype=DTYPE))


def make_call(op: str, buf: Buffers, rank: int, group: Any) -> Callable[[], None]:
    """One blocking call of ``op`` on ``group`` (None = the default group, i.e. shardkit)."""
    peer = 1 - rank
    if op == "p2p_stream":
        p2p = (dist.P2POp(dist.isend, buf.send, peer, group) if rank == 0 else
               dist.P2POp(dist.irecv, buf.recv, peer, group))

        def stream() -> None:
            for work in dist.batch_isend_irecv([p2p]):
                work.wait()
        return stream
    if op == "p2p_exchange":
        pair = [dist.P2POp(dist.isend, buf.send, peer, group), dist.P2POp(dist.irecv, buf.recv, peer, group)]

        def exchange() -> None:
            for work in dist.batch_isend_irecv(pair):
                work.wait()
        return exchange
    if op in ("a2a_even", "a2a_uneven"):
        return lambda: dist.all_to_all_single(buf.recv, buf.send, buf.out_splits, buf.in_splits, group=group)
    raise ValueError(f"unknown op {op!r}")


def check_against_gloo(op: str, size: int, rank: int, world: int, gloo: Any) -> None:
    """Run the row once on each backend with rank-dependent data; the received tensors must be equal, and for
    p2p equal to what the peer sent. Guards the timing against measuring an op that silently does the wrong
    thing."""
    def fill_of(r: int) -> Callable[[int], torch.Tensor]:
        return lambda n: ((torch.arange(n) % 251) + 1000 * (r + 1)).to(DTYPE)

    got = []
    for group in (None, gloo):
        buf = make_buffers(op, size, world, rank, fill_of(rank))
        buf.recv.fill_(-1)
        make_call(op, buf, rank, group)()
        got.append(buf.recv)
    if op in P2P_OPS and (op == "p2p_exchange" or rank == 1):
        expected = fill_of(1 - rank)(size // ELEM)
        if not torch.equal(got[0], expected):
            raise AssertionError(f"rank {rank}: shardkit {op} {format_size(size)} received wrong data")
        if not torch.equal(got[1], expected):
            raise AssertionError(f"rank {rank}: gloo {op} {format_size(size)} received wrong data")
    elif op not in P2P_OPS and not torch.equal(got[0], got[1]):
        bad = (got[0] != got[1]).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"rank {rank}: shardkit {op} {format_size(size)} differs from gloo at elements {bad}")


# --- one rank ----------------------------------------------------------------------------------------------

def rank_main(rank: int, world: int, store: str, cfg: BenchConfig) -> list[dict[str, Any]] | None:
    gloo = init_groups(rank, world, store, cfg.pg_timeout_s)
    barriers: dict[str, Callable[[], Any]] = {"shardkit": lambda: dist.barrier(),
                                              "gloo": lambda: dist.barrier(group=gloo),
                                              "memcpy": lambda: dist.barrier(group=gloo)}
    groups = {"shardkit": None, "gloo": gloo}
    progress = rank0_progress(rank)
    rows: list[dict[str, Any]] = []
    for op in ops_for(world, cfg.ops):
        progress(f"world {world}: {op}:", end="")
        for size in cfg.sizes:
            progress(f" {format_size(size)}", end="")
            check_against_gloo(op, size, rank, world, gloo)
            buf = make_buffers(op, size, world, rank, lambda n: torch.zeros(n, dtype=DTYPE))
            calls = {backend: make_call(op, buf, rank, groups[backend]) for backend in BACKENDS}
            src = torch.ones(size // ELEM, dtype=DTYPE)
            dst = torch.empty_like(src)
            dst.copy_(src)  # first touch: page faults are not bandwidth
            calls["memcpy"] = (lambda: dst.copy_(src)) if rank == 0 else (lambda: None)
            timings = time_interleaved(calls, barriers, gloo, cfg.timing)
            rows.append(make_row(op, world, size, timings, buf))
        progress("")
    return rows if rank == 0 else None


def make_row(op: str, world: int, size: int, timings: dict[str, Any], buf: Buffers) -> dict[str, Any]:
    latency = {name: t.seconds for name, t in timings.items()}
    sk, gl, copy = latency["shardkit"], latency["gloo"], latency["memcpy"]
    row: dict[str, Any] = {
        "op": op, "world": world, "size_bytes": size, "dtype": "f32",
        "latency_s": {b: latency[b] for b in BACKENDS},
        "quartiles_s": {b: list(quartiles(timings[b].samples)) for b in BACKENDS},
        "algbw_GBps": {b: size / latency[b] / 1e9 for b in BACKENDS},
        "ratio": sk / gl,  # shardkit / gloo latency: below 1, shardkit is faster
        "ratio_per_rep": paired_summary(timings["shardkit"].samples, timings["gloo"].samples),
        "memcpy_s": copy,
        "memcpy_GBps": size / copy / 1e9,
        "of_memcpy": {b: latency[b] / copy for b in BACKENDS},  # latency in units of the one-rank copy
        "iters": {name: t.iters for name, t in timings.items()},
        "samples_s": {name: t.samples for name, t in timings.items()},
    }
    if buf.in_splits is not None:
        row["splits_rank0_elems"] = {"input": buf.in_splits, "output": buf.out_splits}
    return row


# --- reporting ---------------------------------------------------------------------------------------------

def print_world(world: int, rows: Sequence[dict[str, Any]], cfg: BenchConfig) -> None:
    table = []
    for row in rows:
        sk, gl = row["latency_s"]["shardkit"], row["latency_s"]["gloo"]
        q = row["quartiles_s"]
        per_rep = row["ratio_per_rep"]
        table.append([row["op"], format_size(row["size_bytes"]),
                      f"{format_us(sk)} ({format_us(q['shardkit'][0])}–{format_us(q['shardkit'][2])})",
                      f"{row['algbw_GBps']['shardkit']:.3f}",
                      f"{format_us(gl)} ({format_us(q['gloo'][0])}–{format_us(q['gloo'][2])})",
                      f"{row['algbw_GBps']['gloo']:.3f}",
                      f"{row['ratio']:.2f}" + (f" ({per_rep['q1']:.2f}–{per_rep['q3']:.2f})" if per_rep else ""),
                      format_us(row["memcpy_s"]), f"{row['of_memcpy']['shardkit']:.1f}x",
                      f"{row['of_memcpy']['gloo']:.1f}x"])
    print(f"\n=== world {world}: shardkit vs gloo (same job; latency = median of {cfg.timing.reps} reps (quartiles), "
          f"slowest rank; memcpy = bound, one rank copying size bytes) ===")
    print(format_table(["op", "size", "shardkit µs", "GB/s", "gloo µs", "GB/s", "shardkit/gloo",
                        "memcpy µs", "sk/memcpy", "gloo/memcpy"], table, left=2))


# --- main --------------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4],
                   help="world sizes (default: 2 4); the p2p ops run at world 2 only")
    p.add_argument("--sizes", nargs="+", default=None,
                   help=f"per-rank sizes, e.g. 4K 1M 64M (default: {' '.join(DEFAULT_SIZES)}; "
                        f"--quick: {' '.join(QUICK_SIZES)})")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--iters", type=int, default=None,
                   help="calls per repetition for small sizes (default 1000, --quick 200); large sizes use fewer "
                        "so each point takes about --point-seconds")
    p.add_argument("--reps", type=int, default=None, help="repetitions per point (default 7, --quick 3)")
    p.add_argument("--point-seconds", type=float, default=None,
                   help="target time per point and backend (default 0.5, --quick 0.1)")
    p.add_argument("--quick", action="store_true", help=f"sizes {' '.join(QUICK_SIZES)} and shorter timing")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for p2p.json")
    return p.parse_args(argv)


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 41's asks, on the merged rows: all-to-all at least as fast as gloo at every size and world; point-to-
    point as fast as the host's memory allows, read as within 3 one-rank copies of the bytes at 64M (the direct
    route copies them twice: into the staging buffer, and out of it into the receiver's tensor)."""
    checks = []
    a2a = [r["ratio"] for r in rows if r["op"].startswith("a2a")]
    if a2a:
        checks.append({"target": "all_to_all_single, even and uneven, worlds 2 and 4, 4K-64M: largest shardkit/gloo "
                                 "latency ratio", "value": max(a2a), "limit": 1.0})
    for op, what in (("p2p_stream", "one way"), ("p2p_exchange", "both ways at once, as pipeline stages swap")):
        p2p = [r["of_memcpy"]["shardkit"] for r in rows if r["op"] == op and r["size_bytes"] == 64 << 20]
        if p2p:
            checks.append({"target": f"point-to-point at 64M, {what}: shardkit's latency in one-rank memcpy times "
                                     "(the direct route copies the bytes twice)", "value": max(p2p), "limit": 3.0})
    big = [r["ratio"] for r in rows if r["op"].startswith("p2p") and r["size_bytes"] >= 16 << 20]
    if big:
        checks.append({"target": "point-to-point at 16M and 64M: largest shardkit/gloo latency ratio",
                       "value": max(big), "limit": 1.0})
    for check in checks:
        check["status"] = "PASS" if check["value"] <= check["limit"] else "MISS"
    return checks


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a row measured: rows with the same key replace each other when results are merged."""
    return row["op"], row["world"], row["size_bytes"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        sizes = tuple(sorted({parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))}))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    for world in args.worlds:
        if world < 2:
            raise SystemExit(f"--worlds: point-to-point and all-to-all need at least 2 ranks, got {world}")
        for size in sizes:
            if size % (world * ELEM):  # even all_to_all splits of whole f32 elements
                raise SystemExit(f"--sizes: {size} bytes is not a multiple of 4·world = {ELEM * world}")
    if not any(ops_for(w, args.ops) for w in args.worlds):
        raise SystemExit("nothing to run: the p2p ops run at world 2 only")
    quick = args.quick
    cfg = BenchConfig(
        sizes=sizes,
        ops=tuple(op for op in OPS if op in args.ops),
        timing=TimingConfig(max_iters=args.iters or (200 if quick else 1000), reps=args.reps or (3 if quick else 7),
                            point_s=args.point_seconds or (0.1 if quick else 0.5),
                            warmup_s=0.02 if quick else 0.05),
        pg_timeout_s=120.0,
    )

    machine = machine_info()
    announce("shardkit point-to-point and all-to-all benchmark", machine,
             f"worlds {args.worlds}, sizes {' '.join(format_size(s) for s in sizes)}", cores_in_warning=True)
    rows: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    foreign_cores: dict[str, float | None] = {}
    for world in args.worlds:
        if not ops_for(world, cfg.ops):
            continue
        t0 = time.monotonic()
        with ForeignLoad() as load:
            world_rows = launch_ranks(rank_main, world, cfg, timeout=900.0)[0]
        seconds[f"world_{world}"] = time.monotonic() - t0
        foreign_cores[str(world)] = load.cores
        rows.extend(world_rows)
        print_world(world, world_rows, cfg)
        if (note := load_note(load.cores, machine, "this world's run")):
            print(note)
    elapsed = time.monotonic() - started
    for row in rows:
        row["run"] = machine["date"]  # which run measured it, once results of several runs are merged

    path = args.out / "p2p.json"
    merged = merge_results(path, {
        "benchmark": "p2p",
        "machine": machine,
        "config": {"worlds": args.worlds, "sizes": list(sizes), "ops": list(cfg.ops),
                   "timing": dataclasses.asdict(cfg.timing), "quick": quick, "omp_num_threads": 1, "dtype": "f32",
                   "shardkit_p2p": "direct route from 2 MiB (local_p2p.h: staged copy + process_vm_readv), "
                                   "inner gloo backend below",
                   "shardkit_all_to_all": "shared-memory engine (ShmGroup::alltoall)"},
        "rows": rows,
        "foreign_load_cores": foreign_cores,
        "seconds": seconds,
        "runs": {machine["date"]: {"git_commit": machine["git_commit"], "cpu_model": machine["cpu_model"],
                                   "load_avg_1m": machine["load_avg_1m"], "argv": list(argv or sys.argv[1:]),
                                   "seconds": elapsed}},
        "finished": utc_now(),
    }, row_keys={"rows": row_key})
    merged["targets"] = targets(merged["rows"])
    write_json(path, merged)
    for check in merged["targets"]:
        print(f"{check['status']}: {check['target']}: {check['value']:.2f} (limit {check['limit']})")
    print("\n" + wrote(path) + " (this run's rows replaced, the others kept)")
    print(f"total {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

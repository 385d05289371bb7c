"""What checking a live recovery costs: one state of ``--mb`` MB sent from rank 0 to rank 1 over torchft's
ProcessGroupGloo by shardkit's ChecksummedTransport (CRC32C of every tensor, metadata read with weights_only) and
by torchft's own PGTransport (the anchor), in the same run, the same group, interleaved.

    python benchmarks/torchft_transport.py                  # 100 MB, 7 timed rounds (well under a minute)
    python benchmarks/torchft_transport.py --mb 20 --rounds 3

The state: ``--tensors`` float32 tensors of random values (``--mb`` in all) plus a few small entries, laid out as a
model and optimizer state (nested dicts, ints, floats, a 0-d step tensor). Each transfer starts after a barrier
(on a gloo group of its own, not the one measured) and its time is the slower rank's: the sender's
``send_checkpoint`` or the receiver's ``recv_checkpoint`` (PGTransport without an in-place state dict, as the
Manager uses it by default: it allocates what it receives, as ChecksummedTransport always does). Every received
state is compared bit for bit with the sent one (untimed). A warm-up round first; then in round r the two take
turns in an order rotated by r; medians over rounds, the ratio of medians (shardkit / PGTransport) and the median
of the per-round ratios.

Results: ``benchmarks/results/torchft_transport.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import format_table  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    agree_max,
    interleaved_rounds,
    launch_ranks,
    machine_info,
    rank0_progress,
    round_ratios,
    write_json,
    wrote,
)

TRANSPORTS = ("shardkit ChecksummedTransport", "torchft PGTransport")
TIMEOUT = timedelta(seconds=120)


def make_state(total_bytes: int, tensors: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    numel = total_bytes // tensors // 4
    model = {f"layers.{i}.weight": torch.rand(numel, generator=generator) for i in range(tensors)}
    return {"user": {"default": {"model": model, "optim": {"state": {0: {"step": torch.tensor(10.0)}},
                                                           "param_groups": [{"lr": 0.1, "params": [0]}]}}},
            "torchft": {"step": 10, "batches_committed": 20}}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _rank(rank: int, world: int, store: str, total_bytes: int, tensors: int, rounds: int,
          warmup: int) -> dict[str, Any]:
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    from shardkit.integrations._torchft_transport import PROTOCOL, ChecksummedTransport

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    tcp = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [tcp.port if tcp is not None else None]
    dist.broadcast_object_list(port, src=0)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(f"localhost:{port[0]}/bench", "bench", rank, world)
    transports = {TRANSPORTS[0]: (ChecksummedTransport(pg, timeout=TIMEOUT), PROTOCOL),
                  TRANSPORTS[1]: (PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu")), "<n/a>")}
    state = make_state(total_bytes, tensors)
    progress = rank0_progress(rank, "torchft_transport: ")
    times: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    step = 0
    for _r, order, timed_round in interleaved_rounds(TRANSPORTS, warmup, rounds, progress, label="round",
                                                     done=" done"):
        for name in order:
            transport, metadata = transports[name]
            step += 1
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                transport.send_checkpoint([1], step, state, TIMEOUT)
                got = None
            else:
                got = transport.recv_checkpoint(0, metadata, step, TIMEOUT)
            seconds = agree_max([time.perf_counter() - start], None)[0]
            if got is not None and not _same(state, got):
                raise RuntimeError(f"{name}: the received state differs from the sent one")
            del got
            if timed_round:
                times[name].append(seconds)
    nbytes = sum(t.nbytes for t in state["user"]["default"]["model"].values())
    dist.destroy_process_group()
    return {"times": times, "bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="state size in MB (10^6 bytes)")
    p.add_argument("--tensors", type=int, default=25)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "torchft_transport.json")
    args = p.parse_args(argv)
    machine = machine_info()
    with ForeignLoad() as load:
        per_rank = launch_ranks(_rank, 2, int(args.mb * 1e6), args.tensors, args.rounds, args.warmup, timeout=600)
    times, nbytes = per_rank[0]["times"], per_rank[0]["bytes"]
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    ours, anchor = TRANSPORTS
    ratio = medians[ours] / medians[anchor]
    per_round = statistics.median(round_ratios(times[ours], times[anchor]))
    rows = [[name, f"{medians[name] * 1e3:.0f} ms", f"{min(times[name]) * 1e3:.0f} ms",
             f"{nbytes / medians[name] / 1e9:.2f} GB/s"] for name in TRANSPORTS]
    print(f"a state of {nbytes / 1e6:.0f} MB in {args.tensors} tensors, rank 0 -> rank 1 over torchft's "
          f"ProcessGroupGloo ({args.rounds} rounds; other load {load.cores or 0:.2f} cores)")
    print(format_table(["transport", "median", "best", "GB/s (median)"], rows))
    print(f"shardkit / PGTransport: {ratio:.2f}x (median of per-round ratios {per_round:.2f}x)")
    write_json(args.out, {"machine": machine, "foreign_load_cores": load.cores, "state_bytes": nbytes,
                          "tensors": args.tensors, "rounds": args.rounds, "warmup": args.warmup, "seconds": times,
                          "median_s": medians, "ratio": ratio, "median_of_round_ratios": per_round})
    print(wrote(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``collectives.py --peer deepspeed``: shardkit's allreduce beside DeepSpeed's CPU shared-memory allreduce.

DeepSpeed lives in its own venv (``make bench-peers``: torch pinned as here, DeepSpeed from PyPI, no shardkit),
so the two cannot share processes. Instead each round runs one job of shardkit ranks (here) and one job of
DeepSpeed ranks (``_deepspeed_peer.py`` under the peer venv's Python), alternately, ``--rounds`` times; every
series keeps its best round (the least disturbed by foreign load, which is printed per round). Both jobs time with
``_harness.time_collective`` (median of repetitions, slowest rank) and both measure gloo's ``dist.all_reduce``, so
a drift between jobs shows. f32, SUM, per-rank sizes as in the main table.

  shardkit    torch.distributed.all_reduce on the shardkit backend (what users call)
  sk_direct   shardkit.all_reduce_: the same collective without torch's Python wrapper, dispatcher and Work
  ds_raw      torch.ops.deepspeed.inference_all_reduce_: DeepSpeed's shm kernel, no Python wrapper
  ds_comm     deepspeed.comm.inference_all_reduce: DeepSpeed's Python entry to it
  gloo        torch.distributed.all_reduce on gloo (in both jobs)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import format_size, format_table, format_us
from _harness import (
    RESULTS_DIR,
    ForeignLoad,
    TimingConfig,
    add_target,
    header,
    init_groups,
    launch_ranks,
    machine_info,
    time_collective,
    write_json,
    wrote,
)

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def _shardkit_rank(rank: int, world: int, store: str, sizes: list[int], cfg: TimingConfig) -> list[dict]:
    import shardkit

    gloo = init_groups(rank, world, store)
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for series, call, barrier in (("shardkit", lambda: dist.all_reduce(t), lambda: dist.barrier()),
                                      ("sk_direct", lambda: shardkit.all_reduce_(t), lambda: dist.barrier()),
                                      ("gloo", lambda: dist.all_reduce(t, group=gloo), lambda: dist.barrier(gloo))):
            timing = time_collective(call, barrier, gloo, cfg)
            rows.append({"bytes": nbytes, "series": series, "seconds": timing.seconds, "samples": timing.samples})
    return rows


def _deepspeed_job(world: int, sizes: list[int], cfg: TimingConfig) -> dict[str, Any]:
    cmd = [str(PEER_PYTHON), str(Path(__file__).with_name("_deepspeed_peer.py")), "--world", str(world),
           "--sizes", *[str(s) for s in sizes], "--iters", str(cfg.max_iters), "--reps", str(cfg.reps),
           "--point-seconds", str(cfg.point_s)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the DeepSpeed job failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(worlds: list[int], sizes: list[int], cfg: TimingConfig, rounds: int, out: Path = RESULTS_DIR) -> int:
    if not PEER_PYTHON.exists():
        print(f"--peer deepspeed: no peer venv at {PEER_PYTHON.parent.parent}; run `make bench-peers` first")
        return 2
    machine = machine_info()
    print(header("shardkit vs DeepSpeed CPU shm allreduce", machine, f"worlds {worlds}, sizes "
                 f"{' '.join(format_size(s) for s in sizes)}, {rounds} interleaved rounds (best round per series)"))
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    ds_version = "?"
    for world in worlds:
        best: dict[tuple[int, str], float] = {}
        for round_index in range(rounds):
            for job in ("shardkit", "deepspeed"):
                with ForeignLoad() as load:
                    if job == "shardkit":
                        rows = launch_ranks(_shardkit_rank, world, sizes, cfg, timeout=1800)[0]
                        tag = ""
                    else:
                        payload = _deepspeed_job(world, sizes, cfg)
                        ds_version, rows, tag = payload["deepspeed"], payload["rows"], "ds:"
                print(f"  world {world} round {round_index + 1} {job:9s}: other processes used "
                      f"{load.cores:.2f} cores")
                for row in rows:
                    key = (row["bytes"], tag + row["series"] if row["series"] == "gloo" else row["series"])
                    best[key] = min(best.get(key, float("inf")), row["seconds"])
        table = []
        for nbytes in sizes:
            get = lambda series: best.get((nbytes, series))  # noqa: E731
            sk, direct, raw, comm = get("shardkit"), get("sk_direct"), get("ds_raw"), get("ds_comm")
            table.append([format_size(nbytes), format_us(sk), format_us(direct), format_us(raw), format_us(comm),
                          format_us(get("gloo")), format_us(get("ds:gloo")), f"{sk / raw:.2f}", f"{direct / raw:.2f}",
                          f"{sk / comm:.2f}"])
            results.append({"world": world, "bytes": nbytes, **{series: best.get((nbytes, series))
                                                                  for series in ("shardkit", "sk_direct", "ds_raw",
                                                                                 "ds_comm",
                                                                                 "gloo", "ds:gloo")}})
        print(f"\n=== world {world}, f32 allreduce latency (µs; best of {rounds} rounds) ===")
        print(format_table(["size", "shardkit", "sk direct", "DS raw op", "DS comm", "gloo", "gloo (DS job)",
                            "sk/raw", "direct/raw", "sk/comm"], table))
        print()
        small, large = min(sizes), max(sizes)
        if (small, "shardkit") in best and (small, "ds_raw") in best:
            limit = 0.8 if world == 2 else 1.0
            add_target(checks, f"world {world}, {format_size(small)} dist.all_reduce on shardkit ≤ {limit}× "
                               "DeepSpeed's raw shm op", best[(small, "shardkit")] / best[(small, "ds_raw")], limit,
                       higher_is_better=False, unit="×")
            add_target(checks, f"world {world}, {format_size(small)} shardkit.all_reduce_ ≤ {limit}× DeepSpeed's raw "
                               "shm op", best[(small, "sk_direct")] / best[(small, "ds_raw")], limit,
                       higher_is_better=False, unit="×")
        if large >= 64 << 20 and (large, "ds_raw") in best:
            add_target(checks, f"world {world}, {format_size(large)}: DeepSpeed's raw op time ≥ 2× shardkit's",
                       best[(large, "ds_raw")] / best[(large, "shardkit")], 2.0, higher_is_better=True, unit="×")
    path = write_json(out / "deepspeed_allreduce.json", {"benchmark": "deepspeed_allreduce", "machine": machine,
                                                          "deepspeed": ds_version, "rounds": rounds,
                                                          "rows": results, "targets": checks})
    print("\n" + wrote(path))
    return 0

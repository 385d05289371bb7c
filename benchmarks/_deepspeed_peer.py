"""DeepSpeed's CPU shared-memory allreduce, timed like shardkit's (run by ``collectives.py --peer deepspeed``).

Runs in a venv holding torch and DeepSpeed but not shardkit (``make bench-peers`` makes it): one job of
``--world`` spawned ranks, DeepSpeed initialised on gloo with its CPU accelerator (``DS_ACCELERATOR=cpu``), which
builds its shm op (``torch.ops.deepspeed.inference_all_reduce_``) at init. Measured per size (f32, SUM), with
``_harness.time_collective`` as shardkit's side is:
  ds_raw     torch.ops.deepspeed.inference_all_reduce_(t): the shm kernel, no Python wrapper
  ds_comm    deepspeed.comm.inference_all_reduce(t): DeepSpeed's Python entry to the same kernel
  gloo       torch.distributed.all_reduce on gloo, the anchor both jobs share
Prints one JSON object on stdout: {"deepspeed": version, "rows": [{"bytes", "series", "seconds", "samples"}]}.
MASTER_ADDR/MASTER_PORT only name DeepSpeed's shm segments here (no socket is opened with them); DeepSpeed never
unlinks them, so this script does once its ranks have exited.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_size  # noqa: E402
from _harness import TimingConfig, launch_ranks, time_collective  # noqa: E402


def _rank(rank: int, world: int, store: str, sizes: list[int], cfg: TimingConfig) -> list[dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(world)  # DeepSpeed uses shm only when every rank is local
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                               verbose=False)
    if not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        raise RuntimeError("DeepSpeed's shm allreduce op did not load (torch.ops.deepspeed.inference_all_reduce_)")
    group = dist.group.WORLD
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        calls = {
            "ds_raw": lambda: torch.ops.deepspeed.inference_all_reduce_(t),
            "ds_comm": lambda: ds_comm.inference_all_reduce(t, op=ds_comm.ReduceOp.SUM),
            "gloo": lambda: dist.all_reduce(t),
        }
        for series, call in calls.items():
            timing = time_collective(call, lambda: dist.barrier(group), group, cfg)
            rows.append({"bytes": nbytes, "series": series, "seconds": timing.seconds, "samples": timing.samples})
    return rows


def _unlink_deepspeed_segments(env: dict[str, str]) -> None:
    """DeepSpeed never unlinks its shm segments (one per rank, named after uid, MASTER_ADDR and MASTER_PORT):
    once the ranks have exited, remove this job's, so nothing is left in /dev/shm."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_{env['MASTER_ADDR']}_{env['MASTER_PORT']}_"
    for segment in Path("/dev/shm").glob(prefix + "*"):
        segment.unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--sizes", nargs="+", required=True)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--point-seconds", type=float, default=0.5)
    args = p.parse_args()
    import deepspeed

    cfg = TimingConfig(max_iters=args.iters, reps=args.reps, point_s=args.point_seconds)
    env = {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "shardkit-bench", "MASTER_PORT": str(os.getpid())}
    try:
        rows = launch_ranks(_rank, args.world, [parse_size(s) for s in args.sizes], cfg, env=env, timeout=900)[0]
    finally:
        _unlink_deepspeed_segments(env)
    print(json.dumps({"deepspeed": deepspeed.__version__, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

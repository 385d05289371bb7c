"""shardkit's CUDA kernels against their anchors, on one GPU (issue #13's benchmark; needs the CUDA build).

    python benchmarks/gpu_kernels.py [--mb 256] [--rounds 50] [--out benchmarks/results/gpu_kernels.json]

Rows, each timed with CUDA events (median of --rounds after warm-up), inputs rotated among several buffer
sets so that a buffer never sits in L2 between runs:
  - pack / unpack of 256 tensors (mixed sizes, --mb in all) into / out of one flat buffer, and cast+scale
    fp32 -> bf16 and bf16 -> fp32 (x 1/8): bandwidth (bytes read + written) beside a device-to-device copy of
    the same bytes (torch's copy_), the anchor. Target: >= 80% of the copy's bandwidth.
  - Gram-Schmidt of PowerSGD's P matrices (1024 matrices of 1024 x 4, fp32) beside torch's own
    _orthogonalize_gram_schmidt from its PowerSGD hook. Target: >= 2x faster.
The PowerSGD hook on CUDA and the FSDP step beside FSDP2 join this file with the NCCL engine (issue #13).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, add_target, format_table, machine_info, write_json  # noqa: E402

SETS = 4  # buffer sets rotated between runs (together well beyond H100's 50 MB L2)


def median_ms(fn, rounds: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rotating(calls):
    """One callable that runs calls[0], calls[1], ... in turn, so consecutive runs touch different buffers."""
    state = {"next": 0}

    def run():
        calls[state["next"] % len(calls)]()
        state["next"] += 1
    return run


def bandwidth_rows(mb: int, rounds: int) -> list[dict]:
    from shardkit import _C

    g = torch.Generator(device="cuda").manual_seed(0)
    numel = mb * (1 << 20) // 4
    sizes = [(numel // 256) + ((i * 37) % 101) - 50 for i in range(256)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    sets = []
    for _ in range(SETS):
        flat = torch.randn(total, device="cuda", generator=g)
        pieces = [torch.randn(n, device="cuda", generator=g) for n in sizes]
        sets.append((flat, pieces, torch.empty_like(flat), torch.empty(total, device="cuda", dtype=torch.bfloat16)))
    moved = 2 * total * 4  # f32 read + written
    cases = {
        "device copy (anchor)": (rotating([lambda s=s: s[2].copy_(s[0]) for s in sets]), moved),
        "pack": (rotating([lambda s=s: _C.cuda_pack_(s[0], s[1], offsets) for s in sets]), moved),
        "unpack": (rotating([lambda s=s: _C.cuda_unpack_(s[0], s[1], offsets) for s in sets]), moved),
        "unpack x 1/8": (rotating([lambda s=s: _C.cuda_unpack_(s[0], s[1], offsets, 0.125) for s in sets]), moved),
        "cast+scale f32->bf16": (rotating([lambda s=s: _C.cuda_cast_scale_(s[3], s[0], 0.125) for s in sets]),
                                 total * 6),
        "cast+scale bf16->f32": (rotating([lambda s=s: _C.cuda_cast_scale_(s[2], s[3], 0.125) for s in sets]),
                                 total * 6),
        "torch .to(bf16) then mul_": (rotating([lambda s=s: s[3].copy_(s[0]).mul_(0.125) for s in sets]),
                                      total * 6),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        ms = median_ms(fn, rounds)
        rows.append({"kernel": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6})
    anchor = rows[0]["gb_per_s"]
    for row in rows:
        row["of_copy"] = row["gb_per_s"] / anchor
    return rows


def orthogonalize_rows(rounds: int) -> list[dict]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt

    from shardkit import _C

    g = torch.Generator(device="cuda").manual_seed(1)
    sets = [torch.randn(1024, 1024, 4, device="cuda", generator=g) for _ in range(SETS)]
    torch_ms = median_ms(rotating([lambda m=m: _orthogonalize_gram_schmidt(m, 1e-8) for m in sets]), rounds)
    ours_ms = median_ms(rotating([lambda m=m: _C.cuda_orthogonalize_(m, 1e-8) for m in sets]), rounds)
    return [{"kernel": "torch _orthogonalize_gram_schmidt (anchor)", "ms": torch_ms, "speedup": 1.0},
            {"kernel": "shardkit cuda_orthogonalize_", "ms": ours_ms, "speedup": torch_ms / ours_ms}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB of f32 moved by the bandwidth rows")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_kernels.json")
    args = parser.parse_args(argv)
    from shardkit import _C

    if not (_C.with_cuda and torch.cuda.is_available()):
        print("gpu_kernels: needs a CUDA GPU and shardkit's CUDA build (SHARDKIT_CUDA=1)", file=sys.stderr)
        return 2
    print(f"shardkit GPU kernels — {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bandwidth = bandwidth_rows(args.mb, args.rounds)
    orthogonalize = orthogonalize_rows(args.rounds)
    print(format_table(["kernel", "ms", "GB/s", "÷ copy"],
                       [[r["kernel"], f"{r['ms']:.3f}", f"{r['gb_per_s']:.0f}", f"{r['of_copy']:.2f}"] for r in bandwidth]))
    print(format_table(["orthogonalize 1024 x (1024 x 4) f32", "ms", "speed-up"],
                       [[r["kernel"], f"{r['ms']:.3f}", f"{r['speedup']:.2f}x"] for r in orthogonalize]))
    checks: list[dict] = []
    for row in bandwidth[1:6]:
        add_target(checks, f"{row['kernel']} bandwidth ÷ device copy", row["of_copy"], 0.8, higher_is_better=True,
                   unit="x")
    add_target(checks, "orthogonalize speed-up over torch", orthogonalize[1]["speedup"], 2.0, higher_is_better=True,
               unit="x")
    write_json(args.out, {"machine": machine_info(), "gpu": torch.cuda.get_device_name(), "bandwidth": bandwidth,
                          "orthogonalize": orthogonalize, "targets": checks})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

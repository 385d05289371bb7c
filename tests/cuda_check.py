"""`make cuda-check`: the CUDA build of shardkit imports and links NCCL, on a machine without a GPU.

Run from outside the source tree so the installed wheel, not the checkout, is imported.
"""

import sys

import torch

import shardkit
from shardkit import _C


def main() -> int:
    if not _C.with_cuda:
        print("cuda-check: FAILED: the installed shardkit is a CPU build", file=sys.stderr)
        return 1
    if shardkit.__file__.startswith(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "python")):
        print("cuda-check: FAILED: imported the checkout instead of the installed wheel", file=sys.stderr)
        return 1
    missing = [name for name in ("cuda_scale_", "cuda_pack_", "cuda_unpack_", "cuda_cast_scale_", "cuda_orthogonalize_")
               if not hasattr(_C, name)]
    if missing:
        print(f"cuda-check: FAILED: the CUDA build lacks {missing}", file=sys.stderr)
        return 1
    version = _C.nccl_version()
    major, minor, patch = version // 10000, version // 100 % 100, version % 100
    print(f"cuda-check: shardkit {shardkit.__version__} CUDA build imported from {shardkit.__file__}")
    print(f"cuda-check: torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {major}.{minor}.{patch}")
    print(f"cuda-check: GPU present: {torch.cuda.is_available()}")
    if torch.cuda.is_available():  # on a GPU machine, also run the kernel once
        t = torch.arange(8, dtype=torch.float32, device="cuda")
        _C.cuda_scale_(t, 0.5)
        assert torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32) * 0.5)
        print("cuda-check: cuda_scale_ kernel ran and matched")
    print("cuda-check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run by test_zero_copy.py inside a mount namespace whose /dev/shm is a small tmpfs: two ranks ask for shared
buffers past its room and must get None (c10 warns on stderr), train a zero-copy DDP that falls back to ordinary
buckets and an FSDP model whose flat gradients fall back to ordinary memory, and still get a small shared buffer.
Prints one JSON line per rank."""

import json
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def rank_main(rank: int, world: int, store: str) -> None:
    import shardkit

    dist.init_process_group("shardkit", init_method=f"file://{store}", rank=rank, world_size=world)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    too_big = backend.shared_buffer(64 << 20)
    torch.manual_seed(0)
    model = shardkit.DistributedDataParallel(nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024)),
                                             gradient_as_bucket_view=True)
    model(torch.randn(4, 1024)).sum().backward()
    grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # FSDP's zero-copy flat gradient memory (16 MB per rank for this unit) does not fit either: ordinary memory.
    fsdp = shardkit.FullyShardedDataParallel(nn.Sequential(nn.Linear(2048, 2048)))
    fsdp(torch.randn(4, 2048)).sum().backward()
    fsdp_ok = fsdp._reduce_memory is None and all(torch.isfinite(p.grad).all() for p in fsdp.parameters())
    small = backend.shared_buffer(1 << 20)
    line = json.dumps({"rank": rank, "too_big_is_none": too_big is None, "ddp_zero_copy": model.reducer.zero_copy(),
                       "grads_ok": bool(grads_ok), "fsdp_falls_back": bool(fsdp_ok), "small_works": small is not None and small.numel() == 1 << 20})
    # One write of the whole line (under PIPE_BUF: atomic), so that the two ranks' lines never interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(2, tempfile.mkdtemp() + "/store"), nprocs=2)
    sys.exit(0)

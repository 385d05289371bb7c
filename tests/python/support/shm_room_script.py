"""Run by test_zero_copy.py inside a mount namespace whose /dev/shm is a small tmpfs: two ranks ask for shared
buffers past its room and must get None, train a zero-copy DDP that falls back to ordinary buckets and an FSDP
model whose flat gradients fall back to ordinary memory (each with a ZeroCopyUnavailableWarning saying why), and
still get a small shared buffer;
then an FSDP model whose zero-copy memory fits carries on when /dev/shm fills up between iterations. Prints one
JSON line per rank."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _fsdp_when_dev_shm_fills_up(rank: int) -> dict:
    """An FSDP model whose zero-copy memory fits (2.6 MB per rank, for the root's layers; blocks need 0.5 MB) gives
    the root's part back after an iteration; then /dev/shm is filled to the brim, so that the next backward cannot
    have it again: both ranks warn and reduce that gradient from ordinary memory, with the copying path's
    results. Once there is room again, zero-copy resumes."""
    import warnings

    import shardkit

    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1024, 512, bias=False), _Block(), nn.Linear(256, 512), _Block())
        return shardkit.FullyShardedDataParallel(net, auto_wrap_policy={_Block})

    zero_copy, copying = make(), make()
    copying._reduce_memory = None
    filler = "/dev/shm/shardkit-test-filler"

    def step(n: int) -> None:
        g = torch.Generator().manual_seed(100 * rank + n)
        x = torch.randn(4, 1024, generator=g)
        for model in (zero_copy, copying):
            model.zero_grad()
            model(x).square().mean().backward()

    step(0)
    released = zero_copy._reduce_memory.resident < zero_copy._reduce_memory.memory.numel()
    dist.barrier()
    if rank == 0:
        with open(filler, "wb") as f:  # fill /dev/shm: the released pages cannot be had again
            try:
                while True:
                    f.write(b"\0" * (256 << 10))
                    f.flush()
            except OSError:
                pass
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(1)
    dist.barrier()
    if rank == 0:
        os.unlink(filler)
    dist.barrier()
    before = dist.group.WORLD._get_backend(torch.device("cpu")).shared_ops()
    step(2)
    after = dist.group.WORLD._get_backend(torch.device("cpu")).shared_ops()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(zero_copy.parameters(), copying.parameters()))
    return {"released": bool(released), "same_grads": bool(same), "zero_copy_again": after - before == 3,
            "warned": any("no zero-copy memory for the flat gradient of unit '(root)'" in str(w.message)
                          and issubclass(w.category, shardkit.ZeroCopyUnavailableWarning) for w in caught)}


def rank_main(rank: int, world: int, store: str) -> dict:
    import warnings

    import shardkit

    dist.init_process_group("shardkit", init_method=f"file://{store}", rank=rank, world_size=world)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        too_big = shardkit.backend.shared_buffer(64 << 20)
        torch.manual_seed(0)
        model = shardkit.DistributedDataParallel(nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024)),
                                                 gradient_as_bucket_view=True)
        model(torch.randn(4, 1024)).sum().backward()
        grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        # FSDP's zero-copy flat gradient memory (16 MB per rank for this unit) does not fit either: ordinary memory.
        fsdp = shardkit.FullyShardedDataParallel(nn.Sequential(nn.Linear(2048, 2048)))
        fsdp(torch.randn(4, 2048)).sum().backward()
    fsdp_ok = fsdp._reduce_memory is None and all(torch.isfinite(p.grad).all() for p in fsdp.parameters())
    small, _ = backend.shared_buffer(1 << 20)
    result = {"rank": rank, "too_big_is_none": too_big is None, "ddp_zero_copy": model.reducer.zero_copy(),
              "grads_ok": bool(grads_ok), "fsdp_falls_back": bool(fsdp_ok),
              "small_works": small is not None and small.numel() == 1 << 20,
              "warned": [str(w.message) for w in caught
                         if issubclass(w.category, shardkit.ZeroCopyUnavailableWarning)],
              "fsdp_when_full": _fsdp_when_dev_shm_fills_up(rank)}
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    # The ranks start from the harness's forkserver, which imports torch, dynamo and shardkit once for both (a
    # spawned rank imports them itself: ~7 CPU-s each); the parent prints their lines, or their tracebacks and fails.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python: support.harness
    from support import harness

    harness.script_ranks(rank_main, 2, timeout=120)

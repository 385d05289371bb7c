"""DDP, ZeRO-2, FSDP and the comm hooks on CUDA (marked ``cuda``: run by ``make gpu-test``).

Each case trains one seeded model twice on the GPU in lock step: torch's DistributedDataParallel on a gloo group
(the oracle: gloo reduces CUDA tensors itself, no shardkit code on its path) and the shardkit wrapper on the
default "shardkit" group, the same per-rank batches, gradients compared after every backward (DDP) and
parameters after every step. World 1 runs the shardkit side on NCCL; world 2 (both ranks on the one GPU of
the test machine) through host staging.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from shardkit import _C
from support.ddp_cases import assert_close, batch, gloo_world, loss_fn, mlp, sgd

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (_C.with_cuda and torch.cuda.is_available()),
                       reason="needs a CUDA GPU and shardkit's CUDA build (make gpu-test)"),
]


def _train(rank, world, wrapper, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import shardkit

    torch.cuda.set_device(0)
    module = mlp().cuda()
    ref = TorchDDP(copy.deepcopy(module), device_ids=[0], process_group=gloo_world())
    if wrapper == "ddp":
        dut = shardkit.DistributedDataParallel(copy.deepcopy(module), device_ids=[0])
        dut_opt = sgd(dut.parameters())
    elif wrapper == "zero2":
        dut = shardkit.DistributedDataParallel(copy.deepcopy(module), device_ids=[0], zero_stage=2)
        dut_opt = shardkit.ZeroRedundancyOptimizer(dut.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        dut = shardkit.FullyShardedDataParallel(copy.deepcopy(module), device_id=0)
        dut_opt = sgd(dut.parameters())
    ref_opt = sgd(ref.parameters())
    if hook == "bf16":
        ref.register_comm_hook(gloo_world(), default_hooks.bf16_compress_hook)
        dut.register_comm_hook(None, shardkit.hooks.bf16_compress_hook)
    elif hook == "powersgd":
        ref.register_comm_hook(powerSGD_hook.PowerSGDState(gloo_world(), matrix_approximation_rank=1,
                                                           start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        dut.register_comm_hook(shardkit.hooks.PowerSGDState(None, matrix_approximation_rank=1,
                                                            start_powerSGD_iter=2), shardkit.hooks.powerSGD_hook)
    tolerance = {"rtol": 2e-2, "atol": 2e-3} if hook == "bf16" else {"rtol": 1e-4, "atol": 1e-5}
    dut_module = dut.module
    for step in range(5):
        x, y = (t.cuda() for t in batch(rank, step))
        for model, opt in ((ref, ref_opt), (dut, dut_opt)):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
        if wrapper == "ddp":
            for (name, want), got in zip(ref.module.named_parameters(), dut_module.parameters()):
                assert got.grad is not None and got.grad.is_cuda, f"{name}.grad"
                assert_close(got.grad, want.grad, f"rank {rank} step {step} {name}.grad", **tolerance)
        ref_opt.step()
        dut_opt.step()
        with (dut.summon_full_params(dut) if wrapper == "fsdp" else contextlib.nullcontext()):
            for (name, want), got in zip(ref.module.named_parameters(), dut_module.parameters()):
                assert_close(got, want, f"rank {rank} step {step} {name}", **tolerance)
    return True


@pytest.mark.parametrize("world", [1, 2], ids=["nccl_world1", "host_staged_world2"])
@pytest.mark.parametrize("wrapper,hook", [("ddp", "none"), ("ddp", "bf16"), ("ddp", "powersgd"),
                                          ("zero2", "none"), ("fsdp", "none")])
def test_training_on_cuda_matches_torch_ddp(ranks, world, wrapper, hook):
    assert ranks.run(_train, world, wrapper, hook, timeout=300) == [True] * world

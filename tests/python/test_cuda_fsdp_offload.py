"""FSDP with ``cpu_offload=CPUOffload(offload_params=True)``.

The cases marked ``cuda`` (run by ``make gpu-test``) train one seeded model three times in lock step on the GPU:
torch's DistributedDataParallel on a gloo group (the oracle), shardkit FSDP on the device (the same units,
layout and casts, not offloaded) and shardkit FSDP offloaded. The offloaded run must keep its parameters,
gradients and optimizer state on the CPU (parameters and gradients pinned), give the same gradients as the
on-device run and the same parameters as both references after every step, and round-trip
summon_full_params, full state dicts and optimizer state dicts. World 1 runs shardkit's collectives on NCCL;
world 2 (both ranks on the one GPU of the test machine) through the backend's host staging.

Without CUDA, offload_params=True must be refused by name (the last tests; they run everywhere).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from shardkit import _C
from support.ddp_cases import assert_close, error_of, gloo_world
from support.fsdp_cases import adamw, batch, block_policy, net, sgd

cuda = pytest.mark.skipif(not (_C.with_cuda and torch.cuda.is_available()),
                          reason="needs a CUDA GPU and shardkit's CUDA build (make gpu-test)")

FP32 = {"rtol": 1e-4, "atol": 1e-5}  # as tests/python/test_cuda_training.py: GPU kernels vs gloo's sums
# bf16 compute: the offloaded and on-device runs share every cast (the same kernel), so they agree closely (the
# optimizer runs on the CPU for one, on the GPU for the other); against fp32 DDP, test_fsdp_models' bounds.
BF16 = {"rtol": 2e-2, "atol": 2e-3}
BF16_VS_FP32 = {"rtol": 5e-2, "atol": 2e-2}


def _assert_host(tensor: torch.Tensor, what: str, pinned: bool = True) -> None:
    assert tensor.device.type == "cpu", f"{what} is on {tensor.device}, expected the CPU"
    if pinned:
        assert tensor.is_pinned(), f"{what} is not in pinned host memory"


def _offload_parity(rank: int, world: int, strategy: str, precision: str) -> bool:
    import shardkit
    from shardkit.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

    torch.cuda.set_device(0)
    module = net(depth=3)  # on the CPU: offloaded FSDP must not move its parameters
    module.blocks[0].register_buffer("running", torch.arange(4.0))  # buffers go to the compute device
    mp = MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None
    tolerance = BF16 if precision == "bf16" else FP32
    tolerance_ddp = BF16_VS_FP32 if precision == "bf16" else FP32
    kwargs = dict(auto_wrap_policy=block_policy(), sharding_strategy=ShardingStrategy[strategy], mixed_precision=mp,
                  forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, device_id=0)
    ref = TorchDDP(copy.deepcopy(module).cuda(), device_ids=[0], process_group=gloo_world())
    plain = shardkit.FullyShardedDataParallel(copy.deepcopy(module), **kwargs)
    dut = shardkit.FullyShardedDataParallel(copy.deepcopy(module), cpu_offload=CPUOffload(offload_params=True),
                                            **kwargs)
    for name, p in dut.named_parameters():
        _assert_host(p, f"rank {rank}: {name} after wrapping")
    for name, p in plain.named_parameters():
        assert p.is_cuda, f"rank {rank}: the on-device run's {name} is on {p.device}"
    # AdamW (two state tensors per parameter) in fp32; SGD with momentum under bf16 compute, where AdamW's
    # normalised steps would turn bf16's rounding into differences from the fp32 DDP run larger than rounding.
    make_optimizer = sgd if precision == "bf16" else adamw
    optimizers = {"ref": make_optimizer(ref.module.parameters()), "plain": make_optimizer(plain.parameters()),
                  "dut": make_optimizer(dut.parameters())}
    models = {"ref": ref, "plain": plain, "dut": dut}

    for step in range(4):
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=step != 2)  # step 2: zeroed in place (the pinned .grad is reused)
        for key, model in models.items():
            if step == 1:  # two synced backwards: the second adds into the pinned .grad on the CPU
                x, y = batch(rank, step, micro=1)
                F.mse_loss(model(x if key == "dut" else x.cuda()).float(), y.cuda()).backward()
            if step == 3:  # a micro-batch under no_sync: accumulated on the device, reduced with the next
                with model.no_sync():
                    x, y = batch(rank, step, micro=1)
                    F.mse_loss(model(x if key == "dut" else x.cuda()).float(), y.cuda()).backward()
            x, y = batch(rank, step)
            # The offloaded model gets a CPU input: its root moves the inputs to the compute device, as FSDP1.
            out = model(x if key == "dut" else x.cuda())
            assert out.is_cuda, f"rank {rank} step {step}: {key}'s output is on {out.device}"
            F.mse_loss(out.float(), y.cuda()).backward()
        for (name, got), want in zip(dut.named_parameters(), plain.parameters()):
            _assert_host(got, f"rank {rank} step {step}: {name}")
            assert got.grad is not None, f"rank {rank} step {step}: {name}.grad is None"
            _assert_host(got.grad, f"rank {rank} step {step}: {name}.grad")
            assert got.grad.dtype == got.dtype and got.grad.shape == got.shape, f"{name}.grad {got.grad.shape}"
            assert_close(got.grad, want.grad.cpu(), f"rank {rank} step {step} {name}.grad vs on-device FSDP",
                         **tolerance)
        for opt in optimizers.values():
            opt.step()
        for p in dut.parameters():
            for key, value in optimizers["dut"].state[p].items():
                if isinstance(value, torch.Tensor):
                    assert value.device.type == "cpu", f"rank {rank}: optimizer state {key} is on {value.device}"
        got = dut.state_dict()  # gathered on the compute device (FSDP1: unless offload_to_cpu)
        for reference, want, bounds in (("torch DDP", ref.module.state_dict(), tolerance_ddp),
                                        ("on-device FSDP", plain.state_dict(), tolerance)):
            assert list(got) == list(want)
            for key, value in want.items():
                assert got[key].is_cuda, f"rank {rank}: full state dict value {key} is on {got[key].device}"
                assert_close(got[key], value, f"rank {rank} step {step} {key} vs {reference}", **bounds)
    for name, b in dut.named_buffers():
        assert b.is_cuda, f"rank {rank}: buffer {name} stayed on {b.device}"
    return True


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("world", [1, 2], ids=["nccl_world1", "host_staged_world2"])
@pytest.mark.parametrize("strategy,precision", [("FULL_SHARD", "fp32"), ("FULL_SHARD", "bf16"),
                                                ("SHARD_GRAD_OP", "fp32"), ("NO_SHARD", "fp32")])
def test_offloaded_fsdp_matches_on_device_fsdp_and_torch_ddp(ranks, world, strategy, precision):
    assert ranks.run(_offload_parity, world, strategy, precision, timeout=300) == [True] * world


def _round_trips(rank: int, world: int) -> bool:
    import shardkit
    from shardkit.fsdp import CPUOffload, FullStateDictConfig, StateDictType

    torch.cuda.set_device(0)
    FSDP = shardkit.FullyShardedDataParallel

    def offloaded(seed: int) -> FSDP:
        return FSDP(net(seed, depth=2), auto_wrap_policy=block_policy(), device_id=0,
                    cpu_offload=CPUOffload(offload_params=True))

    def train(model, opt, step):
        opt.zero_grad()
        x, y = batch(rank, step)
        F.mse_loss(model(x), y.cuda()).backward()
        opt.step()

    model = offloaded(0)
    opt = adamw(model.parameters())
    train(model, opt, 0)
    full = {k: v.clone() for k, v in model.state_dict().items()}

    # summon_full_params: whole parameters on the compute device (or the CPU), written back into the pinned shards.
    with FSDP.summon_full_params(model):
        for name, p in model.named_parameters():
            assert p.is_cuda and p.shape == full[name].shape, f"rank {rank}: summoned {name}: {p.device} {p.shape}"
            assert_close(p, full[name], f"rank {rank}: summoned {name}", **FP32)
            with torch.no_grad():
                p.mul_(2.0)
    for name, p in model.named_parameters():
        _assert_host(p, f"rank {rank}: {name} after summon")
    with FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False):
        for name, p in model.named_parameters():
            assert p.device.type == "cpu", f"rank {rank}: summoned {name} with offload_to_cpu is on {p.device}"
            assert_close(p, full[name].cpu() * 2.0, f"rank {rank}: written back {name}", **FP32)
            with torch.no_grad():
                p.zero_()  # writeback=False: dropped
    with FSDP.summon_full_params(model):
        for name, p in model.named_parameters():
            assert_close(p, full[name] * 2.0, f"rank {rank}: {name} after writeback=False", **FP32)
    with FSDP.summon_full_params(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(full[name])

    # Full model and optimizer state dicts into a differently initialised offloaded model, then both train on.
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)):
        state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    for key, value in state.items():
        assert value.device.type == "cpu", f"rank {rank}: offload_to_cpu state dict value {key} on {value.device}"
        assert_close(value, full[key].cpu(), f"rank {rank}: state dict {key}", **FP32)
    other = offloaded(1)
    other_opt = adamw(other.parameters())
    other.load_state_dict(state)
    FSDP.optim_state_dict_to_load(other, other_opt, optim_state, load_directly=True)
    for (name, p), q in zip(other.named_parameters(), model.parameters()):
        _assert_host(p, f"rank {rank}: loaded {name}")
        assert torch.equal(p, q), f"rank {rank}: loaded {name} differs from the saved model's piece"
        for key, value in other_opt.state[p].items():
            if isinstance(value, torch.Tensor):
                assert value.device.type == "cpu", f"rank {rank}: loaded optimizer state {key} on {value.device}"
                assert_close(value, opt.state[q][key], f"rank {rank}: loaded optimizer state {name}.{key}", **FP32)
    for step in (1, 2):
        train(model, opt, step)
        train(other, other_opt, step)
    for (name, p), q in zip(other.named_parameters(), model.parameters()):
        assert_close(p, q, f"rank {rank}: {name} after training on from the checkpoint", **FP32)
    return True


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("world", [1, 2], ids=["nccl_world1", "host_staged_world2"])
def test_offloaded_summon_and_state_dict_round_trips(ranks, world):
    assert ranks.run(_round_trips, world, timeout=300) == [True] * world


# --- without CUDA: refused by name (these run on any machine) ------------------------------------------------

def _auto_picks_offload(rank: int, world: int) -> tuple[str, bool, bool]:
    import shardkit
    from shardkit.estimate import model_states

    torch.cuda.set_device(0)
    module = net(depth=3).cuda()
    psi = sum(p.numel() for p in module.parameters())
    states = model_states(psi, world, "fp32", "adam", master_weights=False)
    budget = (states["zero3"].total_gb + states["zero3_offload"].total_gb) / 2  # only offload fits
    model, optimizer = shardkit.auto(module, torch.optim.AdamW, memory_budget_gb=budget, lr=1e-3)
    x, y = batch(rank, step=0)
    F.mse_loss(model(x.cuda()), y.cuda()).backward()
    optimizer.step()
    on_host = all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return model.shardkit_plan.strategy, on_host, finite


@cuda
@pytest.mark.cuda
def test_auto_wraps_with_offload_when_only_offload_fits(ranks):
    for strategy, on_host, finite in ranks.run(_auto_picks_offload, 2, timeout=240):
        assert strategy == "zero3_offload"
        assert on_host, "shardkit.auto chose offload but the parameters are not in pinned host memory"
        assert finite


def _model_on_another_gpu(rank: int, world: int) -> str:
    import shardkit

    module = net(depth=1).to("cuda:0")
    return error_of(lambda: shardkit.FullyShardedDataParallel(module, device_id=torch.device("cuda", 1)),
                    ValueError, rank)


@cuda
@pytest.mark.cuda
def test_a_model_on_another_gpu_than_device_id_is_refused(ranks):
    # Needs one GPU only: cuda:1 is named, never touched.
    message = ranks.run(_model_on_another_gpu, 1, timeout=120)[0]
    assert message.startswith("shardkit FSDP (rank 0): device_id=device(type='cuda', index=1) (cuda:1), but "
                              "parameter '"), message
    assert "' is on cuda:0; pass the module's own device as device_id" in message, message


def _expected_refusal(rank: int) -> str:
    reasons = ["torch.cuda.is_available() is False"]
    if not _C.with_cuda:
        reasons.append("this shardkit was built without CUDA (build it with SHARDKIT_CUDA=1)")
    return (f"shardkit FSDP (rank {rank}): cpu_offload=CPUOffload(offload_params=True) needs a CUDA device (the "
            "shards live in pinned host memory, the units compute on the GPU), but " + " and ".join(reasons))


def _refused_without_cuda(rank: int, world: int) -> tuple[str, bool]:
    import shardkit
    from shardkit.fsdp import CPUOffload

    torch.cuda.is_available = lambda: False  # this rank's process only: what a machine without a GPU reports
    module = net()
    before = {name: p for name, p in module.named_parameters()}
    message = error_of(lambda: shardkit.FullyShardedDataParallel(module, cpu_offload=CPUOffload(offload_params=True)),
                       RuntimeError, rank)
    untouched = all(p is before[name] and not p.is_pinned() for name, p in module.named_parameters())
    dist.barrier()  # the refusal issued no collective: the group still works
    return message, untouched


@pytest.mark.timeout(120)
def test_offload_params_without_cuda_is_refused_by_name(ranks):
    for rank, (message, untouched) in enumerate(ranks.run(_refused_without_cuda, 2, timeout=100)):
        assert message == _expected_refusal(rank), message
        assert untouched, f"rank {rank}: the refused wrapper changed the module's parameters"


@pytest.mark.skipif(_C.with_cuda, reason="the CPU build's refusal; a CUDA build checks the device instead")
def test_cpu_build_handle_refuses_a_compute_device():
    with pytest.raises(RuntimeError) as raised:
        _C.FlatParamHandle([torch.zeros(3)], None, None, label="unit", compute_device=torch.device("cuda", 0))
    assert str(raised.value).splitlines()[0] == (
        "shardkit FSDP (rank 0, unit 'unit') cpu_offload: offload_params=True needs a CUDA device to compute on "
        "(cuda:0 was asked for), but this shardkit was built without CUDA (build it with SHARDKIT_CUDA=1)")

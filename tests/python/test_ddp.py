"""shardkit.DistributedDataParallel against torch's DistributedDataParallel: same training, same numbers.

Approach: on every rank, one seeded module is deep-copied into torch's DDP and into shardkit's DDP (same constructor
arguments; torch's on a gloo group, shardkit's on the default "shardkit" process group), each gets its own
optimizer, and both are trained in lock step on the same per-rank batches (rank r's batch is seeded by r and the
step, and has 4 + r rows, so ranks differ in data and in batch size). After every backward the gradients are
compared (values, and which ones are None); after every optimizer step the parameters and buffers (fp32: rtol 1e-5,
atol 1e-6). torch's DDP is the oracle, so every test can fail: a gradient that is not averaged, averaged twice,
averaged under no_sync, left unsynchronised for an unused parameter, a buffer not broadcast, a comm hook that is
ignored or that sees the wrong bucket, all show up as a mismatch at the first step where they matter. Where a test
also asserts something about torch's own behaviour (which parameters keep grad None, where torch raises), that is a
self-check of the oracle.

The error tests check that mistakes are reported, clearly and in bounded time: mismatched parameter
shapes at construction, an unused parameter without find_unused_parameters (torch raises at the next
forward with "Expected to have finished reduction in the prior iteration ... find_unused_parameters=True"),
and a rank that never runs backward (the process group timeout applies; no hang).

Models are tiny (a few Linear layers, < 1,500 parameters) and runs are <= 6 steps: four ranks share two
cores in CI.
"""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support.ddp_cases import (
    OPTIMIZERS,
    Pair,
    assert_close,
    assert_modules_match,
    batch,
    bn_net,
    loss_fn,
    mlp,
    sgd,
    shardkit_ddp,
    two_heads,
)

WORLDS = [2, 3]
# 104-byte buckets: torch's rebuilt layout (after the first backward) is 5 buckets for mlp()'s 6 parameters.
TINY_BUCKET_MB = 0.0001


def _flat_params(module: nn.Module) -> list[float]:
    """The parameters as plain floats (exact for fp32; tensors do not survive the trip back from a rank)."""
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def _assert_ranks_identical(flats: list[list[float]]) -> None:
    """DDP keeps every rank's replica bitwise identical."""
    for rank, flat in enumerate(flats[1:], start=1):
        assert flat == flats[0], f"rank {rank}'s parameters differ from rank 0's"


# --- 1. plain MLP ---------------------------------------------------------------------------------------

def _mlp_parity(rank, world, optimizer):
    module = mlp(seed=100 + rank)  # replicas differ: construction must broadcast rank 0's state
    pair = Pair(module, OPTIMIZERS[optimizer])
    assert_modules_match(mlp(seed=100), pair.ref.module, "torch DDP after construction vs rank 0's init")
    pair.check(f"rank {rank} after construction")
    for step in range(5):
        pair.step(rank, step)
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world", WORLDS)
def test_mlp_matches_torch_ddp(ranks, world, optimizer):
    _assert_ranks_identical(ranks.run(_mlp_parity, world, optimizer, timeout=60))


# --- 2. BatchNorm buffers ---------------------------------------------------------------------------------

def _batchnorm_buffers(rank, world):
    pair = Pair(bn_net(seed=0), sgd, broadcast_buffers=True)
    for step in range(5):
        pair.step(rank, step)  # compares running_mean / running_var / num_batches_tracked too
    trained = {name: b.clone() for name, b in pair.ref.module.named_buffers()}
    # Evaluation after training: torch broadcasts rank 0's buffers at this forward too (the previous forward
    # was a training one), then normalises with the running statistics.
    pair.ref.eval()
    pair.dut.eval()
    x, _ = batch(rank, 99)
    with torch.no_grad():
        want, got = pair.ref(x), pair.dut(x)
    assert_close(got, want, f"rank {rank} eval output")
    pair.check(f"rank {rank} after the eval forward")
    return trained["1.running_mean"].tolist(), pair.dut.module[1].running_mean.tolist()


@pytest.mark.parametrize("world", WORLDS)
def test_batchnorm_buffers_broadcast_like_torch(ranks, world):
    values = ranks.run(_batchnorm_buffers, world, timeout=60)
    # Self-check: each rank's local update makes the buffers differ between ranks after a step, so a
    # missing broadcast would be seen ...
    assert values[0][0] != values[1][0]
    # ... and after the broadcast at the next forward every rank holds rank 0's.
    for rank in range(1, world):
        assert values[rank][1] == values[0][1], f"rank {rank}'s running_mean is not rank 0's"


# --- 3. unused parameters with find_unused_parameters=True ---------------------------------------------

# Whether rank r uses head_b at each step: everyone, no one, only rank 0, no one, everyone, all but rank 0.
_USES_HEAD_B = [lambda r: True, lambda r: False, lambda r: r == 0, lambda r: False, lambda r: True,
                lambda r: r != 0]


def _unused_branch(rank, world):
    pair = Pair(two_heads(seed=0), sgd, find_unused_parameters=True)
    for step, uses in enumerate(_USES_HEAD_B):
        before = [{n: p.detach().clone() for n, p in m.module.head_b.named_parameters()} for m in (pair.ref, pair.dut)]
        pair.step(rank, step, use_b=uses(rank))
        if not any(uses(r) for r in range(world)):
            # No rank used head_b: it gets no gradient and the optimizer leaves it alone (torch and shardkit).
            for model, old in zip((pair.ref, pair.dut), before):
                for name, p in model.module.head_b.named_parameters():
                    assert p.grad is None, f"step {step}: head_b.{name}.grad was set in {type(model).__module__}"
                    assert torch.equal(p.detach(), old[name]), f"step {step}: unused head_b.{name} changed"
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("world", WORLDS)
def test_unused_branch_with_find_unused_parameters(ranks, world):
    _assert_ranks_identical(ranks.run(_unused_branch, world, timeout=60))


# --- 4. no_sync gradient accumulation -------------------------------------------------------------------

def _no_sync_accumulation(rank, world):
    module = mlp(seed=0)
    pair = Pair(module, sgd)
    ref64 = copy.deepcopy(module).double()  # one process, all ranks' micro-batches in one float64 batch
    opt64 = sgd(ref64.parameters())
    for step in range(3):
        pair.ref_opt.zero_grad(set_to_none=True)
        pair.dut_opt.zero_grad(set_to_none=True)
        for micro in (0, 1):
            with pair.ref.no_sync(), pair.dut.no_sync():
                pair.backward(rank, step, micro)
            pair.check(f"rank {rank} step {step} micro-batch {micro} under no_sync", grads=True)
        pair.backward(rank, step, 2)
        pair.check(f"rank {rank} step {step} synced micro-batch", grads=True)
        pair.ref_opt.step()
        pair.dut_opt.step()
        pair.check(f"rank {rank} step {step} after optimizer step")

        opt64.zero_grad(set_to_none=True)
        losses = []
        for r in range(world):
            for micro in range(3):
                x, y = batch(r, step, micro)
                losses.append(loss_fn(ref64(x.double()), y.double()))
        (sum(losses) / world).backward()
        opt64.step()
        assert_modules_match(copy.deepcopy(ref64).float(), pair.dut.module,
                             f"rank {rank} step {step} vs float64 single-process big batch")
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("world", WORLDS)
def test_no_sync_accumulation(ranks, world):
    _assert_ranks_identical(ranks.run(_no_sync_accumulation, world, timeout=60))


# --- 5. gradient_as_bucket_view -------------------------------------------------------------------------

def _bucket_view(rank, world):
    pair = Pair(mlp(seed=0), sgd, gradient_as_bucket_view=True)
    for step in range(5):
        # set_to_none=False on odd steps: the grads are zeroed in place and must stay the bucket's views.
        pair.step(rank, step, set_to_none=step % 2 == 0)
        missing = [n for n, p in pair.dut.module.named_parameters() if p.grad is None]
        assert not missing, f"rank {rank} step {step}: no .grad for {missing}"
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("world", WORLDS)
def test_gradient_as_bucket_view(ranks, world):
    _assert_ranks_identical(ranks.run(_bucket_view, world, timeout=60))


# --- 6. many small buckets ------------------------------------------------------------------------------

def _tiny_buckets(rank, world):
    pair = Pair(mlp(seed=0), sgd, bucket_cap_mb=TINY_BUCKET_MB)
    for step in range(5):
        pair.step(rank, step)
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("world", WORLDS)
def test_many_small_buckets(ranks, world):
    _assert_ranks_identical(ranks.run(_tiny_buckets, world, timeout=60))


# --- 7. torch's own comm hooks --------------------------------------------------------------------------

def _bf16_compress_hook_for_torch_ddp(state, bucket):
    """torch's bf16_compress_hook under another name: torch's DDP refuses the hook by its ``__name__``
    unless it sees CUDA and NCCL >= 2.10 (TypeError), even though the hook itself works on CPU.
    shardkit's DDP gets the real function."""
    return default_hooks.bf16_compress_hook(state, bucket)


# name -> (state factory(the DDP's group), hook, hook for torch's DDP, rtol, atol). A None state means the
# default (shardkit) group, for torch's DDP too. The compressing hooks sum 16-bit values: gloo (the oracle's
# group) adds them in 16 bits, rank by rank, while shardkit adds in fp32 and rounds once, so an element may
# differ by a 16-bit rounding per rank, and the difference carries into later steps: three roundings are
# allowed (fp16: 3 * 2^-10 relative, bf16: 3 * 2^-7).
_TORCH_HOOKS = {
    "allreduce_state_none": (lambda group: None, default_hooks.allreduce_hook, None, 1e-5, 1e-6),
    "allreduce_state_pg": (lambda group: group, default_hooks.allreduce_hook, None, 1e-5, 1e-6),
    "fp16_compress": (lambda group: group, default_hooks.fp16_compress_hook, None, 3e-3, 1e-4),
    "bf16_compress": (lambda group: group, default_hooks.bf16_compress_hook, _bf16_compress_hook_for_torch_ddp,
                      2.4e-2, 1e-3),
}


def _torch_hook(rank, world, name):
    make_state, hook, ref_hook, rtol, atol = _TORCH_HOOKS[name]
    pair = Pair(mlp(seed=0), sgd)
    pair.register_comm_hook(make_state, hook, ref_hook=ref_hook)
    for step in range(5):
        pair.step(rank, step, rtol=rtol, atol=atol)
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("hook", list(_TORCH_HOOKS))
@pytest.mark.parametrize("world", WORLDS)
def test_torch_comm_hook(ranks, world, hook):
    _assert_ranks_identical(ranks.run(_torch_hook, world, hook, timeout=60))


def _powersgd(rank, world):
    pair = Pair(mlp(seed=0), sgd)

    def make_state(group):
        return powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)

    ref_state, dut_state = pair.register_comm_hook(make_state, powersgd.powerSGD_hook)
    for step in range(6):  # 2 plain allreduce steps, then 4 compressed ones (with error feedback, warm start)
        pair.step(rank, step)
    # Self-check that compression ran, the same way on both: one iteration per step (bucket.is_last()),
    # the same buckets (bucket.index()) keeping P/Q and error-feedback memory.
    assert ref_state.iter == dut_state.iter == 6, (ref_state.iter, dut_state.iter)
    assert ref_state.p_memory_dict, "torch's PowerSGD never compressed: the test would prove nothing"
    assert sorted(dut_state.p_memory_dict) == sorted(ref_state.p_memory_dict)
    assert sorted(dut_state.error_dict) == sorted(ref_state.error_dict)
    return _flat_params(pair.dut.module)


def test_torch_powersgd_hook(ranks):
    _assert_ranks_identical(ranks.run(_powersgd, 2, timeout=60))


# --- 8. a custom Python hook ----------------------------------------------------------------------------

def _doubled_mean_hook(state, bucket):
    """Mean over ranks, times two (on state["group"]); records what it saw of the bucket when ``state`` has
    "calls"."""
    if "calls" in state:
        names = state["names"]
        grads, params = bucket.gradients(), bucket.parameters()
        state["calls"].append({
            "index": bucket.index(),
            "is_last": bucket.is_last(),
            "params": [names[id(p)] for p in params],
            "grad_shapes": [tuple(g.shape) for g in grads],
            "param_shapes": [tuple(p.shape) for p in params],
            "buffer_numel": bucket.buffer().numel(),
            "buffer_is_grads": torch.equal(torch.cat([g.flatten() for g in grads]), bucket.buffer()),
        })
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, group=state["group"], async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0] * 2)


def _custom_hook(rank, world, bucket_cap_mb):
    module = mlp(seed=0)
    pair = Pair(module, sgd, bucket_cap_mb=bucket_cap_mb)
    states = []

    def make_state(group):
        model = (pair.ref, pair.dut)[len(states)]
        states.append({"names": {id(p): n for n, p in model.module.named_parameters()}, "calls": [],
                       "group": group})
        return states[-1]

    pair.register_comm_hook(make_state, _doubled_mean_hook)
    steps = 4
    calls_per_step = {"torch": [], "shardkit": []}

    def end_of_step():
        for who, state in zip(calls_per_step, states):
            calls_per_step[who].append(state["calls"])
            state["calls"] = []

    ref64 = copy.deepcopy(module).double()
    for r in range(world):
        x, y = batch(r, 0)
        (loss_fn(ref64(x.double()), y.double()) / world).backward()
    pair.backward(rank, 0)
    pair.check(f"rank {rank} step 0 after backward", grads=True)
    for name, p in pair.dut.module.named_parameters():
        want = 2 * dict(ref64.named_parameters())[name].grad.float()
        assert_close(p.grad, want, f"rank {rank}: {name}.grad vs twice the float64 mean gradient")
    pair.ref_opt.step()
    pair.dut_opt.step()
    pair.check(f"rank {rank} step 0 after optimizer step")
    end_of_step()
    for step in range(1, steps):
        pair.step(rank, step)
        end_of_step()

    all_names = sorted(states[1]["names"].values())
    for step, calls in enumerate(calls_per_step["shardkit"]):  # GradBucket semantics, whatever the layout
        where = f"rank {rank} step {step}: {calls}"
        n = len(calls)
        assert sorted(c["index"] for c in calls) == list(range(n)), f"bucket indices are not 0..n-1: {where}"
        assert [c["index"] for c in calls if c["is_last"]] == [n - 1], f"is_last() is not only the last: {where}"
        assert sorted(name for c in calls for name in c["params"]) == all_names, f"not every param once: {where}"
        for c in calls:
            assert c["grad_shapes"] == c["param_shapes"], where
            assert c["buffer_numel"] == sum(torch.Size(s).numel() for s in c["grad_shapes"]), where
            assert c["buffer_is_grads"], f"bucket.gradients() are not bucket.buffer()'s contents: {where}"
    if bucket_cap_mb is None:
        # Once torch has rebuilt its buckets in gradient-ready order (after the first backward), the layout
        # a hook sees must be torch's: PowerSGD's per-bucket state and random Q's depend on it.
        for step in range(1, steps):
            assert calls_per_step["shardkit"][step] == calls_per_step["torch"][step], (
                f"rank {rank} step {step}: buckets differ from torch's\nshardkit: {calls_per_step['shardkit'][step]}"
                f"\ntorch:    {calls_per_step['torch'][step]}")
    else:
        assert max(len(calls) for calls in calls_per_step["shardkit"]) > 3, (
            f"bucket_cap_mb={bucket_cap_mb} should give many buckets: {calls_per_step['shardkit']}")
    return _flat_params(pair.dut.module)


@pytest.mark.parametrize("bucket_cap_mb", [None, TINY_BUCKET_MB])
@pytest.mark.parametrize("world", WORLDS)
def test_custom_python_hook(ranks, world, bucket_cap_mb):
    _assert_ranks_identical(ranks.run(_custom_hook, world, bucket_cap_mb, timeout=60))


# --- 9. errors ------------------------------------------------------------------------------------------

def _names_rank(message: str, rank: int) -> bool:
    return re.search(rf"\branks?\b[^\n]{{0,24}}?\b{rank}\b", message, re.IGNORECASE) is not None


def _mismatched_shapes(rank, world):
    module = mlp(seed=0)
    if rank == world - 1:  # same number of elements, transposed shape: only 0.weight differs
        module[0].weight = nn.Parameter(torch.zeros(module[0].weight.shape[::-1]))
    start = time.monotonic()
    try:
        shardkit_ddp()(module)
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return None


@pytest.mark.parametrize("world", WORLDS)
def test_mismatched_parameter_shapes_are_refused(ranks, world):
    results = ranks.run(_mismatched_shapes, world, timeout=60)
    bad = world - 1
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: shardkit DDP accepted replicas whose 0.weight shapes differ"
        elapsed, message = result
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f} s to report the mismatch"
        assert "0.weight" in message, f"rank {rank}: the message does not name the parameter: {message}"
        assert _names_rank(message, bad) and _names_rank(message, 0), (
            f"rank {rank}: the message does not name ranks 0 and {bad}: {message}")


_UNUSED_PHRASES = ("Expected to have finished reduction in the prior iteration", "find_unused_parameters=True")


def _unused_without_flag(rank, world):
    outcomes = {}
    for name, cls in (("torch", TorchDDP), ("shardkit", shardkit_ddp())):
        model = cls(two_heads(seed=0))  # find_unused_parameters=False
        outcomes[name] = None
        for step, use_b in enumerate([True, False, True]):  # head_b gets no gradient at step 1
            x, y = batch(rank, step)
            start = time.monotonic()
            try:
                out = model(x, use_b=use_b)
            except RuntimeError as error:
                outcomes[name] = (step, "forward", time.monotonic() - start, str(error))
                break
            start = time.monotonic()
            try:
                loss_fn(out, y).backward()
            except RuntimeError as error:
                outcomes[name] = (step, "backward", time.monotonic() - start, str(error))
                break
    return outcomes


def test_unused_parameter_without_find_unused_parameters(ranks):
    for rank, outcomes in enumerate(ranks.run(_unused_without_flag, 2, timeout=60)):
        # torch: the backward of step 1 returns; the forward of step 2 raises, on every rank, at once.
        assert outcomes["torch"] is not None and outcomes["torch"][:2] == (2, "forward"), outcomes["torch"]
        assert all(p in outcomes["torch"][3] for p in _UNUSED_PHRASES), outcomes["torch"][3]
        got = outcomes["shardkit"]
        assert got is not None, f"rank {rank}: shardkit DDP trained on with a parameter that got no gradient"
        step, where, elapsed, message = got
        # shardkit reports it one step earlier than torch, in the backward where it happened, by name.
        assert (step, where) == (1, "backward"), f"rank {rank}: raised at step {step} {where}, expected step 1 backward"
        assert elapsed < 5, f"rank {rank}: took {elapsed:.1f} s to raise"
        for phrase in ("[head_b.weight, head_b.bias]", "find_unused_parameters=True"):
            assert phrase in message, f"rank {rank}: {phrase!r} not in: {message}"


def _skip_backward(rank, world):
    model = shardkit_ddp()(mlp(seed=0))
    x, y = batch(rank, 0)
    out = model(x)
    if rank == 1:  # never runs backward, and stays alive well past the process group timeout
        time.sleep(10)
        return "skipped"
    start = time.monotonic()
    try:
        loss_fn(out, y).backward()
        loss_fn(model(x), y).backward()  # the error may also surface at the next synchronisation point
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return None


def test_rank_skipping_backward_times_out(ranks):
    results = ranks.run(_skip_backward, 2, timeout=40, pg_timeout=3)
    assert results[1] == "skipped"
    assert results[0] is not None, "rank 0 finished two backwards without its peer"
    elapsed, message = results[0]
    assert elapsed < 8, f"rank 0 took {elapsed:.1f} s to fail with a 3 s process group timeout: {message}"


# --- 10. comm hook registration rules -------------------------------------------------------------------

_ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once"


def _hook_registration(rank, world):
    for cls in (TorchDDP, shardkit_ddp()):
        model = cls(mlp(seed=0))
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        with pytest.raises(RuntimeError, match=_ONCE):
            model.register_comm_hook(None, default_hooks.allreduce_hook)
    # torch accepts a hook registered after the first backward and uses it from the next backward on.
    pair = Pair(mlp(seed=0), sgd)
    pair.step(rank, 0)
    pair.register_comm_hook(lambda group: {"group": group}, _doubled_mean_hook)
    for step in range(1, 4):
        pair.step(rank, step)
    return _flat_params(pair.dut.module)


def test_comm_hook_registration_rules(ranks):
    _assert_ranks_identical(ranks.run(_hook_registration, 2, timeout=60))

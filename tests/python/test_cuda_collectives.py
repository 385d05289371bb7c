"""Every collective of the shardkit backend on CUDA tensors (marked ``cuda``: run by ``make gpu-test``).

World 1 runs on NCCL (csrc/comm/nccl/nccl_engine.h). Two ranks share the one GPU of the test machine, which NCCL
refuses, so world 2 runs through the host-staged route (device -> host -> shared memory -> device;
csrc/comm/nccl/host_staged_engine.h), and says so once. Not covered on a one-GPU machine: NCCL between ranks
(the ncclSend/ncclRecv groups of gather, scatter and all-to-all run only their self-copies at world 1); that needs
a machine with two GPUs, one rank on each. Inputs are built on the CPU
from the same seeds as tests/python/support/collective_cases.py and moved to the GPU; each result is compared with
the CPU reference, exactly (float64/integer) or within the reduction's rounding. The errors CUDA adds are
checked by their messages: tensors on two devices in one collective, point-to-point of CUDA tensors.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from shardkit import _C
from support.collective_cases import assert_close, make_input, reference_reduce

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (_C.with_cuda and torch.cuda.is_available()),
                       reason="needs a CUDA GPU and shardkit's CUDA build (make gpu-test)"),
]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")


def _every_collective(rank, world):
    torch.cuda.set_device(0)
    for dtype in DTYPES:
        for n in (0, 7, 300_001):
            inputs = [make_input(r, n, dtype, salt=5) for r in range(world)]
            mine = _cuda(inputs[rank])
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                t = mine.clone()
                dist.all_reduce(t, op=op)
                assert t.is_cuda
                assert_close(t.cpu(), reference_reduce(inputs, op), world, f"all_reduce {dtype} {op} n={n}")
            if dtype.is_floating_point:
                t = mine.clone()
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                assert_close(t.cpu(), reference_reduce(inputs, dist.ReduceOp.AVG), world, f"all_reduce avg {dtype}")
            t = mine.clone()
            dist.broadcast(t, src=world - 1)
            assert torch.equal(t.cpu(), inputs[world - 1]), f"broadcast {dtype} n={n}"
            t = mine.clone()
            dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
            assert_close(t.cpu(), reference_reduce(inputs, dist.ReduceOp.SUM) if rank == 0 else inputs[rank], world,
                         f"reduce {dtype} n={n}")
            outs = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(outs, mine)
            assert all(torch.equal(o.cpu(), i) for o, i in zip(outs, inputs)), f"all_gather {dtype} n={n}"
            flat = torch.empty(world * n, dtype=dtype, device="cuda")
            dist.all_gather_into_tensor(flat, mine)
            assert torch.equal(flat.cpu(), torch.cat(inputs)), f"all_gather_into_tensor {dtype} n={n}"
            gather_list = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
            dist.gather(mine, gather_list, dst=0)
            if rank == 0:
                assert all(torch.equal(g.cpu(), i) for g, i in zip(gather_list, inputs)), f"gather {dtype} n={n}"
            received = torch.empty_like(mine)
            scatter_list = [_cuda(make_input(r, n, dtype, salt=9)) for r in range(world)] if rank == 0 else None
            dist.scatter(received, scatter_list, src=0)
            assert torch.equal(received.cpu(), make_input(rank, n, dtype, salt=9)), f"scatter {dtype} n={n}"
            blocks = [[make_input(r * world + b, n, dtype, salt=2) for b in range(world)] for r in range(world)]
            out = torch.empty(n, dtype=dtype, device="cuda")
            dist.reduce_scatter_tensor(out, _cuda(torch.cat(blocks[rank])))
            assert_close(out.cpu(), reference_reduce([blocks[r][rank] for r in range(world)], dist.ReduceOp.SUM),
                         world, f"reduce_scatter_tensor {dtype} n={n}")
            out = torch.empty(n, dtype=dtype, device="cuda")
            dist.reduce_scatter(out, [_cuda(b) for b in blocks[rank]])
            assert_close(out.cpu(), reference_reduce([blocks[r][rank] for r in range(world)], dist.ReduceOp.SUM),
                         world, f"reduce_scatter {dtype} n={n}")
            send = [make_input(rank * 10 + j, 3 * (j + 1), dtype, salt=1) for j in range(world)]
            expect = [make_input(j * 10 + rank, 3 * (rank + 1), dtype, salt=1) for j in range(world)]
            got = torch.empty(sum(e.numel() for e in expect), dtype=dtype, device="cuda")
            dist.all_to_all_single(got, _cuda(torch.cat(send)), [e.numel() for e in expect], [s.numel() for s in send])
            assert torch.equal(got.cpu(), torch.cat(expect)), f"all_to_all_single {dtype}"
            outs = [torch.empty(e.numel(), dtype=dtype, device="cuda") for e in expect]
            dist.all_to_all(outs, [_cuda(s) for s in send])
            assert all(torch.equal(o.cpu(), e) for o, e in zip(outs, expect)), f"all_to_all {dtype}"
            if not dtype.is_floating_point:  # a bitwise reduction: NCCL has none, the op goes through host memory
                t = mine.clone()
                dist.all_reduce(t, op=dist.ReduceOp.BOR)
                assert_close(t.cpu(), reference_reduce(inputs, dist.ReduceOp.BOR), world, f"all_reduce BOR n={n}")
    # bool (OR and AND are NCCL's MAX and MIN), coalesced forms (one flat op)
    flags = [make_input(r, 33, torch.bool, salt=4) for r in range(world)]
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
        t = _cuda(flags[rank])
        dist.all_reduce(t, op=op)
        assert torch.equal(t.cpu(), reference_reduce(flags, op)), f"all_reduce bool {op}"
    parts = [make_input(rank, 5, torch.float32, salt=6), make_input(rank, 9, torch.float32, salt=7)]
    tensors = [_cuda(p) for p in parts]
    dist.all_reduce_coalesced(tensors)
    for i, t in enumerate(tensors):
        want = reference_reduce([make_input(r, len(parts[i]), torch.float32, salt=6 + i) for r in range(world)],
                                dist.ReduceOp.SUM)
        assert_close(t.cpu(), want, world, f"all_reduce_coalesced tensor {i}")
    # torch's all_gather_coalesced takes one dtype (it refuses mixed ones before the backend sees them)
    shaped = [_cuda(make_input(rank, 4, torch.bfloat16, salt=8)), _cuda(make_input(rank, 6, torch.bfloat16, salt=9))]
    out_lists = [[torch.empty_like(m) for m in shaped] for _ in range(world)]
    dist.all_gather_coalesced(out_lists, shaped)
    for r in range(world):
        for i, n in enumerate((4, 6)):
            want = make_input(r, n, torch.bfloat16, salt=8 + i)
            assert torch.equal(out_lists[r][i].cpu(), want), f"all_gather_coalesced rank {r} tensor {i}"
    dist.barrier()
    # An async op: wait() then use, on a side stream the op must also wait for.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        assert torch.equal(t.cpu(), torch.full((1 << 20,), float(world * (world + 1) // 2)))
    return True


def test_every_collective_on_cuda_tensors_two_ranks_one_gpu(ranks):
    assert ranks.run(_every_collective, 2, timeout=300) == [True, True]


def test_every_collective_on_nccl_world_1(ranks):
    assert ranks.run(_every_collective, 1, timeout=300) == [True]


def _which_route(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    before = backend.cuda_route()
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((4,), float(world)))
    return before, backend.cuda_route()


def test_the_route_says_nccl_or_why_not(ranks):
    before, shared = ranks.run(_which_route, 2, timeout=120)[0]
    assert before == "undecided: no CUDA collective has run on this group yet"
    assert shared.startswith("host shared memory: ranks 0 and 1 of the group share GPU-"), shared
    assert shared.endswith("and NCCL needs one GPU per rank"), shared
    assert ranks.run(_which_route, 1, timeout=120)[0][1] == "nccl"


# Cycles of torch.cuda._sleep that keep an H100 (1.98 GHz boost) busy for about a second or more: long enough to
# tell "the host did not wait" from "the op was already done", whatever the clock.
_A_SECOND_OF_CYCLES = 2_000_000_000


def _wait_orders_the_stream_not_the_host(rank, world):
    t = torch.ones(1 << 16, device="cuda")
    dist.all_reduce(t)  # sets the communicator up: not what is looked at here
    torch.cuda.synchronize()
    torch.cuda._sleep(_A_SECOND_OF_CYCLES)  # the caller's stream is busy; the op must wait for it on the device
    t.fill_(2.0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()  # orders the current stream after the op and returns: the op cannot have run yet
    still_running = not work.is_completed()
    doubled = t * 1.0  # queued on the current stream after the op
    assert torch.equal(doubled.cpu(), torch.full_like(doubled.cpu(), 2.0 * world))
    deadline = 100
    while not work.is_completed() and deadline > 0:  # the watchdog marks it done once the device is
        torch.cuda.synchronize()
        deadline -= 1
        time.sleep(0.05)
    return still_running, work.is_completed(), work.is_success()


def test_wait_orders_the_callers_stream_not_the_host(ranks):
    still_running, completed, success = ranks.run(_wait_orders_the_stream_not_the_host, 1, timeout=120)[0]
    assert still_running, "Work.wait() blocked the host until the op was done on the device"
    assert completed and success


def _a_stalled_collective(rank, world):
    from datetime import timedelta

    dist.all_reduce(torch.ones(1, device="cuda"))  # NCCL's first set-up in this process, outside the short timeout
    group = dist.new_group(backend="shardkit", timeout=timedelta(seconds=5))
    t = torch.ones(8, device="cuda")
    dist.all_reduce(t, group=group)  # this group's communicator is set up
    torch.cuda.synchronize()
    torch.cuda._sleep(15 * _A_SECOND_OF_CYCLES)  # the op cannot run within the group's 5 s timeout
    issued = time.monotonic()
    work = dist.all_reduce(t, group=group, async_op=True)
    while not work.is_completed() and time.monotonic() - issued < 60:  # past 60 s: a hang
        time.sleep(0.05)
    failed_after = time.monotonic() - issued
    completed = work.is_completed()
    try:
        work.wait()
        first = ""
    except RuntimeError as error:
        first = str(error)
    try:
        dist.all_reduce(torch.ones(8, device="cuda"), group=group)
        later = ""
    except RuntimeError as error:
        later = str(error)
    torch.cuda.synchronize()
    return completed, failed_after, first, later


def test_the_watchdog_fails_a_collective_that_misses_its_deadline(ranks):
    completed, failed_after, first, later = ranks.run(_a_stalled_collective, 1, timeout=180)[0]
    assert completed, "the stalled op was never failed: a hang"
    # Failed at its deadline (5 s), not when the device freed up (15 s): the watchdog reports before it aborts.
    assert failed_after < 12, f"failed after {failed_after:.1f} s"
    assert re.search(r"shardkit allreduce #(\d+) \(rank 0\): the collective did not complete on the device within "
                     r"5000 ms \(a rank did not join it, or a GPU stalled\); the NCCL communicator was aborted",
                     first), first
    seq = re.search(r"allreduce #(\d+)", first).group(1)
    assert f"the NCCL communicator failed earlier: allreduce #{seq}: the collective did not complete" in later, later

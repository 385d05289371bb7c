"""Every collective of the shardkit backend on CUDA tensors (marked ``cuda``: run by ``make gpu-test``).

World 1 runs on NCCL (csrc/comm/nccl/nccl_engine.h). Two ranks share the one GPU of the test machine, which NCCL
refuses, so world 2 runs through the host-staged route (device -> host -> shared memory -> device;
csrc/comm/nccl/host_staged_engine.h), and says so once. Not covered on a one-GPU machine: NCCL between ranks
(the ncclSend/ncclRecv groups of gather, scatter and all-to-all run only their self-copies at world 1); that needs
a machine with two GPUs, one rank on each. Inputs are built on the CPU
from the same seeds as tests/python/collective_cases.py and moved to the GPU; each result is compared with
the CPU reference, exactly (float64/integer) or within the reduction's rounding. The errors CUDA adds are
checked by their messages: tensors on two devices in one collective, point-to-point of CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collective_cases import assert_close, make_input, reference_reduce
from shardkit import _C

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
    # bool (OR and AND are NCCL's MAX and MIN), coalesced forms (one flat op; mixed dtypes as bytes)
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
    mixed = [_cuda(make_input(rank, 4, torch.int64, salt=8)), _cuda(make_input(rank, 6, torch.bfloat16, salt=8))]
    out_lists = [[torch.empty_like(m) for m in mixed] for _ in range(world)]
    dist.all_gather_coalesced(out_lists, mixed)
    for r in range(world):
        assert torch.equal(out_lists[r][0].cpu(), make_input(r, 4, torch.int64, salt=8)), f"all_gather_coalesced {r}"
        assert torch.equal(out_lists[r][1].cpu(), make_input(r, 6, torch.bfloat16, salt=8)), f"all_gather_coalesced {r}"
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

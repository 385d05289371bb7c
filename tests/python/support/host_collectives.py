"""Collectives across hosts checked against exact or float64 answers, run by the ranks of test_multi_host (simulated
hosts) and of test_hostbed (namespace hosts over shaped links: hosts_collectives_rank.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.backend import inter_host_scheme
from support.collective_cases import assert_close, make_input, reference_reduce


def every_collective(rank, world):
    """Every collective (all_reduce per dtype and op, small and past the rails' threshold; broadcast from every root;
    barrier, all_gather, reduce_scatter_tensor, all_to_all_single, all_gather_object) against its exact answer."""
    R = dist.ReduceOp
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ((R.SUM, R.AVG, R.MAX) if dtype.is_floating_point else (R.SUM, R.MIN, R.BXOR)):
            for n in (1, 300_001):
                inputs = [make_input(r, n, dtype, salt=int(op)) for r in range(world)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                expected = reference_reduce(inputs, op)
                if dtype == torch.bfloat16:  # each host's partial sum is rounded to bf16 before the next step
                    torch.testing.assert_close(t, expected, rtol=0.02, atol=0.05)
                else:
                    assert_close(t, expected, world, f"all_reduce {dtype} {op} n={n}")
        for root in range(world):
            t = make_input(rank, 1000, dtype, salt=root)
            dist.broadcast(t, src=root)
            assert torch.equal(t, make_input(root, 1000, dtype, salt=root)), f"broadcast root {root}"
    dist.barrier()
    out = [torch.empty(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)))
    assert [o[0].item() for o in out] == [float(r) for r in range(world)]
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.float32))
    assert torch.equal(rs, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * world)
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.full((world,), float(rank)))
    assert torch.equal(a2a, torch.arange(world, dtype=torch.float32))
    objs = [None] * world
    dist.all_gather_object(objs, rank)
    assert objs == list(range(world))
    return True


def large_ops(rank, world, expected_scheme):
    """The three ops rails carry, at sizes that take several pipeline pieces and counts the ranks of a host do not
    divide, against float64 references; every rank's allreduce result bitwise the same."""
    assert inter_host_scheme() == expected_scheme, inter_host_scheme()
    for dtype, n in ((torch.float32, 5_000_003), (torch.float64, 1_100_001), (torch.int32, 700_001),
                     (torch.bool, 1_000_001)):
        op = dist.ReduceOp.BXOR if dtype == torch.bool else dist.ReduceOp.SUM
        inputs = [make_input(r, n, dtype, salt=5) for r in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t, op=op)
        assert_close(t, reference_reduce(inputs, op), world, f"all_reduce {dtype} n={n}")
        everyone = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(everyone, t)
        assert all(torch.equal(e, t) for e in everyone), f"all_reduce {dtype}: ranks differ"
        block = n // world + 1  # the all-gather's and reduce-scatter's per-rank block
        mine = make_input(rank, block, dtype, salt=6)
        out = torch.empty(world * block, dtype=dtype)
        dist.all_gather_into_tensor(out, mine)
        assert torch.equal(out, torch.cat([make_input(r, block, dtype, salt=6) for r in range(world)]))
        full = [make_input(r, world * block, dtype, salt=7) for r in range(world)]
        got = torch.empty(block, dtype=dtype)
        dist.reduce_scatter_tensor(got, full[rank], op=op)
        expected = reference_reduce([f[rank * block:(rank + 1) * block] for f in full], op)
        assert_close(got, expected, world, f"reduce_scatter_tensor {dtype} n={block}")
    return True

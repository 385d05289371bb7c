"""Every collective of the "shardkit" backend against a locally computed reference (float64 or exact), in every
form (list, tensor, coalesced, async, subgroup), on one host at world sizes 1-4 and on simulated hosts
(2 x 2 ranks, interleaved, 3 uneven hosts): the hierarchical engine must give what the one-host engine gives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.collective_cases import (
    ALL_DTYPES,
    SIZES,
    TOPOLOGIES,
    assert_close,
    make_input,
    ops_for,
    reference_reduce,
    run_on,
)

EVERY_TOPOLOGY = pytest.mark.parametrize("topology", list(TOPOLOGIES))



def _hierarchical_bf16_tolerance(dtype):
    """Across hosts each host's partial result is rounded to 16 bits before the next step."""
    return {"rtol": 0.02, "atol": 0.05} if dtype in (torch.bfloat16, torch.float16) else None


def _multi_host():
    import os

    return "SHARDKIT_HOST_ID" in os.environ


def _allreduce_all_dtypes_ops_sizes(rank, world):
    checked = 0
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for n in SIZES:
                inputs = [make_input(r, n, dtype, salt=int(op)) for r in range(world)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                expected = reference_reduce(inputs, op)
                loose = _hierarchical_bf16_tolerance(dtype) if _multi_host() else None
                if loose:
                    torch.testing.assert_close(t, expected, **loose)
                else:
                    assert_close(t, expected, world, f"all_reduce {dtype} {op} n={n}")
                checked += 1
    return checked


def _rooted_and_gathering_ops(rank, world):
    for dtype in ALL_DTYPES:
        for n in (0, 5, 300_001):
            inputs = [make_input(r, n, dtype, salt=3) for r in range(world)]
            mine = inputs[rank]
            for root in range(world):
                t = mine.clone()
                dist.broadcast(t, src=root)
                assert torch.equal(t, inputs[root]), f"broadcast {dtype} n={n} root={root}"
            root = world - 1
            op = dist.ReduceOp.MAX if dtype != torch.bool else dist.ReduceOp.BOR
            t = mine.clone()
            dist.reduce(t, dst=root, op=op)
            expected = reference_reduce(inputs, op) if rank == root else mine
            assert_close(t, expected, world, f"reduce {dtype} n={n}")
            outs = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(outs, mine)
            for r in range(world):
                assert torch.equal(outs[r], inputs[r]), f"all_gather {dtype} n={n} block {r}"
            flat = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, mine)
            assert torch.equal(flat, torch.cat(inputs)), f"all_gather_into_tensor {dtype} n={n}"
            gather_list = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
            dist.gather(mine, gather_list, dst=0)
            if rank == 0:
                assert all(torch.equal(g, i) for g, i in zip(gather_list, inputs)), f"gather {dtype} n={n}"
            received = torch.empty_like(mine)
            scatter_list = [make_input(r, n, dtype, salt=9) for r in range(world)] if rank == 0 else None
            dist.scatter(received, scatter_list, src=0)
            assert torch.equal(received, make_input(rank, n, dtype, salt=9)), f"scatter {dtype} n={n}"
    return True


def _reduce_scatter_ops(rank, world):
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for n in (0, 3, 70_001):
                blocks = [[make_input(r * world + b, n, dtype, salt=int(op)) for b in range(world)]
                          for r in range(world)]
                expected = reference_reduce([blocks[r][rank] for r in range(world)], op)
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out, [b.clone() for b in blocks[rank]], op=op)
                out2 = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out2, torch.cat(blocks[rank]), op=op)
                loose = _hierarchical_bf16_tolerance(dtype) if _multi_host() else None
                for got, form in ((out, "reduce_scatter"), (out2, "reduce_scatter_tensor")):
                    if loose:
                        torch.testing.assert_close(got, expected, **loose)
                    else:
                        assert_close(got, expected, world, f"{form} {dtype} {op} n={n}")
    return True


def _alltoall_ops(rank, world):
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        # even: every rank sends 4 rows of 3 to every rank; uneven: rank r sends (r + j) % 3 * 50_000 rows to j
        for uneven in (False, True):
            def rows(src, dst):
                return ((src + dst) % 3) * 50_000 if uneven else 4
            send = [make_input(rank * 100 + j, rows(rank, j) * 3, dtype, salt=1).view(-1, 3) for j in range(world)]
            expect = [make_input(j * 100 + rank, rows(j, rank) * 3, dtype, salt=1).view(-1, 3) for j in range(world)]
            out = torch.empty(sum(e.shape[0] for e in expect), 3, dtype=dtype)
            in_splits = [s.shape[0] for s in send] if uneven else None
            out_splits = [e.shape[0] for e in expect] if uneven else None
            dist.all_to_all_single(out, torch.cat(send), out_splits, in_splits)
            assert torch.equal(out, torch.cat(expect)), f"all_to_all_single {dtype} uneven={uneven}"
            outs = [torch.empty_like(e) for e in expect]
            dist.all_to_all(outs, send)
            assert all(torch.equal(o, e) for o, e in zip(outs, expect)), f"all_to_all {dtype} uneven={uneven}"
    return True


def _objects_barrier_coalesced(rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "payload": "x" * (rank * 1000)})
    assert objs == [{"rank": r, "payload": "x" * (r * 1000)} for r in range(world)]
    lst = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0", 0]
    dist.barrier()
    tensors = [make_input(rank, n, torch.float32, salt=n) for n in (3, 0, 70_000)]
    expected = [reference_reduce([make_input(r, n, torch.float32, salt=n) for r in range(world)], dist.ReduceOp.SUM)
                for n in (3, 0, 70_000)]
    dist.distributed_c10d._get_default_group().allreduce_coalesced(tensors).wait()
    for t, e in zip(tensors, expected):
        assert_close(t, e, world, "allreduce_coalesced")
    return True


def _non_contiguous(rank, world):
    base = torch.arange(40, dtype=torch.float32).view(5, 8) * (rank + 1)
    view = base[:, ::2]  # strided view: the result must land in the view, and only there
    dist.all_reduce(view)
    total = sum(range(1, world + 1))
    expected = torch.arange(40, dtype=torch.float32).view(5, 8) * (rank + 1)
    expected[:, ::2] = torch.arange(40, dtype=torch.float32).view(5, 8)[:, ::2] * total
    assert torch.equal(base, expected)
    src = (torch.arange(12, dtype=torch.float64).view(3, 4) + 100 * rank).t()  # non-contiguous input
    outs = torch.empty(world * 12, dtype=torch.float64).view(world, 4, 3).unbind(0)
    dist.all_gather(list(outs), src)
    for r in range(world):
        assert torch.equal(outs[r], (torch.arange(12, dtype=torch.float64).view(3, 4) + 100 * r).t())
    b = torch.zeros(6, 6)[::2, 1::2]
    if rank == 0:
        b.copy_(torch.ones(3, 3) * 7)
    dist.broadcast(b, src=0)
    assert torch.equal(b, torch.ones(3, 3) * 7)
    return True


def _async_overlap(rank, world):
    a = torch.full((300_000,), float(rank))
    b = torch.full((7,), float(rank * 2))
    work_a = dist.all_reduce(a, async_op=True)
    work_b = dist.all_reduce(b, async_op=True)
    fut = work_b.get_future()
    values = fut.wait()
    assert isinstance(values, list) and values[0] is b or torch.equal(values[0], b)
    work_a.wait()
    s = sum(range(world))
    assert torch.equal(a, torch.full((300_000,), float(s)))
    assert torch.equal(b, torch.full((7,), float(2 * s)))
    chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), torch.full((3,), 2.0 * world))
    return True


def _subgroups(rank, world):
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    members = [r for r in range(world) if r % 2 == rank % 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    assert t.item() == float(sum(members))
    g = [torch.zeros(1) for _ in members]
    dist.all_gather(g, torch.tensor([float(rank)]), group=mine)
    assert [x.item() for x in g] == [float(m) for m in members]
    whole = torch.tensor([1.0])
    dist.all_reduce(whole)  # the default group still works beside the subgroups
    assert whole.item() == float(world)
    return dist.get_backend(mine)


def _point_to_point(rank, world):
    if rank == 0:
        for dst in range(1, world):
            dist.send(torch.arange(5, dtype=torch.float32) * dst, dst=dst)
        return True
    got = torch.empty(5)
    dist.recv(got, src=0)
    return torch.equal(got, torch.arange(5, dtype=torch.float32) * rank)


@EVERY_TOPOLOGY
def test_allreduce_every_dtype_op_and_size(ranks, topology):
    counts = run_on(ranks, topology, _allreduce_all_dtypes_ops_sizes)
    assert counts[0] == sum(len(ops_for(d)) for d in ALL_DTYPES) * len(SIZES)


@EVERY_TOPOLOGY
def test_broadcast_reduce_allgather_gather_scatter(ranks, topology):
    assert run_on(ranks, topology, _rooted_and_gathering_ops) == [True] * TOPOLOGIES[topology][0]


@EVERY_TOPOLOGY
def test_reduce_scatter_every_dtype_and_op(ranks, topology):
    assert run_on(ranks, topology, _reduce_scatter_ops) == [True] * TOPOLOGIES[topology][0]


@EVERY_TOPOLOGY
def test_alltoall_even_and_uneven(ranks, topology):
    assert run_on(ranks, topology, _alltoall_ops) == [True] * TOPOLOGIES[topology][0]


@pytest.mark.parametrize("topology", ["1host-w2", "1host-w3", "2x2hosts", "3hosts-uneven"])
def test_object_collectives_barrier_and_coalesced(ranks, topology):
    assert run_on(ranks, topology, _objects_barrier_coalesced) == [True] * TOPOLOGIES[topology][0]


@pytest.mark.parametrize("topology", ["1host-w1", "1host-w3", "2x2hosts-interleaved"])
def test_non_contiguous_tensors(ranks, topology):
    assert run_on(ranks, topology, _non_contiguous) == [True] * TOPOLOGIES[topology][0]


@pytest.mark.parametrize("topology", ["1host-w3", "2x2hosts", "3hosts-uneven"])
def test_two_ops_in_flight_and_futures(ranks, topology):
    assert run_on(ranks, topology, _async_overlap) == [True] * TOPOLOGIES[topology][0]


@pytest.mark.parametrize("topology", ["1host-w4", "2x2hosts", "2x2hosts-interleaved", "3hosts-uneven"])
def test_subgroups(ranks, topology):
    assert run_on(ranks, topology, _subgroups) == ["shardkit"] * 4


@pytest.mark.parametrize("topology", ["1host-w3", "2x2hosts"])
def test_send_recv(ranks, topology):
    assert run_on(ranks, topology, _point_to_point) == [True] * TOPOLOGIES[topology][0]


def _premul_sum(rank, world):
    factor = 0.25
    op = dist._make_nccl_premul_sum(factor)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, op=op)
    assert torch.equal(t, torch.full((1000,), factor * sum(range(1, world + 1))))
    out = torch.empty(10)
    dist.reduce_scatter_tensor(out, torch.full((10 * world,), float(rank + 1)), op=op)
    assert torch.equal(out, torch.full((10,), factor * sum(range(1, world + 1))))
    return True


@pytest.mark.parametrize("topology", ["1host-w2", "2x2hosts", "3hosts-uneven"])
def test_premul_sum_scales_before_summing(ranks, topology):
    assert run_on(ranks, topology, _premul_sum) == [True] * TOPOLOGIES[topology][0]


def _collective_inside_future_callback(rank, world):
    # torch's PowerSGD hook issues and waits on a collective inside a `.then()` callback, which runs on the
    # thread that completed the first future: the backend's worker. That must not deadlock.
    def second(fut):
        inner = torch.full((10,), float(rank))
        return dist.all_reduce(inner, async_op=True).get_future().wait()[0]

    first = torch.ones(300_000)
    chained = dist.all_reduce(first, async_op=True).get_future().then(second)
    behind = torch.ones(5)
    work = dist.all_reduce(behind, async_op=True)  # queued by the main thread meanwhile
    result = chained.wait()
    work.wait()
    assert torch.equal(result, torch.full((10,), float(sum(range(world)))))
    assert torch.equal(first, torch.full((300_000,), float(world)))
    assert torch.equal(behind, torch.full((5,), float(world)))
    return True


@pytest.mark.parametrize("topology", ["1host-w3", "2x2hosts"])
def test_collective_issued_from_a_future_callback(ranks, topology):
    assert run_on(ranks, topology, _collective_inside_future_callback, timeout=90) == [True] * TOPOLOGIES[topology][0]


def _all_gather_into_own_slice(rank, world):
    """ZeRO's in-place all-gather (python/shardkit/zero.py): all_gather_into_tensor whose input is this rank's
    own slice of the output, sync and async, small and chunked (S above the 1 MiB shm slot); gloo, the
    oracle, must give the same."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for backend, group in (("shardkit", None), ("gloo", dist.new_group(backend="gloo"))):
        for shard in (1, 7, 400_000):
            for dtype in (torch.float32, torch.bfloat16):
                for async_op in (False, True):
                    flat = torch.full((world * shard,), -1.0, dtype=dtype)
                    mine = flat[rank * shard:(rank + 1) * shard]
                    mine.copy_(torch.arange(shard) % 251 + 1000 * rank)
                    work = gather(flat, mine, group=group, async_op=async_op)
                    if async_op:
                        work.wait()
                    want = torch.cat([torch.arange(shard) % 251 + 1000 * r for r in range(world)]).to(dtype)
                    assert torch.equal(flat, want), f"rank {rank} {backend} S={shard} {dtype} async={async_op}"


@EVERY_TOPOLOGY
def test_all_gather_input_may_be_its_own_slice_of_the_output(ranks, topology):
    run_on(ranks, topology, _all_gather_into_own_slice)


def _direct_allreduce(rank, world):
    import shardkit

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 1024, 100_003):
            floating = (dist.ReduceOp.AVG,) if dtype.is_floating_point else ()
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) + floating:
                mine = make_input(rank, n, dtype, salt=11)
                direct, via_dist = mine.clone(), mine.clone()
                assert shardkit.all_reduce_(direct, op) is direct
                dist.all_reduce(via_dist, op)
                assert torch.equal(direct, via_dist), f"{dtype} n={n} {op}: all_reduce_ differs from dist.all_reduce"
    # In order with queued async collectives: the direct call runs after them, on every rank.
    a = torch.full((4096,), float(rank + 1))
    b = torch.full((7,), float(rank + 1))
    work = dist.all_reduce(a, async_op=True)
    shardkit.all_reduce_(b)
    work.wait()
    total = float(world * (world + 1) // 2)
    assert torch.equal(a, torch.full_like(a, total)) and torch.equal(b, torch.full_like(b, total))
    # A non-contiguous tensor, and errors as dist.all_reduce gives them.
    grid = torch.arange(12.0).reshape(3, 4).t()
    shardkit.all_reduce_(grid)
    assert torch.equal(grid, torch.arange(12.0).reshape(3, 4).t() * world)
    errors = []
    for bad in (lambda: shardkit.all_reduce_(torch.ones(3, dtype=torch.complex64)),
                lambda: shardkit.all_reduce_(torch.ones(3).to_sparse()),
                lambda: shardkit.all_reduce_(torch.ones(3), group=dist.new_group(backend="gloo"))):
        try:
            bad()
            errors.append("no error")
        except (RuntimeError, TypeError, ValueError) as error:
            errors.append(str(error).splitlines()[0])
    return errors


@EVERY_TOPOLOGY
def test_direct_all_reduce_matches_dist_all_reduce_bitwise(ranks, topology):
    for rank, errors in enumerate(run_on(ranks, topology, _direct_allreduce)):
        assert errors[0].startswith(f"shardkit allreduce (rank {rank}): "), errors
        assert errors[1] == (f"shardkit allreduce (rank {rank}): shardkit.all_reduce_ takes a dense CPU tensor, got a "
                             "sparse tensor on cpu; use torch.distributed.all_reduce for it"), errors
        assert errors[2] == ("shardkit.all_reduce_: the group's CPU backend is ProcessGroupGloo, not shardkit's; use "
                             "torch.distributed.all_reduce"), errors


def _destroyed_from_its_own_callback(rank, world):
    import gc

    def issue():  # the callback holds the only reference to the group outside torch's registry
        group = dist.new_group(backend="shardkit")
        data = torch.ones(1000)

        def destroy(future):
            dist.destroy_process_group(group)
            return future.value()

        return data, dist.all_reduce(data, group=group, async_op=True).get_future().then(destroy)

    data, future = issue()
    future.wait()
    gc.collect()
    world_data = torch.ones(3)
    dist.all_reduce(world_data)  # the world group still works
    return bool(data[0].item() == world and world_data[0].item() == world)


@pytest.mark.parametrize("topology", ["1host-w2", "2x2hosts"])
def test_a_group_destroyed_from_a_callback_on_its_own_worker_ends_cleanly(ranks, topology):
    # The last reference to the backend goes on its worker thread, which cannot join itself: the worker is detached
    # (a joinable thread destroyed would terminate the process: "terminate called without an active exception").
    assert run_on(ranks, topology, _destroyed_from_its_own_callback, timeout=90) == [True] * TOPOLOGIES[topology][0]


EXIT_WITH_WORK_IN_FLIGHT = """
import sys

import torch
import torch.distributed as dist
import shardkit  # noqa: F401

dist.init_process_group("shardkit")
for _ in range(64):  # never waited for, never destroyed: the Works alone hold these tensors
    dist.all_reduce(torch.ones(1 << 16), async_op=True)
# One write per line: two ranks share the pipe, and print("issued", rank) writes its pieces separately.
sys.stdout.write(f"issued {dist.get_rank()}\\n"); sys.stdout.flush()
"""


@pytest.mark.timeout(120)
def test_exit_with_collectives_in_flight_and_no_destroy_ends_cleanly(tmp_path):
    # torch does not require destroy_process_group(): the exit hook drains the worker while the interpreter still
    # runs (a worker dropping a tensor during finalization would abort the process at exit).
    from support.harness import run_torchrun

    script = tmp_path / "exit_in_flight.py"
    script.write_text(EXIT_WITH_WORK_IN_FLIGHT)
    for attempt in range(2):
        proc = run_torchrun(script, 2, timeout=90)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in output, f"attempt {attempt}: {output[-3000:]}"
        assert "issued 0" in output and "issued 1" in output

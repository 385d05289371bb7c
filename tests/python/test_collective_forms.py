"""The coalesced, sparse and bookkeeping forms of the collectives, on every topology: what torch's coalescing
manager (FSDP2), all_gather_coalesced, sparse allreduce, sequence numbers and monitored_barrier issue."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.collective_cases import TOPOLOGIES, make_input, reference_reduce, run_on

MULTI_RANK = [name for name, (world, _) in TOPOLOGIES.items() if world > 1]



def _coalescing_manager(rank, world):
    # As FSDP2 issues them: several all_gather_into_tensor / reduce_scatter_tensor under one manager.
    sizes = [(3, torch.float32), (70_001, torch.float32), (0, torch.bfloat16), (1000, torch.int64)]
    inputs = {n: [make_input(r, n, dtype, salt=5) for r in range(world)] for n, dtype in sizes}
    outputs = [torch.empty(world * n, dtype=dtype) for n, dtype in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for (n, _), out in zip(sizes, outputs):
            dist.all_gather_into_tensor(out, inputs[n][rank])
    cm.wait()
    for (n, dtype), out in zip(sizes, outputs):
        assert torch.equal(out, torch.cat(inputs[n])), f"coalesced all_gather_into_tensor n={n} {dtype}"

    float_sizes = [(5, torch.float64), (70_001, torch.float64), (2, torch.int32)]
    blocks = {n: [make_input(r, world * n, dtype, salt=6) for r in range(world)] for n, dtype in float_sizes}
    results = [torch.empty(n, dtype=dtype) for n, dtype in float_sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for (n, _), out in zip(float_sizes, results):
            dist.reduce_scatter_tensor(out, blocks[n][rank])
    cm.wait()
    for (n, dtype), out in zip(float_sizes, results):
        expected = reference_reduce([b.view(world, n)[rank] for b in blocks[n]], dist.ReduceOp.SUM)
        if dtype.is_floating_point:
            torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(out, expected), f"coalesced reduce_scatter_tensor n={n} {dtype}"
    return True


@pytest.mark.parametrize("topology", MULTI_RANK)
def test_coalescing_manager_all_gather_and_reduce_scatter(ranks, topology):
    assert run_on(ranks, topology, _coalescing_manager) == [True] * TOPOLOGIES[topology][0]


def _all_gather_coalesced(rank, world):
    mine = [make_input(rank, 7, torch.float64, salt=1), make_input(rank, 0, torch.float64, salt=2),
            make_input(rank, 40_000, torch.float64, salt=3).view(200, 200)]
    outputs = [[torch.empty_like(t) for t in mine] for _ in range(world)]
    dist.all_gather_coalesced(outputs, mine)
    for r in range(world):
        theirs = [make_input(r, 7, torch.float64, salt=1), make_input(r, 0, torch.float64, salt=2),
                  make_input(r, 40_000, torch.float64, salt=3).view(200, 200)]
        for got, want in zip(outputs[r], theirs):
            assert torch.equal(got, want), f"all_gather_coalesced block of rank {r}"
    return True


@pytest.mark.parametrize("topology", MULTI_RANK)
def test_all_gather_coalesced_of_several_shapes(ranks, topology):
    assert run_on(ranks, topology, _all_gather_coalesced) == [True] * TOPOLOGIES[topology][0]


def _sparse_allreduce(rank, world):
    def sparse_of(r):
        g = torch.Generator().manual_seed(r)
        nnz = 3 + 4 * r  # a different number of entries on every rank, with duplicates across ranks
        indices = torch.randint(0, 6, (2, nnz), generator=g)
        return torch.sparse_coo_tensor(indices, torch.randn(nnz, 3, generator=g, dtype=torch.float64), (6, 6, 3))

    t = sparse_of(rank)
    dist.all_reduce(t)
    expected = sum(sparse_of(r).to_dense() for r in range(world))
    torch.testing.assert_close(t.to_dense(), expected, rtol=1e-12, atol=1e-12)
    assert t.is_sparse
    with pytest.raises(RuntimeError,
                       match=r"shardkit allreduce \(rank \d\): sparse tensors support reduce op SUM only"):
        dist.all_reduce(sparse_of(rank), op=dist.ReduceOp.MAX)
    return True


@pytest.mark.parametrize("topology", ["1host-w2", "1host-w3", "2x2hosts", "3hosts-uneven"])
def test_sparse_allreduce_sums_every_rank_entries(ranks, topology):
    assert run_on(ranks, topology, _sparse_allreduce) == [True] * TOPOLOGIES[topology][0]


def _sequence_numbers(rank, world):
    group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    start = group._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(3))
    dist.barrier()
    dist.all_gather_into_tensor(torch.empty(world), torch.ones(1))
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    return start, group._get_sequence_number_for_group()


@pytest.mark.parametrize("topology", ["1host-w3", "2x2hosts"])
def test_sequence_numbers_count_collectives_alike_on_every_rank(ranks, topology):
    numbers = run_on(ranks, topology, _sequence_numbers)
    start = numbers[0][0]
    assert numbers == [(start, start + 4)] * TOPOLOGIES[topology][0]


def _detail_debug_mode(rank, world):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the group (it needs sequence numbers); a mismatch is still an error.
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(world)))))
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(5))
        else:
            dist.broadcast(torch.ones(5), src=0)
    except RuntimeError as error:
        return str(error)
    return None


def test_detail_debug_mode_initialises_and_mismatched_collectives_fail(ranks):
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    for message in ranks.run(_detail_debug_mode, 2, timeout=120, env=env):
        assert "ranks disagree on collective #2" in message, message
        assert "broadcast #2 (f32 x 5, root 0)" in message and "allreduce #2 (f32 x 5, sum)" in message, message


def _monitored_barrier(rank, world):
    import datetime

    # dist.monitored_barrier refuses every backend not named "gloo" before asking it; torch's own tests
    # call the group's method, which reaches the backend.
    group = dist.distributed_c10d._get_default_group()
    group.monitored_barrier(datetime.timedelta(seconds=30))
    if rank == world - 1:
        return "skipped"
    try:
        group.monitored_barrier(datetime.timedelta(seconds=2), wait_all_ranks=True)
    except RuntimeError as error:
        return str(error)
    return None


def test_monitored_barrier_names_the_rank_that_did_not_come(ranks):
    outcomes = ranks.launch(_monitored_barrier, 3, timeout=90)
    assert outcomes[0].value == "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 2000 ms", outcomes[0]


def _op_tensors_go_before_the_waiter_wakes(rank, world):
    import time
    import weakref

    # Rank 1 comes late to a barrier, so rank 0's all-gather waits in the queue behind it, its input dropped by
    # the caller: from then on only the queued op holds the input.
    if rank == 1:
        time.sleep(0.3)
    gate = dist.barrier(async_op=True)
    data = torch.full((1 << 16,), float(rank))
    out = torch.empty(world << 16)
    alive = weakref.ref(data)
    work = dist.all_gather_into_tensor(out, data, async_op=True)
    del data
    # The callback runs as the Work completes, before any wait() returns: the op's tensors must be gone by then
    # (the Work itself keeps its outputs, as torch's do).
    freed_at_completion = []
    work.get_future().then(lambda _: freed_at_completion.append(alive() is None))
    work.wait()
    gate.wait()
    assert torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(1 << 16))
    return freed_at_completion


@pytest.mark.parametrize("topology", ["1host-w2", "2x2hosts"])
def test_a_queued_op_releases_its_tensors_before_its_work_completes(ranks, topology):
    freed = run_on(ranks, topology, _op_tensors_go_before_the_waiter_wakes)
    assert freed[0] == [True], "the worker still held the all-gather's input when its Work completed"

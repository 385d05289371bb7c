"""What users see when things go wrong: errors name the rank, the op and the value; nothing hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist


def _disagree_on_size(rank, world):
    dist.all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError) as info:
        dist.all_reduce(torch.ones(10 + rank))
    return str(info.value)


def test_ranks_disagreeing_on_size_both_get_the_error(ranks):
    messages = ranks.run(_disagree_on_size, 2, timeout=60)
    for message in messages:
        assert ("ranks disagree on collective #2: rank 0 called allreduce #2 (f32 x 10, sum) "
                "but rank 1 called allreduce #2 (f32 x 11, sum)") in message or (
                "ranks disagree on collective #2: rank 1 called allreduce #2 (f32 x 11, sum) "
                "but rank 0 called allreduce #2 (f32 x 10, sum)") in message, message


def _disagree_on_op(rank, world):
    with pytest.raises(RuntimeError) as info:
        if rank == 0:
            dist.all_reduce(torch.ones(8))
        else:
            dist.broadcast(torch.ones(8), src=0)
    # The group is unusable afterwards, with the same explanation, and still shuts down cleanly.
    with pytest.raises(RuntimeError, match="ranks disagree"):
        dist.all_reduce(torch.ones(1))
    return str(info.value)


def test_ranks_disagreeing_on_op(ranks):
    messages = ranks.run(_disagree_on_op, 2, timeout=60)
    for message in messages:
        assert "ranks disagree on collective #1" in message
        assert "allreduce #1 (f32 x 8, sum)" in message and "broadcast #1 (f32 x 8, root 0)" in message


def _late_rank(rank, world):
    if rank == 1:
        time.sleep(4)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(16))
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return None


def test_timeout_names_the_missing_rank(ranks):
    outcomes = ranks.launch(_late_rank, 2, timeout=60, pg_timeout=1.5)
    elapsed, message = outcomes[0].value
    assert 1.4 < elapsed < 3.0
    assert "allreduce #1 (f32 x 16, sum) (rank 0): Timed out after 1500 ms waiting for rank(s) [1]" in message
    _, late_message = outcomes[1].value  # the late rank finds the group aborted, with the reason
    assert "group" in late_message and "Timed out after 1500 ms" in late_message


def _shut_down_while_an_exchange_waits(rank, world, workdir):
    from datetime import timedelta
    from pathlib import Path

    done = Path(workdir) / "rank0_done"
    side = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 1:  # stays up, its connections open, and never joins rank 0's ops
        deadline = time.monotonic() + 50
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    # The leaders' reduce-scatter waits on a point-to-point exchange with the other host, which never answers.
    work = dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8), async_op=True)
    with pytest.raises(RuntimeError):
        dist.barrier(group=side)  # times out after 1 s and aborts every group of the process, the world's too
    with pytest.raises(RuntimeError) as aborted:
        work.wait()
    start = time.monotonic()
    dist.destroy_process_group()  # wakes the exchange thread 60 s before the exchange's deadline, and joins it
    elapsed = time.monotonic() - start
    done.touch()
    return elapsed, str(aborted.value)


def test_shutdown_ends_an_exchange_stuck_on_a_silent_host(ranks):
    env = [{"SHARDKIT_HOST_ID": f"host{r}"} for r in range(2)]
    outcomes = ranks.launch(_shut_down_while_an_exchange_waits, 2, str(ranks.workdir), timeout=60, pg_timeout=60,
                            env=env)
    elapsed, message = outcomes[0].value
    assert "group aborted" in message, message
    assert elapsed < 5, f"destroy_process_group took {elapsed:.1f} s with an exchange in flight"


def _bad_inputs(rank, world):
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    root_options = dist.BroadcastOptions()
    root_options.rootRank = world + 3
    errors = {}
    for name, call in {
        "dtype": lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)),
        "bitwise_on_float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        # torch rejects a src outside the group before any backend sees it: call the backend itself.
        "root": lambda: backend.broadcast([torch.ones(2)], root_options),
        "gather_size": lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)),
        "splits": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [1] * world, [3] * world),
    }.items():
        try:
            call()
            errors[name] = None
        except (RuntimeError, ValueError) as error:
            errors[name] = str(error)
    dist.barrier()  # rejected calls never reached the engine: the group is still in step
    return errors


def test_bad_input_errors_name_rank_op_and_value(ranks):
    errors = ranks.run(_bad_inputs, 2, timeout=60)[1]
    assert "shardkit allreduce (rank 1): dtype UInt16 is not supported" in errors["dtype"]
    assert ("shardkit allreduce (rank 1): reduce op BAND is defined for integer and bool tensors only, got Float"
            in errors["bitwise_on_float"])
    assert "shardkit broadcast (rank 1): root rank 5 is outside the group of size 2" in errors["root"]
    assert "shardkit all_gather_into_tensor (rank 1): output has 3 elements, expected 4" in errors["gather_size"]
    assert "shardkit all_to_all_single (rank 1): input split sizes sum to 6, but dim 0 is 4" in errors["splits"]


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _soak(rank, world, steps):
    import random

    fds_before = len(os.listdir("/proc/self/fd"))
    rss = []  # after warm-up (the allocator's pools and the segment's pages are in use by then), and at the end
    rng = random.Random(1234)  # the same sequence on every rank
    for step in range(steps):
        if step == 300:
            rss.append(_rss_mb())
        kind = rng.choice(["allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "barrier"])
        n = rng.choice([1, 17, 1024, 5000, 70_000])
        dtype = rng.choice([torch.float32, torch.int64, torch.bfloat16])
        mine = (torch.arange(n) % 97 + rank).to(dtype)
        if kind == "allreduce":
            dist.all_reduce(mine)
            expected = (torch.arange(n) % 97 * world + sum(range(world))).to(dtype)
        elif kind == "broadcast":
            root = rng.randrange(world)
            dist.broadcast(mine, src=root)
            expected = (torch.arange(n) % 97 + root).to(dtype)
        elif kind == "allgather":
            out = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, mine)
            mine, expected = out, torch.cat([(torch.arange(n) % 97 + r).to(dtype) for r in range(world)])
        elif kind == "reduce_scatter":
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, mine.repeat(world))
            mine, expected = out, (torch.arange(n) % 97 * world + sum(range(world))).to(dtype)
        elif kind == "alltoall":
            out = torch.empty(world * n, dtype=dtype)
            dist.all_to_all_single(out, mine.repeat(world))
            mine, expected = out, torch.cat([(torch.arange(n) % 97 + r).to(dtype) for r in range(world)])
        else:
            dist.barrier()
            continue
        if dtype == torch.bfloat16:
            torch.testing.assert_close(mine, expected, rtol=1e-2, atol=1.0)
        else:
            assert torch.equal(mine, expected), f"step {step}: {kind} {dtype} n={n}"
    rss.append(_rss_mb())
    return len(os.listdir("/proc/self/fd")) - fds_before, rss


def test_soak_thousands_of_random_collectives(ranks):
    results = ranks.run(_soak, 4, 5000, timeout=400)
    assert [fds for fds, _ in results] == [0] * 4, f"file descriptors leaked: {results}"
    # Memory stays flat: what a rank holds after 300 ops is what it holds after 5,000 (the inputs are at most
    # 4 x 70,000 x 8 bytes, so a leak of even one buffer per op would show as hundreds of MB).
    for rank, (_, (warm, end)) in enumerate(results):
        assert end - warm < 48, f"rank {rank}: RSS grew from {warm:.0f} MB to {end:.0f} MB over the soak"
    print("soak RSS (MB, after warm-up -> end):", [(round(w), round(e)) for _, (w, e) in results])


def _cuda_route_in_a_cpu_build(rank, world):
    from shardkit import _C

    return _C.with_cuda, dist.group.WORLD._get_backend(torch.device("cpu")).cuda_route()


def test_cuda_route_of_a_cpu_build_says_so(ranks):
    with_cuda, route = ranks.run(_cuda_route_in_a_cpu_build, 1)[0]
    if with_cuda:
        pytest.skip("a CUDA build: tests/python/test_cuda_collectives.py covers its routes")
    assert route == "none: this shardkit build drives CPU tensors only"


def _alltoall_self_block_disagrees(rank, world):
    out_splits = [2] * world
    out_splits[rank] = 3  # every rank: receives 3 from itself but sends it 2
    try:
        dist.all_to_all_single(torch.empty(sum(out_splits)), torch.ones(2 * world), out_splits, [2] * world)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "no error"


def test_alltoall_split_sizes_that_disagree_on_the_own_block_are_refused(ranks):
    messages = ranks.run(_alltoall_self_block_disagrees, 2)
    for rank, message in enumerate(messages):
        assert (f"shardkit all_to_all_single (rank {rank}): this rank sends 2 elements to itself but expects to "
                f"receive 3 from itself (input and output split sizes disagree at index {rank})") in message


def _cpu_tensor_on_a_cuda_only_group(rank, world):
    try:
        dist.all_reduce(torch.ones(3))
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "no error"


def test_a_cpu_tensor_on_a_cuda_only_group_is_refused(ranks):
    # backend="cuda:shardkit": no backend serves CPU tensors; torch's dispatcher says so before shardkit is asked
    # (the group is made without a GPU: the backend's CUDA side is set up lazily, at the first CUDA op).
    messages = ranks.run(_cpu_tensor_on_a_cuda_only_group, 2, backend="cuda:shardkit")
    assert messages == ["No backend type associated with device type cpu"] * 2

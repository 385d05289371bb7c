"""A rank dies (SIGKILL) in the middle of training or of a collective: every survivor raises within 2 s,
naming the dead rank by its global rank, on one host and across hosts — also where the dead rank was its host's
only one, under HYBRID_SHARD (whose groups are subgroups), and in a subgroup; every later backward raises too;
/dev/shm stays clean (the conftest fixture checks it after every test)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from support import harness
from support.collective_cases import topology_env

# (world size, hosts of the ranks, the rank that dies)
CASES = {
    "w2": (2, None, 1),
    "w4": (4, None, 2),
    "2x2hosts-nonleader": (4, [0, 0, 1, 1], 1),
    "2x2hosts-leader": (4, [0, 0, 1, 1], 2),
    # Its host's only rank: nobody shares its host to see its pid go; the leaders' connection to it drops.
    "2+1hosts-lone": (3, [0, 0, 1], 2),
    # ...among three hosts: the two healthy leaders both wait for a root cause and must not name each other silent.
    "3hosts-lone": (4, [0, 0, 1, 2], 3),
}


def _train_until_a_rank_dies(rank, world, victim, wrapper):
    import shardkit

    torch.manual_seed(0)
    # *_zero_copy: buckets / flat gradients in shared memory (one host), the middle layer's past the 32 KB
    # small-message size, so the victim dies while the survivors wait in the shared-buffer reduction.
    width = 128 if wrapper.endswith("_zero_copy") or wrapper == "fully_shard" else 64
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, 4))
    if wrapper == "fully_shard":  # FSDP2's recipe, one unit per Linear, then the root
        for layer in model[::2]:
            shardkit.fully_shard(layer)
        ddp = shardkit.fully_shard(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    elif wrapper.startswith("fsdp"):  # one unit per Linear: all-gathers and reduce-scatters all through backward
        # HYBRID_SHARD: shard groups of each host's ranks, replicate groups across hosts (subgroups of the world).
        strategy = shardkit.fsdp.ShardingStrategy.HYBRID_SHARD if wrapper == "fsdp_hybrid" else None
        ddp = shardkit.FullyShardedDataParallel(model, auto_wrap_policy={torch.nn.Linear},
                                                **({"sharding_strategy": strategy} if strategy else {}))
        if wrapper == "fsdp":
            ddp._reduce_memory = None  # flat gradients in memory of their own: the copying reduce-scatter
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    else:
        zero_stage = {"ddp": 0, "ddp_zero_copy": 0, "zero1": 1, "zero2": 2}[wrapper]
        ddp = shardkit.DistributedDataParallel(model, bucket_cap_mb=0.004, zero_stage=zero_stage,
                                               gradient_as_bucket_view=wrapper == "ddp_zero_copy")
        if zero_stage:
            optimizer = shardkit.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.01)
        else:
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if rank == victim:
        # Dies in the middle of its third backward: after the last layer's gradients, before the rest.
        steps = {"n": 0}

        def die(module, grad_output):
            if steps["n"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        model[2].register_full_backward_pre_hook(die)
    data = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    for _step in range(2):
        ddp(data).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == victim:
            steps["n"] += 1
    zero_copy = getattr(ddp, "_reduce_memory", None) is not None
    start = time.monotonic()
    try:
        ddp(data).square().mean().backward()
    except RuntimeError as error:
        elapsed, message = time.monotonic() - start, str(error)
    else:
        return "backward after the peer's death returned normally"
    later = []
    for _ in range(3):  # training on must fail too, never use a partly reduced gradient
        try:
            ddp(data).square().mean().backward()
            later.append("returned normally")
        except RuntimeError as error:
            later.append(str(error))
    return elapsed, message, later, zero_copy


@pytest.mark.parametrize("wrapper", ["ddp", "ddp_zero_copy", "zero1", "zero2", "fsdp", "fsdp_zero_copy", "fsdp_hybrid",
                                     "fully_shard"])
@pytest.mark.parametrize("case", list(CASES))
def test_rank_killed_mid_backward(ranks, case, wrapper):
    world, hosts, victim = CASES[case]
    if wrapper == "fsdp_hybrid" and not case.startswith("2x2hosts"):
        pytest.skip("HYBRID_SHARD needs the same number of ranks on every host, and several hosts to differ from "
                    "FULL_SHARD")
    outcomes = ranks.launch(_train_until_a_rank_dies, world, victim, wrapper, timeout=90, pg_timeout=60,
                            env=topology_env(hosts))
    for outcome in harness.survivors(outcomes, victim):
        assert not isinstance(outcome.value, str), f"rank {outcome.rank}: {outcome.value}"
        elapsed, message, later, zero_copy = outcome.value
        if wrapper == "fsdp_zero_copy":  # the shared flat-gradient memory applies where the shard group is one host
            assert zero_copy == (hosts is None), f"rank {outcome.rank}: FSDP zero-copy memory in use: {zero_copy}"
        assert elapsed < 2.0, f"rank {outcome.rank} took {elapsed:.2f} s to notice: {message}"
        # No survivor saw a lone rank exit: it is named as its host gone silent (and only it).
        how = "went silent" if case.endswith("-lone") else "exited"
        assert f"rank(s) {victim} (pid" in message and how in message, message
        for text in later:
            # The group's abort, or the death as a collective that was in flight (a prefetched all-gather, say)
            # found it first and kept its own error for the call that waits on it.
            assert ("aborted" in text or "exited before arriving" in text) and f"rank(s) {victim} (pid" in text, text


def _kill_mid_allreduce(rank, world, victim):
    dist.all_reduce(torch.ones(1000))  # everyone is up and connected
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(300_000))
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_rank_killed_mid_allreduce(ranks, case):
    world, hosts, victim = CASES[case]
    outcomes = ranks.launch(_kill_mid_allreduce, world, victim, timeout=90, pg_timeout=60, env=topology_env(hosts))
    for outcome in harness.survivors(outcomes, victim):
        assert outcome.value is not None, outcome
        elapsed, message = outcome.value
        assert elapsed < 2.0, f"rank {outcome.rank} took {elapsed:.2f} s to notice: {message}"
        # The user's op and number, and the dead rank by its global number, on every host.
        # ("shardkit allreduce #2 (rank 3): group aborted: ..." or, from the shm wait itself,
        # "shardkit allreduce #2 (f32 x 300000, sum) (rank 0): ...")
        assert message.startswith("shardkit allreduce #2 (") and f"(rank {outcome.rank})" in message, message
        how = "went silent" if case.endswith("-lone") else "exited before arriving"
        assert f"rank(s) {victim} (pid" in message and how in message, message


def _kill_mid_subgroup_allreduce(rank, world):
    # Groups of odd and even ranks: in the odd one, global rank 3 is group rank 1.
    odd, even = dist.new_group([1, 3]), dist.new_group([0, 2])
    mine = odd if rank % 2 else even
    dist.all_reduce(torch.ones(1000), group=mine)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(300_000), group=mine)
        dist.all_reduce(torch.ones(300_000))  # the even ranks learn of it here: in the world group
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return None


@pytest.mark.parametrize("hosts", [None, [0, 1, 0, 1]], ids=["one-host", "2x2hosts"])
def test_a_death_in_a_subgroup_is_named_by_global_rank_everywhere(ranks, hosts):
    outcomes = ranks.launch(_kill_mid_subgroup_allreduce, 4, timeout=90, pg_timeout=60, env=topology_env(hosts))
    for outcome in harness.survivors(outcomes, 3):
        assert outcome.value is not None, outcome
        elapsed, message = outcome.value
        assert elapsed < 2.0, f"rank {outcome.rank} took {elapsed:.2f} s to notice: {message}"
        assert f"(rank {outcome.rank})" in message, message  # itself by its global rank too
        assert "rank(s) 3 (pid" in message, message
        assert "rank(s) 1 (pid" not in message, message  # never the group's own number


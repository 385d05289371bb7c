"""Collective order of shardkit's C++ comm hooks on gloo, which matches collectives by issue order.

PowerSGD issues three allreduces per bucket, the later ones from future callbacks; with many buckets the
autograd thread issues bucket i+1's first allreduce while bucket i's P or Q is issued on a completion
thread. Unsequenced, ranks issue them in different orders: gloo aborts ("Received data size doesn't match
expected size" on one rank, "Connection reset by peer" on the other) — torch's own hook does. shardkit's
hooks reserve tickets in bucket order and issue in ticket order (csrc/core/collective_sequencer.h).

What each test can catch:
- parity on gloo: a hook that issues out of order (crash, or unrelated tensors summed when sizes agree);
  a sequencer that drops, repeats or reorders a step (wrong gradients). The oracle is the same hook on
  the same bucket layout over a shardkit-backend group, whose single worker runs chained collectives in
  order with or without the sequencer: independent of the bug;
- a peer dying mid-step: a failed collective must fail every later bucket's result (naming the rank, the
  bucket and the op) instead of leaving those buckets waiting for a turn that never comes (a hang).
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support.ddp_cases import IN, OUT, batch, loss_fn, shardkit_ddp
from test_hooks import STEPS, hooks, train_lock_step

CAP = dict(bucket_cap_mb=0.004)  # 4,194 bytes: each 32x32 layer (4,224 bytes with its bias) fills a bucket
BUCKETS = 6  # deep() with CAP: the last two layers, four 32x32 layers, the first layer
OPTIONS = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=5)


def deep(seed: int = 0) -> nn.Sequential:
    """8 -> 32 -> (32 -> 32) x 5 -> 4, tanh between: BUCKETS buckets with CAP."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN, 32)]
    for _ in range(5):
        layers += [nn.Tanh(), nn.Linear(32, 32)]
    layers += [nn.Tanh(), nn.Linear(32, OUT)]
    return nn.Sequential(*layers)


def _parity_on_gloo(rank, world, kind):
    H = hooks()
    python_hook = {"powersgd": H.powerSGD_hook, "batched_powersgd": H.batched_powerSGD_hook}[kind]
    buckets = set()

    def counting_hook(state, bucket):  # torch's DDP insists on the name `bucket`
        buckets.add(bucket.index())
        return python_hook(state, bucket)

    oracle_group = dist.new_group(backend="shardkit")
    module = deep()
    oracle = TorchDDP(copy.deepcopy(module), process_group=oracle_group, **CAP)
    H.register(oracle, H.PowerSGDState(oracle_group, **OPTIONS), kind)
    # On gloo, the default group: the Python entry and the native hook on torch's DDP and on shardkit's.
    via_python = TorchDDP(copy.deepcopy(module), **CAP)
    state = H.PowerSGDState(None, **OPTIONS)
    via_python.register_comm_hook(state, counting_hook)
    native = TorchDDP(copy.deepcopy(module), **CAP)
    H.register(native, H.PowerSGDState(None, **OPTIONS), kind)
    python_on_shardkit = shardkit_ddp()(copy.deepcopy(module), **CAP)
    python_on_shardkit.register_comm_hook(H.PowerSGDState(None, **OPTIONS), python_hook)
    native_on_shardkit = shardkit_ddp()(copy.deepcopy(module), **CAP)
    H.register(native_on_shardkit, H.PowerSGDState(None, **OPTIONS), kind)
    # Two ranks: both backends add two numbers, so the results are bitwise equal; with four, gloo's ring
    # and shardkit's fixed order round differently.
    tolerance = dict(rtol=0, atol=0) if world == 2 else dict(rtol=1e-5, atol=1e-6)
    models = [oracle, via_python, native, python_on_shardkit, native_on_shardkit]
    train_lock_step(rank, models, STEPS, f"rank {rank} {kind} on gloo", **tolerance)
    assert sorted(buckets) == list(range(BUCKETS)), f"rank {rank}: buckets {sorted(buckets)}"
    assert state.iter == STEPS and state.compression_stats()[0] > 1, state.compression_stats()


@pytest.mark.parametrize("kind", ["powersgd", "batched_powersgd"])
@pytest.mark.parametrize("world", [2, 4])
def test_powersgd_on_gloo_with_many_buckets(ranks, world, kind):
    ranks.run(_parity_on_gloo, world, kind, backend="gloo", timeout=240)


def _find_unused_on_gloo(rank, world):
    # With find_unused_parameters the reducer adds a collective of its own (the used-parameter map) after the
    # buckets: it must not overtake a bucket's pending Q. shardkit's reducer issues it once every bucket's
    # hook future has completed (torch's issues it right after the last hook and crashes the same way as an
    # unsequenced hook: it cannot be fixed from the hook side).
    H = hooks()
    oracle_group = dist.new_group(backend="shardkit")
    module = deep()
    models = []
    for group in (oracle_group, None):  # the oracle on shardkit, then the same on gloo (the default group)
        model = shardkit_ddp()(copy.deepcopy(module), process_group=group, find_unused_parameters=True, **CAP)
        H.register(model, H.PowerSGDState(group, **OPTIONS), "powersgd")
        models.append(model)
    tolerance = dict(rtol=0, atol=0) if world == 2 else dict(rtol=1e-5, atol=1e-6)
    train_lock_step(rank, models, STEPS, f"rank {rank} find_unused_parameters on gloo", **tolerance)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_powersgd_with_find_unused_parameters_on_gloo(ranks, world):
    assert ranks.run(_find_unused_on_gloo, world, backend="gloo", timeout=240) == [True] * world


def _peer_dies(rank, world, victim_bucket):
    """Rank 1 exits inside its hook for bucket `victim_bucket` at the first compressed step; rank 0 records
    what each bucket's future says."""
    H = hooks()
    model = TorchDDP(deep(), **CAP)
    state = H.PowerSGDState(None, **OPTIONS)
    futures = {}

    def hook(state, bucket):
        if rank == 1 and state.iter == OPTIONS["start_powerSGD_iter"] and bucket.index() == victim_bucket:
            os._exit(3)
        future = H.powerSGD_hook(state, bucket)
        futures[bucket.index()] = future
        return future

    model.register_comm_hook(state, hook)
    for step in range(OPTIONS["start_powerSGD_iter"] + 1):
        futures.clear()
        x, y = batch(rank, step)
        try:
            loss_fn(model(x), y).backward()
        except RuntimeError as e:
            outcomes = {}
            for index, future in sorted(futures.items()):
                try:
                    future.wait()
                    outcomes[index] = "ok"
                except RuntimeError as bucket_error:
                    outcomes[index] = str(bucket_error)
            return step, str(e), outcomes
    raise AssertionError(f"rank {rank}: backward succeeded although rank 1 died")


def test_a_failed_collective_fails_every_later_bucket(ranks):
    victim = 3
    outcomes = ranks.launch(_peer_dies, 2, victim, backend="gloo", timeout=120, pg_timeout=60)
    assert outcomes[1].exitcode == 3, outcomes[1].error
    assert outcomes[0].ok, outcomes[0].error
    step, error, buckets = outcomes[0].value
    assert step == OPTIONS["start_powerSGD_iter"], (step, error)
    # Every bucket's hook ran (the autograd thread never waits for a turn) and every one of them finished.
    assert sorted(buckets) == list(range(BUCKETS)), buckets
    failed = [index for index, outcome in buckets.items() if outcome != "ok"]
    assert failed and failed == list(range(failed[0], BUCKETS)), buckets  # from the first failure on, all fail
    assert failed[0] <= victim, buckets  # rank 0 cannot complete bucket `victim`'s collectives alone
    # Python-entry futures say "Got the following error when running the callback: RuntimeError: <error>".
    def error_line(message: str) -> str:
        return message.split("RuntimeError: ")[-1].splitlines()[0]

    abandoned = "allreduce was not issued: an earlier collective of this PowerSGDState failed, which loses the " \
                "order of collectives across ranks (build a new PowerSGDState to go on). The first error: "
    # Collectives already issued when rank 1 died fail with gloo's own error (the first failing bucket's, at
    # least). Rank 1 issued nothing of bucket `victim` on, so rank 0's P of that bucket never completes and
    # no later bucket's collective may go out: those buckets are abandoned, naming the error that stopped them.
    own = {error_line(buckets[i]) for i in failed if abandoned not in buckets[i]}
    assert abandoned not in buckets[failed[0]], buckets
    for index in range(victim + 1, BUCKETS):
        message = buckets[index]
        assert f"shardkit PowerSGD (rank 0): bucket {index}'s " in message and abandoned in message, message
        assert message.split(abandoned)[1].splitlines()[0] in own, (own, message)

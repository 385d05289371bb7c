"""Zero-copy: collectives that read their input from the group's shared memory, bitwise equal to the copying path.

A shardkit group on one host can hand out shared buffers (``shardkit.backend.shared_buffer(nbytes)``): memory every
rank maps from every other, in which an allreduce reads the peers' data where it lies instead of copying it
through the group's slots (csrc/core/shm_group.h, "Shared buffers"). shardkit's DDP puts its buckets there
with ``gradient_as_bucket_view=True``.

What is checked:
- The collective itself, on every topology: a tensor in a shared buffer and an ordinary copy of it, reduced
  with the same op, end bitwise equal (every float dtype, int32, every op; AVG also equal to SUM then a division,
  sizes around the small-message limit and past the slot size, at an offset inside the buffer), and the bytes
  around the tensor stay untouched. On one host
  the backend's count of zero-copy allreduces proves the path ran; across simulated hosts there is no shared
  buffer (None) and ordinary tensors carry on.
- Disagreement fails clearly: one rank in a shared buffer, another not; different buffer sizes.
- The reduce-scatter whose input lies in a shared buffer: bitwise the copying path on every topology, into a
  private output and in place (this rank's own block).
- FSDP: flat gradients made in the shard group's shared memory train bitwise like ordinary ones (every strategy,
  bf16 both ways, no_sync, a unit run twice) and like torch DDP on gloo; the memory past a block's size is given
  back between iterations; a rank without room makes every rank fall back at once; gloo keeps ordinary memory.
- DDP: the zero-copy DDP trains bitwise like the copying one (gradient_as_bucket_view=False) and like torch's
  DDP on gloo within the usual tolerance, across the bucket rebuild; it falls back (zero_copy() False, same
  numbers) across hosts, on a gloo group, and where the flag is off.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support.collective_cases import TOPOLOGIES, make_input, ops_for, topology_env
from support.ddp_cases import assert_modules_match, batch, loss_fn, sgd, shardkit_ddp, wide_mlp

# One host at every world size (where the shared buffers apply), and two multi-host groups (where every rank falls
# back to its ordinary buffers): even hosts, and uneven ones. The other simulated topologies of collective_cases
# exercise the hierarchical engine's schemes, which test_collectives covers; here they would rerun the same
# fallback (2x2hosts-leaders even ran 2x2hosts again: this test sets no scheme).
EVERY_TOPOLOGY = pytest.mark.parametrize("topology", ["1host-w1", "1host-w2", "1host-w3", "1host-w4", "2x2hosts",
                                                      "3hosts-uneven"])
R = dist.ReduceOp
# Elements: at the small-message limit (32 KiB of f32: the slot path, even in a shared buffer), just past it,
# odd, and past the 1 MiB slot (the copying path chunks it; the zero-copy one does not).
SIZES = [8192, 8193, 70_001, 300_001]


def _cpu_backend(group=None):
    group = group if group is not None else dist.group.WORLD
    return group._get_backend(torch.device("cpu"))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equality is bitwise (NaN and -0.0 included)."""
    return tensor.contiguous().view(torch.uint8).clone()


def _shared_vs_copying(rank, world):
    backend = _cpu_backend()
    guard = 64  # bytes before and after the tensor that must stay as they were
    largest = max(SIZES) * 8 + 2 * guard
    shared, _ = backend.shared_buffer(largest)  # None (and no reason) across hosts
    if shared is None:  # ranks on several hosts: no shared memory; the caller checks the topology says so
        return None
    assert shared.dtype == torch.uint8 and shared.numel() == largest
    before = backend.shared_ops()
    mismatches, zero_copy_expected = [], 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32):
        for n in SIZES:
            for op in ops_for(dtype) + ([] if dtype.is_floating_point else [R.AVG]):  # int AVG truncates
                x = make_input(rank, n, dtype, salt=int(op))
                nbytes = n * x.element_size()
                shared.fill_(0xA5)
                inside = shared[guard:guard + nbytes].view(dtype)
                inside.copy_(x)
                ordinary = x.clone()
                dist.all_reduce(inside, op=op)
                dist.all_reduce(ordinary, op=op)
                if not torch.equal(_bits(inside), _bits(ordinary)):
                    mismatches.append(f"{dtype} n={n} {op}")
                if op == R.AVG:  # the division inside the reduction gives the bits of SUM, then a division
                    summed = x.clone()
                    dist.all_reduce(summed, op=R.SUM)
                    divided = summed.div(world, rounding_mode=None if dtype.is_floating_point else "trunc")
                    if not torch.equal(_bits(divided), _bits(ordinary)):
                        mismatches.append(f"{dtype} n={n} AVG differs from SUM then division")
                if (shared[:guard] != 0xA5).any() or (shared[guard + nbytes:] != 0xA5).any():
                    mismatches.append(f"{dtype} n={n} {op}: bytes outside the tensor changed")
                zero_copy_expected += nbytes > 32 * 1024
    return mismatches, backend.shared_ops() - before, zero_copy_expected


def _reduce_scatter_shared_vs_copying(rank, world):
    """reduce_scatter_tensor whose input lies in a shared buffer against the same input in ordinary memory: bits
    of the result (into a private tensor, and into this rank's own block of the input), bytes around the input."""
    backend = _cpu_backend()
    guard = 64
    per_rank = max(SIZES) // world + 1
    shared, _ = backend.shared_buffer(per_rank * world * 8 + 2 * guard)
    if shared is None:
        return None
    before = backend.shared_ops()
    mismatches, zero_copy_expected = [], 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32):
        for n in sorted({s // world for s in SIZES} | {per_rank}):
            for op in ops_for(dtype):
                x = make_input(rank, n * world, dtype, salt=int(op))
                nbytes = x.numel() * x.element_size()
                shared.fill_(0xA5)
                inside = shared[guard:guard + nbytes].view(dtype)
                inside.copy_(x)
                ordinary, zero_copy = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(zero_copy, inside, op=op)
                dist.reduce_scatter_tensor(ordinary, x.clone(), op=op)
                if not torch.equal(_bits(zero_copy), _bits(ordinary)):
                    mismatches.append(f"{dtype} n={n} {op}")
                own_block = inside[rank * n:(rank + 1) * n]
                dist.reduce_scatter_tensor(own_block, inside, op=op)  # in place, as NCCL defines it
                if not torch.equal(_bits(own_block), _bits(ordinary)):
                    mismatches.append(f"{dtype} n={n} {op}: in place")
                if (shared[:guard] != 0xA5).any() or (shared[guard + nbytes:] != 0xA5).any():
                    mismatches.append(f"{dtype} n={n} {op}: bytes outside the input changed")
                zero_copy_expected += 2 * (nbytes > 32 * 1024)
    return mismatches, backend.shared_ops() - before, zero_copy_expected


@EVERY_TOPOLOGY
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_collective_from_shared_buffer_is_bitwise_the_copying_path(ranks, topology, op):
    world, hosts = TOPOLOGIES[topology]
    fn = _shared_vs_copying if op == "allreduce" else _reduce_scatter_shared_vs_copying
    results = ranks.run(fn, world, timeout=240, env=topology_env(hosts))
    if hosts is not None and len(set(hosts)) > 1:
        assert results == [None] * world, "a group across hosts must not hand out shared buffers"
        return
    for rank, (mismatches, ran, expected) in enumerate(results):
        assert not mismatches, f"rank {rank}: zero-copy {op} differs from the copying path: {mismatches}"
        # Every op past the small-message size took the zero-copy path.
        assert ran == expected > 0, f"rank {rank}: {ran} zero-copy {op}s, expected {expected}"


def _message_of(call) -> str | None:
    """What ``call()`` raised (RuntimeError), or None if it returned."""
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def _one_rank_shared(rank, world):
    shared, _ = _cpu_backend().shared_buffer(1 << 20)
    n = 100_000
    tensor = shared[: n * 4].view(torch.float32) if rank == 0 else torch.ones(n)
    return _message_of(lambda: dist.all_reduce(tensor))


def _one_rank_shared_reduce_scatter(rank, world):
    shared, _ = _cpu_backend().shared_buffer(1 << 20)
    n = 50_000
    source = shared[: n * world * 4].view(torch.float32) if rank == 0 else torch.ones(n * world)
    return _message_of(lambda: dist.reduce_scatter_tensor(torch.empty(n), source))


def _different_sizes(rank, world):
    return _message_of(lambda: _cpu_backend().shared_buffer(4096 * (rank + 1)))


@pytest.mark.parametrize("case", ["one_rank_in_a_shared_buffer", "one_rank_reduce_scatters_from_one",
                                  "different_buffer_sizes"])
def test_ranks_that_disagree_fail_clearly_on_every_rank(ranks, case):
    fn, called, sides = {
        "one_rank_in_a_shared_buffer": (_one_rank_shared, "allreduce", ["in shared buffer 1 at byte 0"]),
        "one_rank_reduce_scatters_from_one": (_one_rank_shared_reduce_scatter, "reduce_scatter",
                                              ["in shared buffer 1 at byte 0"]),
        "different_buffer_sizes": (_different_sizes, "shared_buffer", ["u8 x 4096", "u8 x 8192"]),
    }[case]
    messages = ranks.run(fn, 2, timeout=60, pg_timeout=20)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank}: the mismatched collective succeeded"
        assert re.search(rf"ranks disagree on collective #\d+: rank \d called {called}", message), message
        assert all(side in message for side in sides), message


def _negative(rank, world):
    with pytest.raises(RuntimeError, match=r"shared_buffer.*at least 0 bytes, got -1"):
        _cpu_backend().shared_buffer(-1)


def test_negative_size_is_refused(ranks):
    ranks.run(_negative, 1, timeout=60)


# --- DDP ----------------------------------------------------------------------------------------------

def _params_bits(module: nn.Module) -> list[bytes]:
    return [bytes(_bits(p.detach()).numpy()) for p in module.parameters()]


def _ddp_zero_copy(rank, world, group_backend):
    group = dist.new_group(backend=group_backend) if group_backend != "shardkit" else dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    Ddp = shardkit_ddp()
    base = wide_mlp()
    zero_copy = Ddp(copy.deepcopy(base), process_group=group, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    copying = Ddp(copy.deepcopy(base), process_group=group, gradient_as_bucket_view=False, bucket_cap_mb=0.05)
    torch_ddp = TorchDDP(copy.deepcopy(base), process_group=gloo, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    models = (zero_copy, copying, torch_ddp)
    optimizers = [sgd(m.module.parameters()) for m in models]
    backend = _cpu_backend(group) if group_backend == "shardkit" else None
    before = backend.shared_ops() if backend is not None else 0
    for step in range(4):  # the buckets are rebuilt before the second backward: a new shared buffer
        x, y = batch(rank, step)
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            loss_fn(model(x), y).backward()
        for a, b in zip(zero_copy.module.parameters(), copying.module.parameters()):
            assert torch.equal(_bits(a.grad), _bits(b.grad)), f"rank {rank} step {step}: zero-copy grads differ"
        assert_modules_match(torch_ddp.module, zero_copy.module, f"rank {rank} step {step}", grads=True)
        for optimizer in optimizers:
            optimizer.step()
    assert _params_bits(zero_copy.module) == _params_bits(copying.module)
    ran = backend.shared_ops() - before if backend is not None else 0
    return zero_copy.reducer.zero_copy(), copying.reducer.zero_copy(), ran, _params_bits(zero_copy.module)


@pytest.mark.parametrize("topology", ["1host-w2", "1host-w3", "2x2hosts"])
def test_ddp_zero_copy_buckets_train_bitwise_like_copying_buckets(ranks, topology):
    world, hosts = TOPOLOGIES[topology]
    results = ranks.run(_ddp_zero_copy, world, "shardkit", timeout=180, env=topology_env(hosts))
    one_host = hosts is None
    for rank, (zero_copy, copying, ran, _) in enumerate(results):
        assert zero_copy is one_host, f"rank {rank}: zero_copy() is {zero_copy} on {topology}"
        assert copying is False, f"rank {rank}: a DDP without gradient_as_bucket_view reported zero-copy buckets"
        # Four backwards whose larger buckets pass the small-message size on one host; none across hosts.
        assert (ran > 0) is one_host, f"rank {rank}: {ran} zero-copy allreduces on {topology}"
    assert all(r[3] == results[0][3] for r in results), "ranks' parameters differ"


def test_ddp_on_a_gloo_group_keeps_ordinary_buckets(ranks):
    results = ranks.run(_ddp_zero_copy, 2, "gloo", timeout=180)
    assert [r[:3] for r in results] == [(False, False, 0)] * 2


# --- no room in /dev/shm --------------------------------------------------------------------------------

def test_no_room_in_dev_shm_falls_back_with_a_warning():
    """Two ranks in a mount namespace whose /dev/shm is a 24 MB tmpfs (room for the group's own segment, not for
    64 MB per rank): the buffer is refused on every rank, a zero-copy DDP trains on ordinary buckets and FSDP on
    ordinary flat gradients, each with a ZeroCopyUnavailableWarning naming the sizes and the room (a Python warning,
    nothing on stderr); and FSDP carries on, warning, when /dev/shm fills up between two iterations after its memory
    was given back. Without the check the first write past the room would kill a rank (SIGBUS)."""
    from support.hostbed import UNSHARE, namespaces_unavailable, run_in_session

    why = namespaces_unavailable()
    if why:
        pytest.skip(f"no mount namespace for a small /dev/shm: {why}")
    script = Path(__file__).parent / "support" / "shm_room_script.py"
    shell = 'mount -t tmpfs -o size=24m,mode=1777 shardkit-shm /dev/shm && exec "$@"'
    result = run_in_session([*UNSHARE, "sh", "-c", shell, "sh", sys.executable, str(script)], timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in lines) == [0, 1], result.stdout + result.stderr[-3000:]
    for r in lines:
        assert r["too_big_is_none"] and not r["ddp_zero_copy"] and r["grads_ok"] and r["small_works"], r
        assert r["fsdp_falls_back"], r
        assert r["fsdp_when_full"] == {"released": True, "same_grads": True, "zero_copy_again": True,
                                       "warned": True}, r
        # A Python ZeroCopyUnavailableWarning per refusal, naming the user, the rank, the sizes and /dev/shm's room.
        rank = r["rank"]
        assert [w.split(": /dev/shm has ")[0] for w in r["warned"]] == [
            f"shardkit.backend.shared_buffer (rank {rank}): no zero-copy memory for the buffer "
            "(67108864 bytes per rank)",
            f"shardkit DDP (rank {rank}): no zero-copy memory for the gradient buckets gradient_as_bucket_view=True "
            "asked for (16789504 bytes per rank)",
            f"shardkit FSDP (rank {rank}): no zero-copy memory for the flat gradients (16785408 bytes per rank)"], r
    assert "no zero-copy memory" not in result.stderr, result.stderr  # no C++ warning on stderr any more


# --- FSDP: flat gradients made in shared memory ------------------------------------------------------------

IN_WIDE = 2048  # the root's flat gradient exceeds a block's by more than 256 KiB: that part is given back


class _WideBlock(nn.Module):
    """A block whose flat gradient (~37K f32) is past the small-message size at every world size here."""

    def __init__(self, d: int = 96) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.unused = nn.Linear(d, 4)  # never called: its gradient is zeros in the flat gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _WideNet(nn.Module):
    """Three blocks and a root unit (embed, head) whose flat gradient is the largest (~197K f32): the zero-copy
    memory's part past a block's size is given back after every iteration and allocated again for the root."""

    def __init__(self, depth: int = 3, d: int = 96) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_WIDE, d, bias=False)
        self.blocks = nn.ModuleList([_WideBlock(d) for _ in range(depth)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # one unit run twice in a forward: one reduction per backward all the same
        return self.head(h)


FSDP_VARIANTS = {
    "full_shard": {},
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
    "bf16_params_f32_reduce": {"mixed_precision": (torch.bfloat16, torch.float32)},  # the cast lands in shared memory
    "bf16": {"mixed_precision": (torch.bfloat16, torch.bfloat16)},  # the bf16 gradient itself is made there
    "hybrid_shard": {"sharding_strategy": "HYBRID_SHARD"},
}


def _fsdp_kwargs(variant: str) -> dict:
    from shardkit.fsdp import MixedPrecision, ShardingStrategy

    kwargs = dict(FSDP_VARIANTS[variant])
    if "sharding_strategy" in kwargs:
        kwargs["sharding_strategy"] = ShardingStrategy[kwargs["sharding_strategy"]]
    if "mixed_precision" in kwargs:
        param, reduce = kwargs["mixed_precision"]
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=param, reduce_dtype=reduce)
    return kwargs


def _fsdp_zero_copy(rank, world, variant):
    """Three copies of one model: shardkit FSDP (zero-copy where it applies), the same with the zero-copy memory
    taken away (the copying path: ordinary flat gradients), and torch DDP on gloo (the reference). Steps with a
    no_sync micro-batch and a unit run twice per forward; gradients bitwise equal between the two FSDPs."""
    import shardkit
    from shardkit.wrap import transformer_auto_wrap_policy

    torch.manual_seed(0)
    base = _WideNet()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={_WideBlock})
    kwargs = _fsdp_kwargs(variant)
    zero_copy = shardkit.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=policy, **kwargs)
    copying = shardkit.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=policy, **kwargs)
    copying._reduce_memory = None  # the ordinary path: flat gradients in memory of their own
    torch_ddp = TorchDDP(copy.deepcopy(base), process_group=dist.new_group(backend="gloo"), find_unused_parameters=True)
    models = (zero_copy, copying, torch_ddp)
    optimizers = [sgd(m.parameters()) for m in models]
    backend = _cpu_backend(zero_copy._shard_group) if zero_copy._shard_group is not None else None
    before = backend.shared_ops() if backend is not None else 0
    for step in range(3):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            g = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step)
            x, y = torch.randn(5 + rank, IN_WIDE, generator=g), torch.randn(5 + rank, 4, generator=g)
            with model.no_sync():  # accumulated locally (ordinary memory), reduced with the next backward
                loss_fn(model(x[:2]), y[:2]).backward()
            loss_fn(model(x[2:]), y[2:]).backward()
        for (name, a), b in zip(zero_copy.named_parameters(), copying.parameters()):
            assert torch.equal(_bits(a.grad), _bits(b.grad)), f"rank {rank} step {step}: {name}.grad differs"
        for optimizer in optimizers:
            optimizer.step()
    loose = variant.startswith("bf16")
    reference = torch_ddp.module.state_dict()
    for key, value in zero_copy.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=2e-2 if loose else 1e-5, atol=1e-2 if loose else 1e-6,
                                   msg=lambda m, key=key: f"rank {rank}: {key} differs from torch DDP: {m}")
    assert _params_bits(zero_copy) == _params_bits(copying)
    ran = backend.shared_ops() - before if backend is not None else 0
    memory = zero_copy._reduce_memory
    if memory is not None:  # between iterations only a block's gradient size stays allocated
        block_bytes = zero_copy._units[1].groups[0].handle.reduce_input_bytes
        assert memory.kept == block_bytes < memory.memory.numel(), (block_bytes, memory.memory.numel())
        assert memory.resident == block_bytes
    return memory is not None, ran, zero_copy.collective_counts["reduce_scatter"]


@pytest.mark.parametrize("variant", list(FSDP_VARIANTS))
@pytest.mark.parametrize("topology", ["1host-w2", "1host-w3", "2x2hosts"])
def test_fsdp_flat_gradients_in_shared_memory_train_bitwise_like_the_copying_path(ranks, topology, variant):
    world, hosts = TOPOLOGIES[topology]
    if variant == "hybrid_shard" and hosts is None:
        pytest.skip("HYBRID_SHARD needs simulated hosts")
    results = ranks.run(_fsdp_zero_copy, world, variant, timeout=200, env=topology_env(hosts))
    # Across hosts the shard group spans them (no shared memory), except HYBRID_SHARD's, which is one host's.
    applies = hosts is None or variant == "hybrid_shard"
    for rank, (zero_copy, ran, reduce_scatters) in enumerate(results):
        assert zero_copy is applies, f"rank {rank}: zero-copy memory {'made' if zero_copy else 'missing'} on {topology}"
        # Every synced backward reduce-scatters each of the 4 units once (a unit run twice included), each from
        # shared memory where it applies; the no_sync backwards reduce nothing.
        assert reduce_scatters == 3 * 4, f"rank {rank}: {reduce_scatters} reduce-scatters, expected 12"
        assert ran == (reduce_scatters if applies else 0), f"rank {rank}: {ran} zero-copy reduce-scatters"


def _one_rank_without_room(rank, world):
    """The memory past a block's size is given back after each iteration; when rank 1 alone cannot have it again
    (its reservation fails, as with /dev/shm full), both ranks warn and reduce the root from ordinary memory —
    the same results, no disagreement — and take shared memory again once rank 1 can."""
    import warnings

    import shardkit
    from shardkit import _C

    def make():
        torch.manual_seed(0)
        return shardkit.FullyShardedDataParallel(_WideNet(), auto_wrap_policy={_WideBlock})

    zero_copy, copying = make(), make()
    copying._reduce_memory = None
    backend = _cpu_backend()

    def step(n):
        g = torch.Generator().manual_seed(100 * rank + n)
        x, y = torch.randn(5, IN_WIDE, generator=g), torch.randn(5, 4, generator=g)
        for model in (zero_copy, copying):
            model.zero_grad()
            loss_fn(model(x), y).backward()
        return all(torch.equal(_bits(a.grad), _bits(b.grad))
                   for a, b in zip(zero_copy.parameters(), copying.parameters()))

    same = [step(0)]
    real_reserve = _C.reserve_shared_pages
    if rank == 1:
        _C.reserve_shared_pages = lambda memory, offset, nbytes: "simulated: no room"
    try:
        before = backend.shared_ops()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same.append(step(1))
        without = backend.shared_ops() - before
    finally:
        _C.reserve_shared_pages = real_reserve
    before = backend.shared_ops()
    same.append(step(2))
    again = backend.shared_ops() - before
    warned = [str(w.message) for w in caught if issubclass(w.category, shardkit.ZeroCopyUnavailableWarning)
              and "no zero-copy memory for the flat gradient of unit '(root)'" in str(w.message)]
    return same, without, again, warned, zero_copy._reduce_memory.resident == zero_copy._reduce_memory.kept


def test_fsdp_rank_without_room_for_its_memory_makes_every_rank_use_ordinary_memory(ranks):
    for rank, (same, without, again, warned, released) in enumerate(ranks.run(_one_rank_without_room, 2, timeout=120)):
        assert same == [True, True, True], f"rank {rank}: zero-copy gradients differ from the copying path: {same}"
        # 4 units; the root's reduce-scatter took ordinary memory on both ranks in step 1, shared memory in step 2.
        assert (without, again) == (3, 4), f"rank {rank}: zero-copy reduce-scatters {without} then {again}"
        assert len(warned) == 1, f"rank {rank}: {warned}"
        reason = "simulated: no room" if rank == 1 else "another rank of the shard group has no room in /dev/shm"
        assert reason in warned[0], warned[0]
        assert released, f"rank {rank}: the memory past the kept part was not given back"


def _fsdp_on_gloo(rank, world):
    import shardkit

    torch.manual_seed(0)
    model = shardkit.FullyShardedDataParallel(_WideNet(), process_group=dist.new_group(backend="gloo"))
    loss_fn(model(torch.randn(4, IN_WIDE)), torch.randn(4, 4)).backward()
    return model._reduce_memory is None and all(p.grad is not None for p in model.parameters())


def test_fsdp_on_a_gloo_group_keeps_ordinary_gradients(ranks):
    assert ranks.run(_fsdp_on_gloo, 2, timeout=120) == [True, True]

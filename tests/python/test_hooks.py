"""shardkit.hooks (C++ PowerSGD, fp16/bf16) against torch's own hooks and a float64 reference.

Approach: on every rank, copies of one seeded model are wrapped in DDP (torch's, and shardkit's where
said), each with a hook: torch's Python hook (the oracle), shardkit's hook through ``register_comm_hook``,
and shardkit's hook installed natively with ``shardkit.hooks.register``. All get the same per-rank batches
(ddp_cases.batch) in lock step; gradients are compared after every backward (torch's PowerSGD is
reproduced exactly, same seeds, so the comparison is tight: 1e-5).

What each test can catch:
- parity: a wrong compression decision, shape grouping or P/Q layout, a Q drawn from a different seed or
  in a different order, a missing division, error feedback or warm start mishandled, an iteration
  counted at the wrong time (PowerSGD starting a step early or late);
- float64 reference: an algorithm that matches torch's only by sharing torch's mistakes;
- checkpoints: state not carried (error feedback, P/Q, generator, iteration) -> a resumed run that differs;
- convergence: a hook that is exact per step but whose compression stalls training;
- errors: silent double registration, a state on another process group, bad arguments.
"""

import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support.ddp_cases import IN, OUT, assert_close, batch, loss_fn, shardkit_ddp
from support.ddp_cases import error_of as error_of_rank

STEPS = 10


def hooks():
    import shardkit.hooks

    return shardkit.hooks


def layered(seed: int = 0) -> nn.Sequential:
    """8 -> 32 -> 32 -> 32 -> 4: matrices 32x8, 32x32 (twice: a shape group), 4x32 (not worth compressing at
    rank 2) and biases (never compressed)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, OUT))


def train_lock_step(rank: int, models: list[nn.Module], steps: int, where: str, rtol: float = 1e-5,
                    atol: float = 1e-6) -> None:
    """Forward+backward of the same batch on each model; every model's gradients must equal the first's."""
    for step in range(steps):
        x, y = batch(rank, step)
        for model in models:
            model.zero_grad()
            loss_fn(model(x), y).backward()
        want = [p.grad for p in models[0].parameters()]
        for k, model in enumerate(models[1:], start=1):
            for i, (g, w) in enumerate(zip((p.grad for p in model.parameters()), want)):
                assert_close(g, w, f"{where} model {k} step {step} parameter {i}.grad", rtol=rtol, atol=atol)
        with torch.no_grad():  # a plain SGD step, the same for all, so later steps see moved parameters
            for model in models:
                for p in model.parameters():
                    p -= 0.05 * p.grad


# --- 1. PowerSGD: torch's hook vs shardkit's, through register_comm_hook and natively --------------------

POWERSGD_CASES = [  # (use_error_feedback, warm_start, batch_tensors_with_same_shape, rank)
    (True, True, False, 2), (False, False, False, 2), (True, False, True, 2), (False, True, True, 3),
]


def _powersgd_parity(rank, world):
    H = hooks()
    for ef, warm, batched, r in POWERSGD_CASES:
        options = dict(matrix_approximation_rank=r, start_powerSGD_iter=3, use_error_feedback=ef, warm_start=warm,
                       batch_tensors_with_same_shape=batched, random_seed=7)
        module = layered()
        # Several buckets (4 kB) -- except without warm start: torch's hook then clears every bucket's P and Q
        # when one bucket finishes, and a bucket still in flight fails with a KeyError (torch 2.13).
        cap = dict(bucket_cap_mb=0.004) if warm else {}
        ref = TorchDDP(copy.deepcopy(module), **cap)
        ref.register_comm_hook(torch_powersgd.PowerSGDState(None, **options), torch_powersgd.powerSGD_hook)
        via_python = TorchDDP(copy.deepcopy(module), **cap)
        state = H.PowerSGDState(None, **options)
        via_python.register_comm_hook(state, H.powerSGD_hook)
        native = TorchDDP(copy.deepcopy(module), **cap)
        H.register(native, H.PowerSGDState(None, **options), "powersgd")
        on_shardkit = shardkit_ddp()(copy.deepcopy(module), **cap)
        H.register(on_shardkit, H.PowerSGDState(None, **options), "powersgd")
        train_lock_step(rank, [ref, via_python, native, on_shardkit], STEPS, f"rank {rank} {options}")
        assert state.iter == STEPS and state.compression_stats()[0] > 1, state.compression_stats()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_powersgd_matches_torch(ranks, world):
    ranks.run(_powersgd_parity, world, timeout=120)


def _batched_parity(rank, world):
    H = hooks()
    # torch 2.13's batched hook hands its 2-D P and Q to an orthogonaliser that asserts 3-D input; the oracle
    # gets the obvious fix (a batch of one, in place) and is otherwise torch's code.
    original = torch_powersgd._orthogonalize
    torch_powersgd._orthogonalize = lambda m, epsilon=0: original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    try:
        for ef, warm in ((True, True), (False, False)):
            options = dict(matrix_approximation_rank=2, start_powerSGD_iter=3, use_error_feedback=ef,
                           warm_start=warm, random_seed=3)
            module = layered()
            cap = 0.004 if warm else None  # torch's warm_start=False clears P/Q of buckets in flight (see above)
            ref = TorchDDP(copy.deepcopy(module), bucket_cap_mb=cap)
            ref.register_comm_hook(torch_powersgd.PowerSGDState(None, **options), torch_powersgd.batched_powerSGD_hook)
            via_python = TorchDDP(copy.deepcopy(module), bucket_cap_mb=cap)
            via_python.register_comm_hook(H.PowerSGDState(None, **options), H.batched_powerSGD_hook)
            native = shardkit_ddp()(copy.deepcopy(module), bucket_cap_mb=cap)
            H.register(native, H.PowerSGDState(None, **options), "batched_powersgd")
            train_lock_step(rank, [ref, via_python, native], STEPS, f"rank {rank} batched {options}")
    finally:
        torch_powersgd._orthogonalize = original


@pytest.mark.parametrize("world", [1, 2])
def test_batched_powersgd_matches_torch(ranks, world):
    ranks.run(_batched_parity, world, timeout=120)


# --- 2. fp16 / bf16 hooks and wrappers -----------------------------------------------------------------------

def bf16_oracle(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook without its NCCL check (torch's DDP refuses hooks of that *name* on CPU)."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _cast_hooks(rank, world):
    H = hooks()
    module = layered(seed=1)
    # fp16: torch's hook vs shardkit's on torch's DDP, and shardkit's installed natively on shardkit's DDP.
    ref = TorchDDP(copy.deepcopy(module))
    ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
    via_python = TorchDDP(copy.deepcopy(module))
    via_python.register_comm_hook(None, H.fp16_compress_hook)
    native = shardkit_ddp()(copy.deepcopy(module))
    H.register(native, None, "fp16")
    train_lock_step(rank, [ref, via_python, native], 4, f"rank {rank} fp16", rtol=0)  # bitwise
    # bf16: torch's DDP refuses a hook named bf16_compress_hook on a CPU build, so shardkit's Python hook goes
    # on shardkit's DDP and the native one on torch's.
    ref = TorchDDP(copy.deepcopy(module))
    ref.register_comm_hook(None, bf16_oracle)
    via_python = shardkit_ddp()(copy.deepcopy(module))
    via_python.register_comm_hook(None, H.bf16_compress_hook)
    native = TorchDDP(copy.deepcopy(module))
    H.register(native, None, "bf16")
    train_lock_step(rank, [ref, via_python, native], 4, f"rank {rank} bf16", rtol=0)
    # The wrappers around PowerSGD (the half-precision bucket is what PowerSGD compresses). torch's bf16
    # wrapper is refused by torch's DDP on CPU as well: it runs on shardkit's.
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)
    for torch_wrapper, our_wrapper, ref_ddp in ((default_hooks.fp16_compress_wrapper, H.fp16_compress_wrapper,
                                                 TorchDDP),
                                                (default_hooks.bf16_compress_wrapper, H.bf16_compress_wrapper,
                                                 shardkit_ddp())):
        ref = ref_ddp(copy.deepcopy(module))
        ref.register_comm_hook(torch_powersgd.PowerSGDState(None, **options),
                               torch_wrapper(torch_powersgd.powerSGD_hook))
        ours = TorchDDP(copy.deepcopy(module))
        ours.register_comm_hook(H.PowerSGDState(None, **options), our_wrapper(H.powerSGD_hook))
        train_lock_step(rank, [ref, ours], 5, f"rank {rank} {torch_wrapper.__name__}", rtol=0)


def test_fp16_bf16_hooks_and_wrappers_match_torch(ranks):
    ranks.run(_cast_hooks, 2, timeout=90)


# --- 3. against a float64 reference of the algorithm ---------------------------------------------------------

def _orthonormal64(m: torch.Tensor) -> torch.Tensor:
    out = m.clone()
    for i in range(out.shape[1]):
        out[:, i] /= out[:, i].norm()
        out[:, i + 1:] -= out[:, i:i + 1] * (out[:, i:i + 1] * out[:, i + 1:]).sum(0, keepdim=True)
    return out


def _float64_reference(rank, world):
    """One 16x32 weight (no bias): a bucket holding one compressible matrix. No error feedback, no warm start,
    PowerSGD from iteration 1: step 1 is compressed, with Q drawn from the seed's first draw."""
    H = hooks()
    results = {}
    for r in (2, 16):  # 16 = min(n, m): PowerSGD must reproduce the plain average
        torch.manual_seed(0)
        model = TorchDDP(nn.Linear(32, 16, bias=False))
        state = H.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=1, use_error_feedback=False,
                                warm_start=False, min_compression_rate=0, random_seed=11)
        H.register(model, state, "powersgd")
        x = torch.randn(5 + rank, 32, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).sum().backward()  # iteration 0: a plain allreduce
        model.zero_grad()
        model(x).pow(2).sum().backward()
        local = torch.autograd.grad(model.module(x).pow(2).sum(), model.module.weight)[0].double()
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        seed = np.random.RandomState(11).randint(1_000_000_000)
        q = torch.randn(32, r, generator=torch.Generator().manual_seed(int(seed))).double()
        q = _orthonormal64(q)
        p = _orthonormal64(sum(m @ q for m in everyone))
        q = sum(m.T @ p for m in everyone) / world
        want = p @ q.T
        assert_close(model.module.weight.grad.double(), want, f"rank {rank} rank-{r} PowerSGD vs float64", rtol=1e-4,
                     atol=1e-5)
        if r == 16:
            assert_close(model.module.weight.grad.double(), sum(everyone) / world,
                         f"rank {rank} full-rank PowerSGD vs the plain average", rtol=1e-4, atol=1e-5)
        results[r] = state.compression_stats()
    return results


def test_against_float64_reference_and_full_rank_is_plain_average(ranks):
    for stats in ranks.run(_float64_reference, 3, timeout=60):
        # Elements sent, the formula: n*m before, (n + m)*r after (one compressed iteration; the plain
        # allreduces of earlier iterations are not counted, as in torch).
        assert stats[2] == (16 * 32 / ((16 + 32) * 2), 16 * 32, (16 + 32) * 2), stats
        assert stats[16] == (16 * 32 / ((16 + 32) * 16), 16 * 32, (16 + 32) * 16), stats


# --- 4. checkpoint -> resume in new processes -> identical -------------------------------------------------------

def _train_with_checkpoint(rank, world, workdir, resume):
    H = hooks()
    k, more = 4, 10
    path = Path(workdir) / f"rank{rank}.pt"
    model = shardkit_ddp()(layered(seed=5), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = H.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=9)
    H.register(model, state, "powersgd")
    start = 0
    if resume:
        saved = torch.load(path)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        state.load_state_dict(saved["powersgd"])
        model.load_bucket_layout(saved["buckets"])  # PowerSGD's state is per bucket: the same buckets
        start = k
    for step in range(start, k + more):
        if step == k and not resume:
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                        "powersgd": state.state_dict(), "buckets": model.bucket_layout()}, path)
            # Pickling (torch's other way to save a state) carries the same state.
            clone = pickle.loads(pickle.dumps(state))
            for key, value in state.state_dict().items():
                other = clone.state_dict()[key]
                assert str(other) == str(value), f"pickled PowerSGDState differs in {key}"
        opt.zero_grad()
        x, y = batch(rank, step)
        loss_fn(model(x), y).backward()
        opt.step()
    # Bytes, not tensors: a tensor crosses the result queue as a shared-memory fd, which the rank's exit races.
    return [p.detach().numpy().tobytes() for p in model.module.parameters()]


def test_checkpoint_resume_is_bit_identical(ranks):
    uninterrupted = ranks.run(_train_with_checkpoint, 2, str(ranks.workdir), False, timeout=60)
    resumed = ranks.run(_train_with_checkpoint, 2, str(ranks.workdir), True, timeout=60)
    for rank, (a, b) in enumerate(zip(uninterrupted, resumed)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x == y, f"rank {rank}: parameter {i} differs after resuming"


# --- 5. convergence -----------------------------------------------------------------------------------------------

def _convergence(rank, world):
    H = hooks()
    g = torch.Generator().manual_seed(123)
    teacher = torch.randn(32, 32, generator=g) / 32 ** 0.5
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    losses = {}
    for name in ("plain", "powersgd"):
        model = shardkit_ddp()(copy.deepcopy(module))
        if name == "powersgd":
            H.register(model, H.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10), "powersgd")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        data = torch.Generator().manual_seed(1000 + rank)
        for _step in range(200):
            x = torch.randn(16, 32, generator=data)
            loss = loss_fn(model(x), torch.tanh(x @ teacher))
            opt.zero_grad()
            loss.backward()
            opt.step()
        x = torch.randn(256, 32, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            losses[name] = loss_fn(model(x), torch.tanh(x @ teacher)).item()
    return losses


def test_powersgd_converges_like_uncompressed(ranks):
    for rank, losses in enumerate(ranks.run(_convergence, 4, timeout=120)):
        assert losses["powersgd"] <= 1.05 * losses["plain"], f"rank {rank}: {losses}"


# --- 6. errors --------------------------------------------------------------------------------------------------

def _errors(rank, world):
    H = hooks()
    messages = {}

    def error_of(fn, kind):
        return error_of_rank(fn, kind, rank)

    messages["start_iter"] = error_of(lambda: H.PowerSGDState(None, start_powerSGD_iter=1), ValueError)
    messages["option"] = error_of(lambda: setattr(H.PowerSGDState(None), "matrix_approximation_rank", 4),
                                  AttributeError)
    model = TorchDDP(layered())
    H.register(model, H.PowerSGDState(None), "powersgd")
    messages["twice"] = error_of(lambda: H.register(model, H.PowerSGDState(None), "powersgd"), RuntimeError)
    ours = shardkit_ddp()(layered())
    ours.register_comm_hook(H.PowerSGDState(None), H.powerSGD_hook)
    messages["twice_shardkit"] = error_of(lambda: H.register(ours, None, "fp16"), RuntimeError)
    pair = dist.new_group([0, 1])  # every rank creates it; rank 2 is not in it
    on_world = TorchDDP(layered())  # DDP construction is a collective: on every rank
    if rank < 2:
        messages["group"] = error_of(lambda: H.register(on_world, H.PowerSGDState(pair), "powersgd"), ValueError)
    messages["kind"] = error_of(lambda: H.register(on_world, None, "int8"), ValueError)
    messages["state"] = error_of(lambda: H.register(on_world, None, "powersgd"), TypeError)
    return messages


def test_errors(ranks):
    for rank, m in enumerate(ranks.run(_errors, 3, timeout=60)):
        assert "start_powerSGD_iter" in m["start_iter"], m
        assert "matrix_approximation_rank is fixed" in m["option"], m
        assert "can only be called once" in m["twice"] and "can only be called once" in m["twice_shardkit"], m
        if rank < 2:
            assert f"rank {rank}" in m["group"] and "[0, 1]" in m["group"] and "[0, 1, 2]" in m["group"], m
        assert "int8" in m["kind"] and "PowerSGDState" in m["state"], m


def _non_float_bucket(rank, world):
    H = hooks()
    # Complex parameters give shardkit's DDP a complex bucket (gloo group: the shardkit backend has no complex).
    model = shardkit_ddp()(nn.Linear(4, 4, dtype=torch.complex64))
    H.register(model, H.PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False),
               "powersgd")
    x = torch.randn(3, 4, dtype=torch.complex64)
    try:
        model(x).abs().sum().backward()
    except RuntimeError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: a complex bucket was compressed")


def test_non_float_bucket_is_refused(ranks):
    for rank, message in enumerate(ranks.run(_non_float_bucket, 2, backend="gloo", timeout=60)):
        assert f"rank {rank}" in message and "floating-point" in message and "ComplexFloat" in message, message

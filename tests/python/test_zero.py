"""shardkit.ZeroRedundancyOptimizer (ZeRO-1 and, with shardkit DDP's zero_stage=2, ZeRO-2) against torch DDP +
the unsharded optimizer.

Approach: on every rank one seeded module is deep-copied into torch's DDP with a plain optimizer (the
oracle) and into shardkit's DDP with ZeroRedundancyOptimizer over the same optimizer class; both are trained
in lock step on the same per-rank batches (ddp_cases.batch: ranks differ in data and batch size) and the
parameters are compared after every step (fp32: rtol 1e-5, atol 1e-6). Each parity test runs with
shardkit DDP's zero_stage 1 (gradients allreduced, the optimizer shards its state) and 2 (each bucket
reduced to its owners; the gradients compared are then this rank's gradient shard against the owned slice
of torch's .grad, and every .grad must be None).

What each test can catch:
- parity: a shard stepped with the wrong gradient slice, a piece written back to the wrong place, padding
  leaking into parameters, ranks left with different parameters, a parameter with grad None updated
  (weight decay / momentum on an unused branch), a param group's options not applied;
- state bytes: optimizer state for more than the owned slice (a full copy, state for padding);
- consolidated state: anything but exactly the unsharded optimizer's state_dict (indices, shapes, split
  parameters stitched back in the wrong order, scalars such as Adam's step, param_groups options);
- checkpoint: a resumed run that is not bit-identical to the uninterrupted one;
- errors: state_dict() that silently returns nothing or stale state;
- ZeRO-2 memory: any whole gradient or bucket buffer left alive after backward, a shard of the wrong size;
- ZeRO-2 accumulation: a shard overwritten (not added to) by a second backward, or not cleared by zero_grad;
- DDP-owned partition: gradients of a backward run before the optimizer existed lost or misplaced, an
  optimizer whose groups interleave the partition's order misnumbered, parameters that stop being views of
  the DDP's flat buffer (an all-gather that copies instead of landing in place), padding overwritten.
The in-place all-gather itself (input aliasing its slice of the output) is checked on shardkit and gloo in
test_collectives.py.

The models are tiny (< 1,500 parameters); mlp() has 1,476 parameters (divisible by 2 and 3), odd_net()
127 trainable (127 = 6*21 + 1: padded for both world sizes, and a parameter straddles every slice boundary).
"""

from __future__ import annotations

import copy
import gc
import math
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from shardkit.optim import OffloadedAdam, OffloadedAdamW
from support.ddp_cases import IN, OUT, assert_close, assert_modules_match, batch, gloo_world, loss_fn, mlp, shardkit_ddp
from support.ddp_cases import error_of as error_of_rank

WORLDS = [2, 3]
STAGES = [1, 2]
STEPS = 6


def zero_optimizer() -> type:
    import shardkit

    return shardkit.ZeroRedundancyOptimizer


# --- models and optimizers ----------------------------------------------------------------------------

class OddNet(nn.Module):
    """127 trainable parameters in two param groups, a frozen parameter, and a head used only sometimes."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, 7)  # 63
        self.head_a = nn.Linear(7, OUT)  # 32
        self.head_b = nn.Linear(7, OUT)  # 32, left out of the graph when use_b=False
        self.scale = nn.Parameter(torch.full((OUT,), 0.5), requires_grad=False)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.head_a(h) + (self.head_b(h) if use_b else 0)
        return out * self.scale


def odd_net(seed: int = 0) -> OddNet:
    torch.manual_seed(seed)
    return OddNet()


def odd_groups(module: OddNet) -> list[dict]:
    """Two groups with their own options; the frozen ``scale`` sits in the second (the optimizer sees it)."""
    return [{"params": list(module.trunk.parameters()), "lr": 0.02, "weight_decay": 0.1},
            {"params": [*module.head_a.parameters(), *module.head_b.parameters(), module.scale]}]


OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
}


# --- helpers --------------------------------------------------------------------------------------------

class ZeroPair:
    """torch DDP on gloo + ``optimizer_class`` (the oracle) and shardkit DDP(zero_stage=stage) on the default
    shardkit group + ZeroRedundancyOptimizer(optimizer_class)."""

    def __init__(self, module: nn.Module, optimizer_class, defaults: dict, groups=lambda m: m.parameters(),
                 stage: int = 1, build_optimizers: bool = True, **ddp_kwargs) -> None:
        self.ref = TorchDDP(copy.deepcopy(module), process_group=gloo_world(), **ddp_kwargs)
        self.dut = shardkit_ddp()(copy.deepcopy(module), zero_stage=stage, **ddp_kwargs)
        self.make_optimizers = lambda: (optimizer_class(groups(self.ref.module), **defaults),
                                        zero_optimizer()(groups(self.dut.module), optimizer_class, **defaults))
        if build_optimizers:
            self.ref_opt, self.dut_opt = self.make_optimizers()
        self.stage = stage
        self.name = f"{optimizer_class.__name__} zero_stage={stage}"

    def backward(self, rank: int, step: int, micro: int = 0, **forward_kwargs) -> None:
        x, y = batch(rank, step, micro)
        for model in (self.ref, self.dut):
            loss_fn(model(x, **forward_kwargs), y).backward()

    def check_grads(self, where: str) -> None:
        if self.stage == 2:
            assert_shard_grads_match(self.ref_opt, self.dut_opt, where)
        else:
            assert_modules_match(self.ref.module, self.dut.module, where, grads=True)

    def step(self, rank: int, step: int, **forward_kwargs) -> None:
        self.ref_opt.zero_grad()
        self.dut_opt.zero_grad()
        self.backward(rank, step, **forward_kwargs)
        where = f"{self.name} rank {rank} step {step}"
        self.check_grads(f"{where} after backward")
        self.ref_opt.step()
        self.dut_opt.step()
        assert_modules_match(self.ref.module, self.dut.module, f"{where} after optimizer step")


def assert_shard_grads_match(ref_opt: torch.optim.Optimizer, zero, where: str) -> None:
    """ZeRO-2: every .grad of the model is None, and each piece's view of the gradient shard equals the owned
    slice of torch's .grad (or the parameter has no gradient on either side)."""
    for group in zero.param_groups:
        for i, p in enumerate(group["params"]):
            assert p.grad is None, f"{where}: parameter {i} kept a whole .grad under zero_stage=2"
    ref_params = [p for group in ref_opt.param_groups for p in group["params"]]
    defined = zero._zero2.reducer.shard_gradient_defined()
    for piece in zero._pieces:
        want = ref_params[piece.index].grad
        has = defined[piece.ddp_index]
        only = "shardkit" if has else "torch"
        assert has == (want is not None), f"{where}: parameter {piece.index} has a gradient in {only} only"
        if want is not None:
            owned = want.reshape(-1)[piece.start:piece.start + piece.numel].view(piece.leaf.shape)
            assert_close(piece.grad_view, owned, f"{where}: parameter {piece.index} gradient shard")


def flat_params(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def assert_ranks_identical(flats: list[list[float]]) -> None:
    for rank, flat in enumerate(flats[1:], start=1):
        assert flat == flats[0], f"rank {rank}'s parameters differ from rank 0's"


def assert_state_dicts_match(got: dict, want: dict, where: str, exact: bool = False) -> None:
    """``got`` has exactly ``want``'s structure, indices, options, shapes and dtypes; tensors allclose (or equal)."""
    assert got["param_groups"] == want["param_groups"], f"{where}: param_groups differ: {got['param_groups']} vs " \
                                                        f"{want['param_groups']}"
    assert sorted(got["state"]) == sorted(want["state"]), (
        f"{where}: state for parameters {sorted(got['state'])}, expected {sorted(want['state'])}")
    for index, want_state in want["state"].items():
        got_state = got["state"][index]
        assert sorted(got_state) == sorted(want_state), f"{where}: parameter {index} state keys differ"
        for key, w in want_state.items():
            g = got_state[key]
            what = f"{where}: parameter {index} state {key!r}"
            if isinstance(w, torch.Tensor):
                assert isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype, (
                    f"{what}: {g!r} vs {w!r}")
                if exact:
                    assert torch.equal(g, w), f"{what} is not bit-identical"
                else:
                    assert_close(g, w, what)
            else:
                assert g == w, f"{what}: {g!r} vs {w!r}"


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's elementwise optimizer state (m and v for Adam), from the tensors themselves.
    0-dim tensors (Adam's step count, one per parameter piece) are not model-sized and not counted, as in
    shardkit.estimate."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


# --- 1. parity with torch DDP + the unsharded optimizer ---------------------------------------------------

def _mlp_parity(rank, world, stage):
    flats = []
    for name, (optimizer_class, defaults) in OPTIMIZERS.items():  # one launch for both: ranks start slowly
        pair = ZeroPair(mlp(seed=100 + rank), optimizer_class, defaults, stage=stage)  # rank 0's init wins
        for step in range(STEPS):
            pair.step(rank, step)
        # Consolidated to the last rank (not the default 0): exactly the unsharded optimizer's state_dict.
        pair.dut_opt.consolidate_state_dict(to=world - 1)
        if rank == world - 1:
            assert_state_dicts_match(pair.dut_opt.state_dict(), pair.ref_opt.state_dict(), f"{name} rank {rank}")
        # The other way: a ZeroRedundancyOptimizer loaded from the unsharded optimizer's state_dict continues
        # in lock step with it.
        if stage == 2:  # one optimizer per zero_stage=2 model: a fresh model too
            pair.dut = shardkit_ddp()(copy.deepcopy(pair.dut.module), zero_stage=stage)
        pair.dut_opt = zero_optimizer()(pair.dut.module.parameters(), optimizer_class, **defaults)
        pair.dut_opt.load_state_dict(pair.ref_opt.state_dict())
        for step in range(STEPS, STEPS + 2):
            pair.step(rank, step)
        flats.append(flat_params(pair.dut.module))
    return flats


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", WORLDS)
def test_mlp_matches_torch_ddp_with_unsharded_optimizer(ranks, world, stage):
    """SGD with momentum, then AdamW: 6 steps, consolidated state, 2 more steps after loading the unsharded
    optimizer's state_dict into a fresh ZeroRedundancyOptimizer."""
    for flats in zip(*ranks.run(_mlp_parity, world, stage, timeout=60)):
        assert_ranks_identical(list(flats))


# Whether rank r uses head_b at each step: everyone, no one, only rank 0, no one, everyone, all but rank 0.
_USES_HEAD_B = [lambda r: True, lambda r: False, lambda r: r == 0, lambda r: False, lambda r: True,
                lambda r: r != 0]


def _padding_groups_unused(rank, world, stage):
    pair = ZeroPair(odd_net(), torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}, odd_groups, stage=stage,
                    find_unused_parameters=True)
    # An LR scheduler drives both through param_groups (per-group lrs, "initial_lr" added to the groups).
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)
                  for opt in (pair.ref_opt, pair.dut_opt)]
    for step, uses in enumerate(_USES_HEAD_B):
        before = [p.detach().clone() for p in pair.dut.module.head_b.parameters()]
        pair.step(rank, step, use_b=uses(rank))
        for scheduler in schedulers:
            scheduler.step()
        if not any(uses(r) for r in range(world)):
            # grad None on every rank: skipped like the unsharded optimizer does (no weight decay applied).
            for old, p in zip(before, pair.dut.module.head_b.parameters()):
                assert torch.equal(p.detach(), old), f"step {step}: unused head_b moved"
    pair.dut_opt.consolidate_state_dict()
    if rank == 0:
        assert_state_dicts_match(pair.dut_opt.state_dict(), pair.ref_opt.state_dict(), f"rank {rank}")
    return flat_params(pair.dut.module)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", WORLDS)
def test_padding_param_groups_frozen_and_unused_parameters(ranks, world, stage):
    """127 trainable parameters (padded), two groups with their own options and an LR scheduler, a frozen
    parameter, a head with grad None on some steps (find_unused_parameters=True)."""
    assert_ranks_identical(ranks.run(_padding_groups_unused, world, stage, timeout=60))


# Every optimizer ZeroRedundancyOptimizer calls exact, with options that exercise its state.
ELEMENTWISE_CASES = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    (torch.optim.Adamax, {"lr": 1e-2, "weight_decay": 0.01}),
    (torch.optim.NAdam, {"lr": 1e-2, "momentum_decay": 4e-3}),
    (torch.optim.RAdam, {"lr": 1e-2}),  # the rectified update starts after step 5
    (torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.9}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.ASGD, {"lr": 1e-2, "t0": 2}),
    (torch.optim.Rprop, {"lr": 1e-2}),
    # shardkit's, their moments in a file under the temp dir (one per optimizer, removed with it)
    (OffloadedAdamW, {"lr": 1e-2, "amsgrad": True, "path": tempfile.gettempdir(), "chunk_bytes": 4096}),
    (OffloadedAdam, {"lr": 1e-2, "weight_decay": 0.01, "path": tempfile.gettempdir()}),
]


def _every_elementwise_optimizer(rank, world):
    from shardkit.zero import ELEMENTWISE_OPTIMIZERS

    assert {cls for cls, _ in ELEMENTWISE_CASES} == set(ELEMENTWISE_OPTIMIZERS)
    # 94 elements: a 0-dim parameter, parameters split across slices, 2 elements of padding at world 3.
    shapes = [(7, 8), (5,), (), (4, 7), (4,)]
    for cls, defaults in ELEMENTWISE_CASES:
        torch.manual_seed(0)
        ref = [nn.Parameter(torch.randn(shape)) for shape in shapes]
        dut = [nn.Parameter(p.detach().clone()) for p in ref]
        ref_opt, dut_opt = cls(ref, **defaults), zero_optimizer()(dut, cls, **defaults)
        where = f"rank {rank} {cls.__name__}({defaults})"
        for step in range(7):
            g = torch.Generator().manual_seed(step)  # the same "allreduced" gradients on every rank
            for a, b in zip(ref, dut):
                a.grad = torch.randn(a.shape, generator=g)
                b.grad = a.grad.clone()
            if step == 3:
                ref[1].grad = dut[1].grad = None  # skipped by both
            ref_opt.step()
            dut_opt.step()
            for i, (a, b) in enumerate(zip(ref, dut)):
                assert_close(b, a, f"{where} step {step} parameter {i}")
        dut_opt.consolidate_state_dict()
        if rank == 0:
            assert_state_dicts_match(dut_opt.state_dict(), ref_opt.state_dict(), where)
        # Round trip: a fresh one loaded from the unsharded state continues identically.
        fresh = zero_optimizer()(dut, cls, **defaults)
        fresh.load_state_dict(ref_opt.state_dict())
        for opt in (ref_opt, fresh):
            opt.step()
        for i, (a, b) in enumerate(zip(ref, dut)):
            assert_close(b, a, f"{where} after load_state_dict, parameter {i}")


def test_every_elementwise_optimizer_matches_unsharded(ranks):
    ranks.run(_every_elementwise_optimizer, 3, timeout=60)


# --- 2. optimizer-state bytes: 1/N of the unsharded ones, + padding ---------------------------------------

def _state_bytes(rank, world):
    """World 3 on WORLD, and world 2 on the process group of ranks 0 and 1 (the process_group argument)."""
    from shardkit import estimate

    pair_group = dist.new_group([0, 1])  # every rank creates it; rank 2 is not in it
    out = {}
    for n, group in ((3, None), (2, pair_group)):
        if rank >= n:
            continue
        for name, module in (("mlp", mlp()), ("odd_net", odd_net())):
            trainable = [p for p in module.parameters() if p.requires_grad]
            plain = torch.optim.Adam(trainable, lr=1e-3)
            zero = zero_optimizer()(trainable, torch.optim.Adam, group, lr=1e-3)
            assert (zero.world_size, zero.rank) == (n, rank)
            for p in trainable:
                p.grad = torch.ones_like(p)
            plain.step()  # state allocated for every parameter
            zero.step()
            numel = sum(p.numel() for p in trainable)
            states = estimate.model_states(numel, n, "fp32", "adam")
            out[n, name] = {"numel": numel, "unsharded": local_state_bytes(plain),
                            "local": local_state_bytes(zero.optim), "shard": sum(s.shard_numel for s in zero._spaces),
                            "zero1": states["zero1"].optimizer_bytes, "ddp": states["ddp"].optimizer_bytes}
    return out


def test_optimizer_state_bytes_are_one_nth(ranks):
    results = ranks.run(_state_bytes, 3, timeout=60)
    for world in WORLDS:
        for name in ("mlp", "odd_net"):
            rows = [r[world, name] for r in results[:world]]
            numel = rows[0]["numel"]
            padded = math.ceil(numel / world) * world
            assert rows[0]["unsharded"] == 8 * numel == rows[0]["ddp"]  # fp32 Adam: m + v = 8 bytes/param
            for rank, row in enumerate(rows):
                where = f"world {world} {name} rank {rank}"
                owned = min(numel, (rank + 1) * padded // world) - min(numel, rank * padded // world)
                assert row["shard"] == padded // world, f"{where}: shard of {row['shard']} elements"
                # Exactly the owned elements: 8 * padded / N, less the padding this rank holds (no state for it).
                assert row["local"] == 8 * owned, f"{where}: {row['local']} bytes, expected 8 * {owned}"
                assert row["local"] == pytest.approx(row["zero1"], abs=8 * (padded - numel))  # estimate: o * Psi / N
            assert max(r["local"] for r in rows) == 8 * padded // world
            assert sum(r["local"] for r in rows) == rows[0]["unsharded"]  # nothing stored twice
        # mlp's 1,476 parameters divide evenly: every rank holds exactly estimate's ZeRO-1 optimizer figure.
        mlp_rows = [r[world, "mlp"] for r in results[:world]]
        assert {r["local"] for r in mlp_rows} == {mlp_rows[0]["zero1"]} == {8 * 1476 // world}
        assert (1476 % world, 127 % world) == (0, 1)  # self-check: one model padded, one not


# --- 3. checkpoint -> reload -> identical continuation -------------------------------------------------------

def _checkpoint_resume(rank, world, stage, workdir):
    path = Path(workdir) / "checkpoint.pt"
    Ddp, Zero, k = shardkit_ddp(), zero_optimizer(), 3

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            opt.step()

    model = Ddp(mlp(seed=0), zero_stage=stage)
    opt = Zero(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    train(model, opt, range(k))
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)
    dist.barrier()
    train(model, opt, range(k, 2 * k))
    opt.consolidate_state_dict(to=0)
    uninterrupted = (list(model.module.parameters()), opt.state_dict() if rank == 0 else None)

    checkpoint = torch.load(path)
    fresh_model = Ddp(mlp(seed=7), zero_stage=stage)  # different init: everything must come from the checkpoint
    fresh_model.module.load_state_dict(checkpoint["model"])
    fresh_opt = Zero(fresh_model.parameters(), torch.optim.AdamW, lr=0.5)  # options too
    fresh_opt.load_state_dict(checkpoint["optim"])
    train(fresh_model, fresh_opt, range(k, 2 * k))
    for i, (a, b) in enumerate(zip(uninterrupted[0], fresh_model.module.parameters())):
        assert torch.equal(a, b), f"rank {rank}: parameter {i} differs after resuming"
    fresh_opt.consolidate_state_dict(to=0)
    if rank == 0:
        assert_state_dicts_match(fresh_opt.state_dict(), uninterrupted[1], "resumed vs uninterrupted", exact=True)
        # The checkpoint is an ordinary AdamW state_dict: the unsharded optimizer loads it as is.
        plain = torch.optim.AdamW(mlp().parameters())
        plain.load_state_dict(checkpoint["optim"])
        assert_state_dicts_match(plain.state_dict(), checkpoint["optim"], "unsharded AdamW", exact=True)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", WORLDS)
def test_checkpoint_resume_is_bit_identical(ranks, world, stage):
    ranks.run(_checkpoint_resume, world, stage, str(ranks.workdir), timeout=60)


# --- 4. ZeRO-2: gradient memory, accumulation, clipping, comm hooks, errors -----------------------------------

def _zero2_specifics(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    Ddp, Zero = shardkit_ddp(), zero_optimizer()
    # Every parameter in a bucket of its own (a 1 kB cap), so buckets straddle slice boundaries and some are
    # reduced to two owners; torch's DDP gets the same cap.
    pair = ZeroPair(mlp(), torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, stage=2, bucket_cap_mb=0.001)
    shard = math.ceil(1476 / world)
    for step in range(4):
        where = f"rank {rank} step {step}"
        pair.ref_opt.zero_grad()
        pair.dut_opt.zero_grad()
        with pair.ref.no_sync(), pair.dut.no_sync():  # accumulated locally in .grad, as in torch
            pair.backward(rank, step, micro=0)
        pair.backward(rank, step, micro=1)  # synchronised: includes the no_sync gradients
        pair.backward(rank, step, micro=2)  # a second synchronised backward adds to the shard, as to .grad
        pair.check_grads(f"{where} after accumulation")
        # Between backwards only the shard is left: no .grad, no bucket buffer, S elements of fp32.
        assert pair.dut.reducer.bucket_buffers() == [], f"{where}: bucket buffers outlived backward"
        assert [t.numel() * t.element_size() for t in pair.dut_opt.gradient_shards] == [4 * shard], where
        want = torch.nn.utils.clip_grad_norm_(pair.ref.module.parameters(), max_norm=0.05)
        got = pair.dut_opt.clip_grad_norm_(max_norm=0.05)
        assert_close(got, want, f"{where}: clip_grad_norm_ total norm")
        assert want > 0.05, f"{where}: the test's max_norm no longer clips ({want})"
        pair.check_grads(f"{where} after clipping")
        pair.ref_opt.step()
        pair.dut_opt.step()
        assert_modules_match(pair.ref.module, pair.dut.module, f"{where} after optimizer step")

    # zero_grad(set_to_none=False) keeps the gradients defined, at zero (momentum still applies, as in torch).
    pair.ref_opt.zero_grad(set_to_none=False)
    pair.dut_opt.zero_grad(set_to_none=False)
    pair.check_grads(f"rank {rank} after zero_grad(set_to_none=False)")

    # A comm hook (torch's allreduce_hook) still runs under zero_stage=2; each rank keeps its share.
    hooked = ZeroPair(mlp(seed=3), torch.optim.AdamW, {"lr": 1e-2}, stage=2)
    hooked.ref.register_comm_hook(gloo_world(), default_hooks.allreduce_hook)
    hooked.dut.register_comm_hook(None, default_hooks.allreduce_hook)
    for step in range(3):
        hooked.step(rank, step)

    errors = {}

    def error_of(fn, kind):
        return error_of_rank(fn, kind, rank)

    errors["bucket_view"] = error_of(lambda: Ddp(mlp(), zero_stage=2, gradient_as_bucket_view=True), RuntimeError)
    partial = Ddp(mlp(), zero_stage=2)
    errors["subset"] = error_of(lambda: Zero(list(partial.parameters())[:-2], torch.optim.SGD, lr=0.1), ValueError)
    twice = Ddp(mlp(), zero_stage=2)
    first = Zero(twice.parameters(), torch.optim.SGD, lr=0.1)  # while it lives, no second one steps the shards
    errors["twice"] = error_of(lambda: Zero(twice.parameters(), torch.optim.SGD, lr=0.1), RuntimeError)
    del first  # the DDP owns the shards, not the optimizer: a replacement may attach once the first is gone
    gc.collect()
    assert Zero(twice.parameters(), torch.optim.SGD, lr=0.1).gradient_shards[0] is twice.gradient_shards[0]
    return errors


def test_zero2_memory_accumulation_clipping_hooks_and_errors(ranks):
    for rank, errors in enumerate(ranks.run(_zero2_specifics, 3, timeout=90)):
        assert f"rank {rank}" in errors["bucket_view"] and "gradient_as_bucket_view" in errors["bucket_view"], errors
        assert f"rank {rank}" in errors["subset"] and "missing: ['4.weight', '4.bias']" in errors["subset"], errors
        assert f"rank {rank}" in errors["twice"] and "already attached" in errors["twice"], errors


# --- 5. the DDP owns the partition: the optimizer may come after a backward, and gathers in place ------------

def _optimizer_after_backward(rank, world, stage):
    """Forward + backward through a zero_stage DDP before any optimizer exists, then the optimizers and
    steps: the same parameters as torch DDP + the unsharded AdamW (on gloo). Many buckets (1 kB cap), so
    buckets straddle the slice boundaries."""
    pair = ZeroPair(mlp(seed=5), torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}, stage=stage,
                    build_optimizers=False, bucket_cap_mb=0.001)
    shard = math.ceil(1476 / world)
    # The DDP laid the trainable parameters out at construction: views of one flat fp32 buffer of N * S.
    (space,) = pair.dut._zero_partition.spaces
    assert space.flat.numel() == shard * world and space.layout.shard_numel == shard
    storage = space.flat.untyped_storage().data_ptr()
    for name, p in pair.dut.module.named_parameters():
        assert p.untyped_storage().data_ptr() == storage, f"rank {rank}: {name} is not a view of the flat buffer"
    pair.backward(rank, 0)
    if stage == 2:  # the gradients wait in the DDP's own shard
        assert all(p.grad is None for p in pair.dut.parameters())
        assert [t.numel() for t in pair.dut.gradient_shards] == [shard]

    pair.ref_opt, pair.dut_opt = pair.make_optimizers()
    if stage == 2:
        assert pair.dut_opt.gradient_shards[0] is pair.dut.gradient_shards[0]
    where = f"rank {rank} zero_stage={stage}"
    pair.check_grads(f"{where}: gradients of the backward before the optimizer existed")
    pair.ref_opt.step()
    pair.dut_opt.step()
    assert_modules_match(pair.ref.module, pair.dut.module, f"{where}: first step")
    for step in range(1, 4):
        pair.step(rank, step)
    for name, p in pair.dut.module.named_parameters():  # the steps' all-gathers landed in place
        assert p.untyped_storage().data_ptr() == storage, f"rank {rank}: {name} left the flat buffer"
    assert torch.count_nonzero(space.flat[1476:]) == 0, f"rank {rank}: padding no longer zero"
    return flat_params(pair.dut.module)


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_built_after_backward_reads_the_ddp_partition(ranks, stage):
    assert_ranks_identical(ranks.run(_optimizer_after_backward, 3, stage, timeout=60))


def _decay_groups(module: nn.Module) -> list[dict]:
    """transformers' Trainer's groups: weight decay on the matrices, none on biases; the second group first, so
    the optimizer's order interleaves and reverses the partition's (the model's)."""
    params = list(module.parameters())
    return [{"params": [p for p in params if p.dim() == 1][::-1], "weight_decay": 0.0},
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1}]


def _interleaved_groups(rank, world, stage):
    pair = ZeroPair(mlp(seed=7), torch.optim.AdamW, {"lr": 1e-2}, groups=_decay_groups, stage=stage)
    for step in range(STEPS):
        pair.step(rank, step)
    pair.dut_opt.consolidate_state_dict(to=0)
    if rank == 0:  # indexed by the optimizer's own numbering, as the unsharded optimizer's
        assert_state_dicts_match(pair.dut_opt.state_dict(), pair.ref_opt.state_dict(), f"zero_stage={stage}")
    return flat_params(pair.dut.module)


@pytest.mark.parametrize("stage", STAGES)
def test_param_groups_that_interleave_the_model_order_train_as_the_unsharded_optimizer(ranks, stage):
    """Before, the DDP-owned partition refused an optimizer whose parameters came in another order than the
    model's, so transformers' Trainer (decay / no-decay groups) could not use ZeRO."""
    assert_ranks_identical(ranks.run(_interleaved_groups, 3, stage, timeout=60))


# --- 6. errors and warnings -----------------------------------------------------------------------------------

def _errors(rank, world):
    Zero = zero_optimizer()
    model = mlp()
    opt = Zero(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    messages = {}

    def error_of(fn, kind=RuntimeError):
        return error_of_rank(fn, kind, rank)

    # Before any step there is no state to consolidate: every rank answers as the unsharded optimizer would
    # (accelerate's prepare calls state_dict() right away).
    messages["fresh"] = opt.state_dict()
    messages["plain_fresh"] = torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9).state_dict()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    messages["before"] = error_of(opt.state_dict)
    opt.consolidate_state_dict(to=1)
    if rank == 1:
        opt.state_dict()
    else:
        messages["elsewhere"] = error_of(opt.state_dict)
    opt.step()
    if rank == 1:
        messages["stale"] = error_of(opt.state_dict)
    # step(closure): called once, its loss returned.
    x, y = batch(rank, 0)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad, loss
    messages["bad_to"] = error_of(lambda: opt.consolidate_state_dict(to=world), ValueError)
    messages["add_group"] = error_of(lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]}),
                                     NotImplementedError)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Zero(model.parameters(), torch.optim.AdamW, lr=1e-3)
        Zero(model.parameters(), torch.optim.Adafactor, lr=1e-2)
        Zero(model.parameters(), torch.optim.Adafactor, lr=1e-2)  # warned once per class
    messages["warnings"] = [str(w.message) for w in caught if "ZeroRedundancyOptimizer" in str(w.message)]

    # Ranks given different parameters are told so, on every rank.
    params = mlp().parameters() if rank == 0 else nn.Linear(IN, 3).parameters()
    messages["mismatch"] = error_of(lambda: Zero(params, torch.optim.SGD, lr=0.1))
    return messages


def test_errors_and_warnings(ranks):
    results = ranks.run(_errors, 2, timeout=60)
    for rank, m in enumerate(results):
        assert m["fresh"] == m["plain_fresh"], (m["fresh"], m["plain_fresh"])
        assert f"rank {rank}" in m["before"] and "consolidate_state_dict(to=" in m["before"], m["before"]
        assert "0..1" in m["bad_to"] and "got 2" in m["bad_to"], m["bad_to"]
        assert "add_param_group" in m["add_group"], m["add_group"]
        assert f"rank {rank}" in m["mismatch"] and "different parameters" in m["mismatch"], m["mismatch"]
        assert len(m["warnings"]) == 1 and "Adafactor" in m["warnings"][0], m["warnings"]
    assert "rank 0" in results[0]["elsewhere"] and "consolidated to rank 1" in results[0]["elsewhere"]
    assert "rank 1" in results[1]["stale"] and "stepped since" in results[1]["stale"]


# --- 6. full model state dicts are the user's: unchanged by the next step ----------------------------------------

def _full_state_dicts_are_copies(rank, world, stage):
    """Under zero_stage 1|2 the parameters are views of the DDP's flat buffer, which every step updates in place:
    a full state dict (torch.distributed.checkpoint.state_dict's options, or FSDP1's state_dict_type context) must
    hand out values of their own, equal to the model's, that stay as they were after the next step."""
    from shardkit.fsdp import FullStateDictConfig
    from shardkit.state_dict import StateDictOptions, get_model_state_dict

    pair = ZeroPair(mlp(), torch.optim.AdamW, {"lr": 1e-2}, stage=stage)
    pair.step(rank, 0)
    takers = {
        "get_model_state_dict(full_state_dict=True)":
            lambda: get_model_state_dict(pair.dut, options=StateDictOptions(full_state_dict=True)),
        "get_model_state_dict(full_state_dict=True, cpu_offload=True)":
            lambda: get_model_state_dict(pair.dut, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        "FULL_STATE_DICT(offload_to_cpu=True)": lambda: _full_state_dict(pair.dut, FullStateDictConfig(True)),
    }
    for step, (how, take) in enumerate(takers.items(), start=1):
        where = f"rank {rank}, zero_stage={stage}, {how}"
        got = take()
        want = {k.removeprefix("module."): v for k, v in pair.ref.module.state_dict().items()}
        if how.endswith("cpu_offload=True)") and rank != 0:
            assert got == {}, where  # rank0_only, as torch's
        else:
            assert sorted(k.removeprefix("module.") for k in got) == sorted(want), where
        captured = {k: v.clone() for k, v in got.items()}
        for key, value in got.items():
            assert value.untyped_storage().nbytes() == value.nbytes > 0, (where, key)
            assert_close(value, want[key.removeprefix("module.")], f"{where}: {key}")
        pair.step(rank, step)
        for key, value in got.items():
            assert torch.equal(value, captured[key]), f"{where}: {key} changed with the next step"


def _full_state_dict(model, config):
    from shardkit import FullyShardedDataParallel as FSDP
    from shardkit.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


@pytest.mark.parametrize("stage", STAGES)
def test_full_state_dicts_are_copies_unchanged_by_the_next_step(ranks, stage):
    ranks.run(_full_state_dicts_are_copies, 2, stage, timeout=60)

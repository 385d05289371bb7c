"""shardkit.FullyShardedDataParallel against torch DDP on gloo (fsdp_cases.FsdpPair): same module, data and
optimizer; the FSDP model's gathered full state dict must equal the DDP model's after every step (fp32,
rtol 1e-5).

What each test can catch:
- strategies: a shard stepped with the wrong gradient slice, a missing 1/N, padding leaking into parameters,
  a full buffer freed while backward still reads it (garbage or a crash), a stale full buffer used after the
  optimizer step, a reduce-scatter mismatched with an all-gather across ranks;
- nested units / uneven / empty shards: views at the wrong offset, an alignment gap or padding element
  counted as a parameter, a rank without a piece failing;
- tied / frozen / parameter groups: a parameter owned twice (double gradient), a frozen parameter given
  gradient memory or updated, weight decay applied by the wrong group;
- no_sync, clip_grad_norm_, summon_full_params: accumulation lost or doubled, a norm over one shard only,
  writeback ignored or applied when it must not be;
- counts and memory: an extra or missing collective per step, more than two units gathered at once;
- errors: the messages name the rank, the unit, the offending value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support.ddp_cases import assert_close, error_of
from support.fsdp_cases import OPTIMIZERS, Block, FsdpPair, adamw, batch, block_policy, net, sgd

STEPS = 5


def _strategies(rank: int, world: int, backend: str) -> list[tuple[str, float, float]]:
    from shardkit.fsdp import ShardingStrategy

    losses = []
    for strategy in ShardingStrategy:
        if strategy == ShardingStrategy.HYBRID_SHARD:
            continue  # test_fsdp_models.py: it needs simulated hosts
        for name, optimizer in OPTIMIZERS.items():
            pair = FsdpPair(net(), optimizer, dut_backend=backend, sharding_strategy=strategy,
                            auto_wrap_policy=block_policy())
            for step in range(STEPS):
                ref, dut = pair.step(rank, step)
                losses.append((f"{strategy.name}/{name}/{step}", ref, dut))
    return losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_each_strategy_matches_torch_ddp(ranks, world):
    for rank_losses in ranks.run(_strategies, world, "shardkit", timeout=220):
        for where, ref, dut in rank_losses:
            assert dut == pytest.approx(ref, rel=1e-5), where


@pytest.mark.timeout(240)
def test_full_shard_on_gloo_matches_torch_ddp(ranks):
    ranks.run(_strategies, 2, "gloo", timeout=220)


def _layouts(rank: int, world: int) -> None:
    import functools

    from shardkit.wrap import lambda_auto_wrap_policy, size_based_auto_wrap_policy

    # Nested units (a Block and, inside it, its `up` layer), size-based units, numels that are not a multiple
    # of the world size, a tied weight across two units.
    cases = {
        "nested": dict(module=net(depth=2), auto_wrap_policy=functools.partial(
            lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block) or m.__class__ is nn.Linear
            and m.out_features == 32)),
        "size": dict(module=net(depth=2), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy,
                                                                            min_num_params=100)),
        "tied": dict(module=net(tied=True), auto_wrap_policy=block_policy()),
        "odd": dict(module=net(depth=1, d_in=7), auto_wrap_policy=block_policy()),
    }
    for name, kwargs in cases.items():
        module = kwargs.pop("module")
        d_in = module.embed.in_features
        pair = FsdpPair(module, adamw, **kwargs)
        assert [n for n, _ in pair.dut.named_parameters()] == [n for n, _ in module.named_parameters()], name
        for step in range(STEPS):
            pair.ref_opt.zero_grad()
            pair.dut_opt.zero_grad()
            x, y = batch(rank, step, d_in=d_in)
            F.mse_loss(pair.ref(x), y).backward()
            F.mse_loss(pair.dut(x), y).backward()
            pair.ref_opt.step()
            pair.dut_opt.step()
            pair.check(f"{name}: rank {rank} step {step}")
        if name == "nested":
            units = [u.name for u in pair.dut._units]
            assert units == ["", "blocks.0", "blocks.0.up", "blocks.1", "blocks.1.up"], units
            owned = {u.name: [n for g in u.groups for n in g.names] for u in pair.dut._units}
            assert owned["blocks.0"] == ["blocks.0.down.weight", "blocks.0.norm.weight", "blocks.0.norm.bias"], owned
        if name == "size":  # 128 (embed), 544 (up), 512 (down), 32 (norm), 68 (head) elements
            units = [u.name for u in pair.dut._units]
            assert units == ["", "embed", "blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"], units
        if name == "tied":
            shared = pair.dut.module.blocks[0].up.weight
            assert shared is pair.dut.module.blocks[-1].up.weight
            owners = [u.name for u in pair.dut._units for g in u.groups for p in g.params if p is shared]
            assert owners == [""], f"the tied weight must be owned once, by the root: {owners}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_nested_tied_and_uneven_layouts_match_torch_ddp(ranks, world):
    ranks.run(_layouts, world, timeout=160)


def _prefetch_and_iteration_shapes(rank: int, world: int, backend: str) -> None:
    """Prefetch settings change when all-gathers are issued, never the result; an evaluation forward under
    no_grad between steps and two forwards before one backward work too."""
    from shardkit.fsdp import BackwardPrefetch

    variants = [dict(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_POST),
                dict(forward_prefetch=True, limit_all_gathers=False),
                dict(backward_prefetch=None)]
    for kwargs in variants:
        pair = FsdpPair(net(depth=4), adamw, dut_backend=backend, auto_wrap_policy=block_policy(), **kwargs)
        for step in range(STEPS):
            pair.ref_opt.zero_grad()
            pair.dut_opt.zero_grad()
            x1, y1 = batch(rank, step)
            x2, y2 = batch(rank, step, micro=1)
            for model in (pair.ref, pair.dut):  # two forwards, one backward
                (F.mse_loss(model(x1), y1) + F.mse_loss(model(x2), y2)).backward()
            pair.ref_opt.step()
            pair.dut_opt.step()
            with torch.no_grad():
                assert_close(pair.dut(x1), pair.ref.module(x1), f"{kwargs}: rank {rank} step {step}: eval forward")
            pair.check(f"{kwargs}: rank {rank} step {step}")
        # A retained graph run backward a second time reduces and accumulates again: twice the gradient.
        pair.dut_opt.zero_grad()
        x, y = batch(rank, STEPS)
        loss = F.mse_loss(pair.dut(x), y)
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in pair.dut.parameters()]
        loss.backward()
        for (name, p), g in zip(pair.dut.named_parameters(), once):
            assert_close(p.grad, 2 * g, f"{kwargs}: rank {rank}: {name}.grad after two backwards")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shardkit", "gloo"])
def test_prefetch_variants_eval_forwards_and_two_forward_backward(ranks, backend):
    ranks.run(_prefetch_and_iteration_shapes, 2, backend, timeout=160)


def _after_a_failed_backward(rank: int, world: int) -> None:
    """A backward that raises (here: a user hook, after FSDP's pre-backward ran and prefetched) must not
    leave later iterations without their end-of-backward step (gradients written, buffers freed)."""
    pair = FsdpPair(net(depth=4), sgd, auto_wrap_policy=block_policy())
    for step in range(2):
        pair.step(rank, step)

    def fail(grad):
        raise ValueError("a user hook failed")

    x, y = batch(rank, 2)
    out = pair.dut(x)
    out.register_hook(fail)
    error_of(lambda: F.mse_loss(out, y).backward(), ValueError, rank)
    pair.dut_opt.zero_grad()
    for step in range(3, 6):
        pair.step(rank, step)


@pytest.mark.timeout(120)
def test_training_goes_on_after_a_backward_that_raised(ranks):
    ranks.run(_after_a_failed_backward, 2, timeout=100)


def _empty_shards(rank: int, world: int) -> list[int]:
    torch.manual_seed(0)
    # 3 elements at offsets 0 and 4 (16-byte alignment), shards of 4: ranks 2 and 3 hold nothing.
    module = nn.Linear(2, 1)
    pair = FsdpPair(module, adamw)
    for step in range(STEPS):
        pair.ref_opt.zero_grad()
        pair.dut_opt.zero_grad()
        x = torch.full((2 + rank, 2), 0.1 * (rank + step))
        pair.ref(x).square().mean().backward()
        pair.dut(x).square().mean().backward()
        pair.ref_opt.step()
        pair.dut_opt.step()
        pair.check(f"rank {rank} step {step}")
    return [p.numel() for p in pair.dut.parameters()]


@pytest.mark.timeout(120)
def test_ranks_with_empty_shards_work(ranks):
    held = ranks.run(_empty_shards, 4, timeout=100)
    assert held == [[2, 0], [0, 1], [0, 0], [0, 0]]


def _frozen_and_groups(rank: int, world: int) -> None:
    module = net()
    module.blocks[1].up.weight.requires_grad_(False)  # frozen and trainable in one unit
    module.embed.requires_grad_(False)

    def grouped(model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for n, p in model.named_parameters() if p.requires_grad and not (n.endswith("bias") or "norm" in n)]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and (n.endswith("bias") or "norm" in n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)

    pair = FsdpPair(module, sgd, auto_wrap_policy=block_policy())
    pair.ref_opt, pair.dut_opt = grouped(pair.ref.module), grouped(pair.dut)
    for step in range(STEPS):
        pair.step(rank, step)
    frozen = pair.dut.module.blocks[1].up.weight
    assert frozen.grad is None and not frozen.requires_grad
    unit = next(u for u in pair.dut._units if u.name == "blocks.1")
    kinds = sorted((g.trainable, [n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in g.names])
                   for g in unit.groups)
    assert kinds == [(False, ["up.weight"]), (True, ["up.bias", "down.weight", "norm.weight", "norm.bias"])], kinds


@pytest.mark.timeout(120)
def test_frozen_parameters_and_parameter_groups_by_name(ranks):
    ranks.run(_frozen_and_groups, 2, timeout=100)


def _no_sync(rank: int, world: int) -> None:
    pair = FsdpPair(net(), sgd, auto_wrap_policy=block_policy())
    for step in range(3):
        pair.ref_opt.zero_grad()
        pair.dut_opt.zero_grad()
        for model in (pair.ref, pair.dut):
            with model.no_sync():
                for micro in (0, 1):
                    x, y = batch(rank, step, micro)
                    F.mse_loss(model(x), y).backward()
            x, y = batch(rank, step, 2)
            F.mse_loss(model(x), y).backward()
        pair.ref_opt.step()
        pair.dut_opt.step()
        pair.check(f"rank {rank} step {step}")


@pytest.mark.timeout(120)
def test_no_sync_accumulates_like_torch_ddp(ranks):
    ranks.run(_no_sync, 2, timeout=100)


def _clip(rank: int, world: int) -> list[float]:
    totals = []
    for norm_type in (1.0, 2.0, float("inf")):
        pair = FsdpPair(net(), sgd, auto_wrap_policy=block_policy())
        for step in range(3):
            pair.ref_opt.zero_grad()
            pair.dut_opt.zero_grad()
            x, y = batch(rank, step)
            F.mse_loss(pair.ref(x), y).backward()
            F.mse_loss(pair.dut(x), y).backward()
            want = torch.nn.utils.clip_grad_norm_(pair.ref.module.parameters(), 0.05, norm_type)
            got = pair.dut.clip_grad_norm_(0.05, norm_type)
            assert_close(got, want.float(), f"rank {rank} norm {norm_type} step {step}: total norm")
            totals.append(float(got))
            pair.ref_opt.step()
            pair.dut_opt.step()
            pair.check(f"rank {rank} norm {norm_type} step {step}")
    return totals


@pytest.mark.timeout(120)
def test_clip_grad_norm_equals_torch_on_the_unwrapped_model(ranks):
    totals = ranks.run(_clip, 3, timeout=100)
    assert totals[0] == totals[1] == totals[2]
    assert all(t > 0.05 for t in totals[0]), "the norms must be above max_norm, or nothing was clipped"


def _summon(rank: int, world: int) -> None:
    import shardkit

    model = shardkit.FullyShardedDataParallel(net(), auto_wrap_policy=block_policy())
    reference = net()
    with shardkit.FullyShardedDataParallel.summon_full_params(model, writeback=False):
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            assert got.shape == want.shape, name
            assert_close(got, want, f"summoned {name}")
        x, _ = batch(0, 0)
        assert_close(model(x), reference(x), "a forward inside summon_full_params")
        model.module.head.bias.data.fill_(7.0)  # dropped: writeback=False
    assert_close(model.state_dict()["head.bias"], reference.head.bias, "writeback=False kept a change")
    with shardkit.FullyShardedDataParallel.summon_full_params(model, writeback=True):
        model.module.head.bias.data.fill_(float(rank + 3))  # every rank writes its own value: each keeps its piece
        model.module.blocks[0].up.weight.data.fill_(2.0)
    state = model.state_dict()
    assert torch.equal(state["blocks.0.up.weight"], torch.full_like(reference.blocks[0].up.weight, 2.0))
    # head.bias (4 elements) lies in one rank's shard: everyone sees the owner's value
    owner_value = state["head.bias"][0].item()
    assert torch.equal(state["head.bias"], torch.full((4,), owner_value)) and owner_value in (3.0, 4.0)
    assert [p.dim() for p in model.parameters()] == [1] * len(list(model.parameters()))


@pytest.mark.timeout(120)
def test_summon_full_params_writeback(ranks):
    ranks.run(_summon, 2, timeout=100)


def _counts(rank: int, world: int) -> dict:
    import shardkit

    model = shardkit.FullyShardedDataParallel(net(depth=4), auto_wrap_policy=block_policy(), forward_prefetch=True)
    units = len(model._units)
    optimizer = sgd(model.parameters())
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    per_step = []
    for step in range(4):
        before = dict(model.collective_counts)
        issued = backend._get_sequence_number_for_group()
        optimizer.zero_grad()
        x, y = batch(rank, step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        after = model.collective_counts
        per_step.append(({k: after[k] - before[k] for k in after}, backend._get_sequence_number_for_group() - issued))
    sizes = sorted((u.groups[0].handle.full_bytes for u in model._units[1:]), reverse=True)
    root = sum(g.handle.full_bytes for g in model._units[0].groups)
    return {"units": units, "per_step": per_step, "peak": model.peak_gathered_bytes, "bound": root + sum(sizes[:2])}


@pytest.mark.timeout(120)
def test_collectives_per_step_and_gathered_bytes(ranks):
    for result in ranks.run(_counts, 2, timeout=100):
        n = result["units"]
        assert n == 5
        for counts, issued in result["per_step"]:
            assert counts == {"all_gather": n + (n - 1), "reduce_scatter": n, "all_reduce": 0,
                              "identity_checks": 0}, counts
            assert issued == 3 * n - 1, f"the backend saw {issued} collectives in a step, expected {3 * n - 1}"
        assert 0 < result["peak"] <= result["bound"], result


def _errors(rank: int, world: int) -> dict[str, str]:
    import shardkit

    messages = {}
    model = shardkit.FullyShardedDataParallel(net())
    messages["wrapped"] = error_of(lambda: shardkit.FullyShardedDataParallel(model), ValueError, rank)
    messages["nested"] = error_of(lambda: shardkit.FullyShardedDataParallel(nn.Sequential(model.module)),
                                  ValueError, rank)
    messages["empty"] = error_of(lambda: shardkit.FullyShardedDataParallel(nn.ReLU()), ValueError, rank)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    messages["devices"] = error_of(lambda: shardkit.FullyShardedDataParallel(mixed), ValueError, rank)
    from shardkit.fsdp import ShardingStrategy

    messages["summon"] = error_of(lambda: shardkit.FullyShardedDataParallel.summon_full_params(
        model, recurse=False, with_grads=True).__enter__(), NotImplementedError, rank)

    messages["hybrid_pair"] = error_of(lambda: shardkit.FullyShardedDataParallel(
        net(), process_group=(None, dist.group.WORLD), sharding_strategy=ShardingStrategy.HYBRID_SHARD),
        ValueError, rank)
    different = net(depth=2 if rank == 1 else 3)
    messages["layout"] = error_of(lambda: shardkit.FullyShardedDataParallel(different, auto_wrap_policy=block_policy()),
                                  RuntimeError, rank)
    return messages


@pytest.mark.timeout(120)
def test_errors_name_the_rank_unit_and_value(ranks):
    results = ranks.run(_errors, 2, timeout=100)
    for rank, messages in enumerate(results):
        assert messages["wrapped"] == "shardkit FSDP: the module is already a shardkit FullyShardedDataParallel"
        assert "submodule '0' is already wrapped" in messages["nested"], messages["nested"]
        assert messages["empty"] == f"shardkit FSDP (rank {rank}): the module has no parameters to shard (ReLU)"
        assert "parameters on mixed devices ['cpu', 'meta']" in messages["devices"], messages["devices"]
        assert messages["layout"].startswith(f"shardkit FSDP (rank {rank}): unit 'blocks.2' differs between ranks: "
                                             "rank 0 has 5 parameters"), messages["layout"]
        assert "rank 1 has no such unit" in messages["layout"], messages["layout"]
        assert messages["summon"] == ("shardkit FSDP: summon_full_params(recurse=False, with_grads=True) is not "
                                      "supported: every rank gathers every unit, without gradients"), messages["summon"]
        assert messages["hybrid_pair"].startswith("HYBRID_SHARD's process_group=(shard_group, replicate_group) "
                                                  "needs both groups, got (None, "), messages["hybrid_pair"]


def _deleted_models_are_freed(rank: int, world: int) -> list[bool]:
    import gc
    import weakref

    import shardkit

    freed = []
    for backward in (True, False):
        model = shardkit.FullyShardedDataParallel(net(), auto_wrap_policy=block_policy())
        ref = weakref.ref(model)
        x, y = batch(rank, 0)
        loss = F.mse_loss(model(x), y)
        if backward:
            loss.backward()
        del model, loss
        gc.collect()
        freed.append(ref() is None)
    return freed


@pytest.mark.timeout(120)
def test_a_deleted_model_is_freed_after_a_forward_without_backward(ranks):
    """The autograd graph of a training forward (kept until the iteration ends) must not keep the model alive."""
    assert ranks.run(_deleted_models_are_freed, 2, timeout=100) == [[True, True]] * 2

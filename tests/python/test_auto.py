"""shardkit.auto (issue #12): the strategy the memory math picks, exactly at the estimator's thresholds, and the
wrapped model and optimizer it returns.

What each test can catch: an off-by-one at a threshold (``fits`` is <=), a rule that skips ZeRO-2 or answers
ZeRO-1, ranks that read different budgets and so choose different wrappers (the next collective would hang),
offload silently replaced by a strategy that does not fit, a returned pair that cannot train.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.ddp_cases import error_of
from support.fsdp_cases import Block, net

PSI = 100_000


def _totals(world: int) -> dict[str, float]:
    from shardkit import estimate

    states = estimate.model_states(PSI, world, "fp32", "adam", master_weights=False)
    return {key: row.total_gb for key, row in states.items()}


def test_plan_at_and_around_every_threshold():
    from shardkit.strategy import plan

    totals = _totals(4)  # ddp 1.6e-3 > zero2 7e-4 > zero3 4e-4 > zero3_offload 2e-4 GB (fp32 Adam, 16 bytes/param)
    below = 1 - 1e-9
    assert plan(PSI, 4, totals["ddp"]).strategy == "ddp"
    assert plan(PSI, 4, totals["ddp"] * below).strategy == "zero2"
    assert plan(PSI, 4, totals["zero2"]).strategy == "zero2"
    assert plan(PSI, 4, totals["zero2"] * below).strategy == "zero3"
    assert plan(PSI, 4, totals["zero3"]).strategy == "zero3"
    assert plan(PSI, 4, totals["zero3"] * below).strategy == "zero3_offload"
    assert plan(PSI, 4, totals["zero3_offload"]).strategy == "zero3_offload"
    with pytest.raises(RuntimeError, match=r"^shardkit.auto: no strategy fits in 0.0002 GB per rank \(100000 "
                                           r"parameters, 4 ranks"):
        plan(PSI, 4, totals["zero3_offload"] * below)
    with pytest.raises(RuntimeError, match=r"^shardkit.auto: no strategy fits in 1e-05 GB per rank"):
        plan(PSI, 4, 1e-5)
    # headroom counts against the budget; activations are added to every row
    assert plan(PSI, 4, totals["ddp"] + 0.5, headroom_gb=0.5).strategy == "ddp"
    assert plan(PSI, 4, totals["ddp"] + 0.5, headroom_gb=0.5 + 1e-6).strategy == "zero2"
    assert plan(PSI, 4, totals["ddp"] + 2.0, activation_gb=2.0).strategy == "ddp"
    # SGD (momentum) needs 12 bytes/param: its DDP fits where Adam's does not
    assert plan(PSI, 4, totals["ddp"] * 0.8, optimizer="sgd").strategy == "ddp"


def _auto_at(rank: int, world: int, budgets: list[float], policy: set | None) -> dict:
    import shardkit

    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(10)])  # 101_000 parameters
    model, optimizer = shardkit.auto(module, torch.optim.AdamW, memory_budget_gb=budgets[rank], lr=1e-3,
                                     auto_wrap_policy=policy)
    x = torch.randn(4, 100)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), torch.zeros(4, 100))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    from torch.distributed.fsdp import FSDPModule

    # fully_shard shards the module in place (torch FSDP2): the same object, now an FSDPModule, each unit too.
    wrapper = "fully_shard" if isinstance(model, FSDPModule) and model is module else type(model).__name__
    units = sum(1 for m in module.modules() if isinstance(m, FSDPModule))
    return {"model": wrapper, "zero_stage": getattr(model, "zero_stage", None), "units": units,
            "optimizer": type(optimizer).__name__, "strategy": model.shardkit_plan.strategy,
            "front": model.shardkit_plan.front, "budget": model.shardkit_plan.budget_gb,
            "finite": all(map(torch.isfinite, map(torch.tensor, losses)))}


@pytest.mark.timeout(120)
def test_auto_wraps_with_the_chosen_strategy_and_trains(ranks):
    from shardkit import estimate

    rows = estimate.model_states(101_000, 2, "fp32", "adam", master_weights=False)
    ddp, zero2, zero3 = (rows[k].total_gb for k in ("ddp", "zero2", "zero3"))
    # ZeRO-3 is fully_shard, as the integrations' auto picks it, on the units of the policy: by default (no
    # ModuleList: Psi / 8 parameters per unit, more than a Linear holds) the root alone; with {Linear}, each
    # Linear and then the root, 11 FSDP modules.
    cases = [([ddp, ddp * 2], None, "ddp", "ddp", "DistributedDataParallel", 0, 0, "AdamW"),
             ([ddp * 2, ddp * 0.999], None, "zero2", "zero2", "DistributedDataParallel", 2, 0,
              "ZeroRedundancyOptimizer"),
             ([zero2 * 0.999, zero3], None, "zero3", "fully_shard", "fully_shard", None, 1, "AdamW"),
             ([zero3, zero3], {torch.nn.Linear}, "zero3", "fully_shard", "fully_shard", None, 11, "AdamW")]
    for budgets, policy, strategy, front, model, stage, units, optimizer in cases:
        for rank, got in enumerate(ranks.run(_auto_at, 2, budgets, policy, timeout=100)):
            where = f"budgets {budgets}, rank {rank}"
            assert got["strategy"] == strategy, where  # every rank: the smallest budget decides
            assert got["front"] == front, where
            assert got["budget"] == min(budgets), where
            assert (got["model"], got["zero_stage"], got["units"], got["optimizer"]) == \
                (model, stage, units, optimizer), where
            assert got["finite"], where


def test_one_table_picks_the_front_for_auto_and_the_integrations():
    """shardkit.auto and the integrations' strategy="auto" take the front from one place: ZeRO-3 is fully_shard
    (the recommended front), offload the FSDP1 front (the integrations refuse offload)."""
    from shardkit.integrations import _wrapping
    from shardkit.strategy import front_for, plan

    assert {s: front_for(s) for s in ("ddp", "zero2", "zero3", "zero3_offload")} == \
        {"ddp": "ddp", "zero2": "zero2", "zero3": "fully_shard", "zero3_offload": "fsdp"}
    assert plan(PSI, 4, _totals(4)["zero3"]).front == "fully_shard"
    assert {front_for(s) for s in ("ddp", "zero2", "zero3")} <= set(_wrapping.STRATEGIES)
    with pytest.raises(ValueError, match=r"no front for strategy 'zero1'"):
        front_for("zero1")


def _auto_refuses(rank: int, world: int, budget: float) -> str:
    import shardkit

    module = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(10)])
    return error_of(lambda: shardkit.auto(module, torch.optim.AdamW, memory_budget_gb=budget), RuntimeError, rank)


@pytest.mark.timeout(120)
def test_auto_refuses_on_every_rank_when_only_offload_or_nothing_fits(ranks):
    for budget, head in ((6e-4, "shardkit.auto (rank {rank}): only ZeRO-3 + CPU offload fits in 0.0006 GB per rank, "
                                "and offloading needs a model on a CUDA device (its parameters are on cpu)"),
                         (1e-5, "shardkit.auto: no strategy fits")):
        for rank, message in enumerate(ranks.run(_auto_refuses, 2, budget, timeout=100)):
            assert message.startswith(head.format(rank=rank)), message
            assert "ZeRO-3 / FULL_SHARD" in message  # the table behind the decision


def test_default_wrap_policy_wraps_the_blocks_of_a_module_list():
    from shardkit.strategy import default_wrap_policy

    assert default_wrap_policy(net(seed=0)) == {Block}
    policy = default_wrap_policy(torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)))
    assert callable(policy)

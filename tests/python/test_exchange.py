"""shardkit._exchange (picklable objects through tensor collectives, without numpy) against torch's object
collectives.

Each rank contributes an object of a different size (nested containers, a float64 tensor, bytes; rank 1's
is ~3 MB, so the shardkit backend's chunked path and the padding to the largest pickle are exercised).
all_gather_object and gather_object must give exactly what torch's dist.all_gather_object and
dist.gather_object give, on the whole group and on a subgroup (its own rank numbering: ``dst`` is a group
rank), on the "shardkit" backend and on gloo. The second test makes numpy unimportable and Tensor.numpy()
raise as torch's does without numpy: torch's object collective fails there (so the simulation is real);
shardkit's exchange, DDP construction and ZeRO's consolidate_state_dict must not.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from support.harness import assert_same

WORLD = 3


def payload(rank: int) -> dict:
    return {"rank": rank, "name": "r" * (37 * rank), "tensor": torch.arange(5.0 * rank, dtype=torch.float64),
            "blob": bytes(range(256)) * (12_000 if rank == 1 else rank), "nested": [(rank, None), {rank: "x"}]}


def _parity_with_torch(rank, world):
    from shardkit import _exchange

    members = [1, 2]
    subgroup = dist.new_group(members)  # every rank takes part in new_group, members only in its collectives
    cases = [(None, rank, 0), (None, rank, 2), (subgroup, members.index(rank) if rank in members else None, 1)]
    for group, group_rank, dst in cases:
        if group_rank is None:
            continue
        where = f"rank {rank}, group {'world' if group is None else members}, dst {dst}"
        size = dist.get_world_size(group)
        mine = payload(rank)
        want = [None] * size
        dist.all_gather_object(want, mine, group=group)
        assert_same(_exchange.all_gather_object(mine, group), want, f"all_gather_object, {where}")
        want_gathered = [None] * size if group_rank == dst else None
        dist.gather_object(mine, want_gathered, group=group, group_dst=dst)
        got_gathered = _exchange.gather_object(mine, dst, group)
        if group_rank == dst:
            assert_same(got_gathered, want_gathered, f"gather_object, {where}")
        else:
            assert got_gathered is None, f"gather_object, {where}: a non-destination rank got {got_gathered!r}"
    return True


@pytest.mark.parametrize("backend", ["shardkit", "gloo"])
def test_matches_torch_object_collectives(ranks, backend):
    assert ranks.run(_parity_with_torch, WORLD, backend=backend, timeout=240) == [True] * WORLD


def _without_numpy(rank, world):
    import shardkit
    from shardkit import _exchange

    def unavailable(self):
        raise RuntimeError("Numpy is not available")

    sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
    torch.Tensor.numpy = unavailable  # what torch's Tensor.numpy() does in an install without numpy
    try:
        dist.all_gather_object([None] * world, rank)
        torch_error = None
    except RuntimeError as error:  # raised after both collectives, on every rank: the ranks stay in step
        torch_error = str(error)
    gathered = _exchange.all_gather_object(payload(rank))
    assert_same(gathered, [payload(r) for r in range(world)], f"all_gather_object on rank {rank}")
    torch.manual_seed(0)
    model = shardkit.DistributedDataParallel(torch.nn.Linear(4, 2), zero_stage=2)
    optimizer = shardkit.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    optimizer.consolidate_state_dict(to=1)
    steps = sorted(float(s["step"]) for s in optimizer.state_dict()["state"].values()) if rank == 1 else None
    return torch_error, steps


def test_works_where_numpy_is_not_available(ranks):
    results = ranks.run(_without_numpy, WORLD, timeout=240)
    assert [error for error, _ in results] == ["Numpy is not available"] * WORLD
    assert [steps for _, steps in results] == [None, [1.0, 1.0], None]

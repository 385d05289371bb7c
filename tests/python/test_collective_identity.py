"""Collectives of different FSDP units never pair silently: ranks that run different units (two heads of the same
shapes; a unit one rank skips) raise on every rank, naming both units, before any optimizer step applies.

Before, collectives were matched by number, kind and size only: rank 0 all-gathering ``head_a`` while rank 1
all-gathered ``head_b`` exchanged their shards, and the update was ~100 % wrong. Now each collective carries its
unit's identity: on one host the shared-memory op header compares it at once; across hosts and on torch's gloo,
FSDP compares the identities of the collectives each group carried once per backward, before its end."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from support.collective_cases import topology_env


class TwoHeads(nn.Module):
    """A trunk and two heads of identical shapes: only the identity tells their collectives apart."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.head_a = nn.Linear(32, 32)
        self.head_b = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, heads: tuple[str, ...]) -> torch.Tensor:
        x = torch.tanh(self.trunk(x))
        for head in heads:
            x = getattr(self, head)(x)
        return x


def _train_rank_dependent_heads(rank: int, world: int, case: str, init: tuple[str, str] | None = None):
    import shardkit

    if init is not None:  # this rank's TORCH_DISTRIBUTED_DEBUG, read as a process started with it reads it
        dist.set_debug_level_from_env()
        dist.init_process_group(init[0], init_method=f"file://{init[1]}", rank=rank, world_size=world)

    torch.manual_seed(0)
    model = shardkit.FullyShardedDataParallel(TwoHeads(), auto_wrap_policy={nn.Linear})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    if case == "balanced":  # every rank runs one head: the same collectives, of different units
        heads = ("head_a",) if rank == 0 else ("head_b",)
    else:  # rank 0 runs both heads, the others only head_b: head_a's unit is unused there
        heads = ("head_a", "head_b") if rank == 0 else ("head_b",)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    try:
        model(x, heads).square().mean().backward()
        optimizer.step()
    except RuntimeError as error:
        stepped = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        return str(error), stepped
    return None


TOPOLOGIES = {
    "one-host-w2": ("shardkit", 2, None),
    "one-host-w4": ("shardkit", 4, None),
    "2hosts": ("shardkit", 2, [0, 1]),       # across hosts: no shm header reaches the other rank
    "2x2hosts": ("shardkit", 4, [0, 0, 1, 1]),
    "gloo": ("gloo", 2, None),               # torch's own backend: FSDP's end-of-backward check
}


@pytest.mark.parametrize("case", ["balanced", "unbalanced"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_ranks_running_different_units_raise_before_any_step(ranks, topology: str, case: str):
    backend, world, hosts = TOPOLOGIES[topology]
    env, init = topology_env(hosts), None
    if topology == "gloo" and case == "unbalanced":
        # Unequal numbers of collectives pair different sizes on gloo, which waits on them: FSDP checks each
        # collective before issuing it under DETAIL (as torch's own fingerprints do), else at the end of backward.
        env, init, backend = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, (backend, str(ranks.workdir / "store")), None
    outcomes = ranks.launch(_train_rank_dependent_heads, world, case, init, backend=backend, timeout=60,
                            pg_timeout=30, env=env)
    for outcome in outcomes:
        assert outcome.ok, outcome.error
        assert outcome.value is not None, f"rank {outcome.rank} trained on with another rank's unit"
        message, stepped = outcome.value
        assert not stepped, f"rank {outcome.rank} applied a step: {message}"
        # Both units named, wherever it was found (the first pairing, or the end-of-backward check).
        assert "FSDP unit 'head_a'" in message and "FSDP unit 'head_" in message, message
        assert "head_b" in message or case == "unbalanced", message


def _same_units_everywhere(rank: int, world: int):
    """The common case: the identity check passes and costs no extra collective where the header carries it."""
    import shardkit

    torch.manual_seed(0)
    model = shardkit.FullyShardedDataParallel(TwoHeads(), auto_wrap_policy={nn.Linear})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    counts = []
    for _ in range(2):
        model(x, ("head_a", "head_b")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(model.collective_counts["identity_checks"])
    return counts


@pytest.mark.parametrize("topology", ["one-host-w2", "2hosts", "gloo"])
def test_fsdp_checks_identities_itself_only_where_the_backend_does_not(ranks, topology: str):
    backend, world, hosts = TOPOLOGIES[topology]
    counts = ranks.run(_same_units_everywhere, world, backend=backend, timeout=60, env=topology_env(hosts))
    expected = [1, 2] if backend == "gloo" else [0, 0]  # one small exchange per backward
    assert counts == [expected] * world


def _one_rank_issues_a_plain_collective_instead(rank: int, world: int):
    """Rank 1 skips the trunk's unit and all-reduces a plain tensor (no identity) where rank 0 all-gathers the unit:
    the host leaders, on different hosts, still exchange fingerprints alike (the group compares every op)."""
    import shardkit

    torch.manual_seed(0)
    model = shardkit.FullyShardedDataParallel(TwoHeads(), auto_wrap_policy={nn.Linear})
    try:
        if rank == 0:
            model(torch.randn(4, 16), ("head_a",))
        else:
            dist.all_reduce(torch.ones(264))  # the size of a head's shard: it would pair silently
    except RuntimeError as error:
        return str(error)
    return None


def test_a_unit_against_a_plain_collective_across_hosts_fails_naming_both(ranks):
    outcomes = ranks.launch(_one_rank_issues_a_plain_collective_instead, 2, timeout=60, pg_timeout=30,
                            env=topology_env([0, 1]))
    for outcome in outcomes:
        assert outcome.ok and outcome.value is not None, outcome.error
        assert "ranks disagree on collective" in outcome.value and "FSDP unit '" in outcome.value, outcome.value
        assert "allreduce" in outcome.value, outcome.value


def _detail_on_rank_0_only(rank: int, world: int):
    import shardkit

    if rank == 0:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        shardkit.FullyShardedDataParallel(TwoHeads(), auto_wrap_policy={nn.Linear})
    except RuntimeError as error:
        return str(error)
    return None


def test_ranks_that_differ_in_torch_distributed_debug_are_refused(ranks):
    # FSDP checks each collective before issuing it under DETAIL only: ranks that differ would issue different
    # collectives.
    for outcome in ranks.launch(_detail_on_rank_0_only, 2, backend="gloo", timeout=60):
        assert outcome.ok and outcome.value is not None, outcome.error
        assert "ranks disagree on TORCH_DISTRIBUTED_DEBUG: rank 0 DETAIL, rank 1 OFF" in outcome.value, outcome.value


def test_identity_scopes_nest_and_must_close_in_order():
    from shardkit import _C
    from shardkit._collective_identity import collectives_for

    assert _C.exchange_current_identity(0) == 0
    with collectives_for("outer part") as outer:
        with collectives_for("inner part") as inner:
            assert _C.exchange_current_identity(inner) == inner
        assert _C.exchange_current_identity(outer) == outer
    assert _C.exchange_current_identity(0) == 0
    a, b = collectives_for("part a"), collectives_for("part b")
    a.__enter__()
    b.__enter__()
    for scope in (a, b):  # a first: out of order, and then b finds a's outer identity current
        with pytest.raises(RuntimeError, match="closed out of order"):
            scope.__exit__(None, None, None)
    _C.exchange_current_identity(0)


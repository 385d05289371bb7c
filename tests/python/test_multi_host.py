"""Several hosts, simulated on one machine with SHARDKIT_HOST_ID: shm inside a host, gloo between hosts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.collective_cases import assert_close, make_input, reference_reduce
from shardkit.backend import HostTopology, host_topology


def test_topology_groups_ranks_by_host_in_rank_order():
    topo = HostTopology.from_host_ids(["b", "a", "b", "a", "c"])
    assert topo.host_of == [0, 1, 0, 1, 2]
    assert topo.local_of == [0, 0, 1, 1, 0]
    assert topo.num_hosts == 3 and topo.leaders() == [0, 1, 4]
    assert [topo.local_size(r) for r in range(5)] == [2, 2, 2, 2, 1]


def test_host_topology_needs_a_shardkit_group():
    with pytest.raises(ValueError, match="process group None has no shardkit backend in this process"):
        host_topology()


def _every_collective(rank, world):
    R = dist.ReduceOp
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ((R.SUM, R.AVG, R.MAX) if dtype.is_floating_point else (R.SUM, R.MIN, R.BXOR)):
            for n in (1, 300_001):
                inputs = [make_input(r, n, dtype, salt=int(op)) for r in range(world)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                expected = reference_reduce(inputs, op)
                if dtype == torch.bfloat16:  # each host's partial sum is rounded to bf16 before the next step
                    torch.testing.assert_close(t, expected, rtol=0.02, atol=0.05)
                else:
                    assert_close(t, expected, world, f"all_reduce {dtype} {op} n={n}")
        for root in range(world):
            t = make_input(rank, 1000, dtype, salt=root)
            dist.broadcast(t, src=root)
            assert torch.equal(t, make_input(root, 1000, dtype, salt=root)), f"broadcast root {root}"
    dist.barrier()
    out = [torch.empty(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)))
    assert [o[0].item() for o in out] == [float(r) for r in range(world)]
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.float32))
    assert torch.equal(rs, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * world)
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.full((world,), float(rank)))
    assert torch.equal(a2a, torch.arange(world, dtype=torch.float32))
    objs = [None] * world
    dist.all_gather_object(objs, rank)
    assert objs == list(range(world))
    return True


@pytest.mark.parametrize("layout", ["blocked", "interleaved"])
def test_two_simulated_hosts_of_two_ranks(ranks, layout):
    hosts = [r // 2 if layout == "blocked" else r % 2 for r in range(4)]
    env = [{"SHARDKIT_HOST_ID": f"host{h}"} for h in hosts]
    assert ranks.run(_every_collective, 4, timeout=180, env=env) == [True] * 4


def test_uneven_hosts(ranks):
    env = [{"SHARDKIT_HOST_ID": host} for host in ("a", "b", "b")]
    assert ranks.run(_every_collective, 3, timeout=180, env=env) == [True] * 3

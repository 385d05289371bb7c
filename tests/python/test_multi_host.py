"""Several hosts, simulated on one machine with SHARDKIT_HOST_ID: shm inside a host, gloo between hosts."""

from __future__ import annotations

import pytest

from shardkit.backend import HostTopology, host_topology
from support.collective_cases import TOPOLOGIES, run_on
from support.harness import RanksFailed
from support.host_collectives import every_collective, large_ops


def test_topology_groups_ranks_by_host_in_rank_order():
    topo = HostTopology.from_host_ids(["b", "a", "b", "a", "c"])
    assert topo.host_of == [0, 1, 0, 1, 2]
    assert topo.local_of == [0, 0, 1, 1, 0]
    assert topo.num_hosts == 3 and topo.leaders() == [0, 1, 4]
    assert [topo.local_size(r) for r in range(5)] == [2, 2, 2, 2, 1]


def test_host_topology_needs_a_shardkit_group():
    with pytest.raises(ValueError, match="process group None has no shardkit backend in this process"):
        host_topology()


@pytest.mark.parametrize("layout", ["blocked", "interleaved"])
def test_two_simulated_hosts_of_two_ranks(ranks, layout):
    hosts = [r // 2 if layout == "blocked" else r % 2 for r in range(4)]
    env = [{"SHARDKIT_HOST_ID": f"host{h}"} for h in hosts]
    assert ranks.run(every_collective, 4, timeout=180, env=env) == [True] * 4


def test_uneven_hosts(ranks):
    env = [{"SHARDKIT_HOST_ID": host} for host in ("a", "b", "b")]
    assert ranks.run(every_collective, 3, timeout=180, env=env) == [True] * 3


@pytest.mark.parametrize("topology, scheme", [("2x2hosts", "rails"), ("2x2hosts-leaders", "leaders"),
                                              ("3x2hosts", "rails"), ("2x2hosts-interleaved", "leaders"),
                                              ("3hosts-uneven", "leaders")])
def test_rails_and_leaders_move_large_ops_exactly(ranks, topology, scheme):
    assert run_on(ranks, topology, large_ops, scheme, timeout=240) == [True] * TOPOLOGIES[topology][0]


def _scheme(rank, world):
    from shardkit.backend import inter_host_scheme

    return inter_host_scheme()


def test_inter_host_scheme_is_none_on_one_host(ranks):
    assert ranks.run(_scheme, 2, timeout=60) == [None, None]


def test_unknown_inter_host_scheme_is_refused_naming_it(ranks):
    env = [{"SHARDKIT_HOST_ID": f"host{r // 2}", "SHARDKIT_INTER_HOST": "ring"} for r in range(4)]
    with pytest.raises(RanksFailed) as failed:
        ranks.run(_scheme, 4, timeout=60, env=env)
    assert "SHARDKIT_INTER_HOST must be one of ('rails', 'leaders'), got 'ring'" in str(failed.value)

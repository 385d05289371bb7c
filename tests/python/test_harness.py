"""The launcher itself: failures and hangs of a rank must surface fast and with the rank's story."""

from __future__ import annotations

import time

import pytest

from support import harness


def _return_rank(rank, world_size):
    return (rank, world_size)


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        while True:  # a hang that is not inside a collective
            time.sleep(0.05)
    return rank


def _collective_sum(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_values_come_back_in_rank_order(ranks):
    assert ranks.run(_return_rank, 3, backend=None) == [(0, 3), (1, 3), (2, 3)]


def test_a_raising_rank_fails_with_its_traceback(ranks):
    with pytest.raises(harness.RanksFailed) as info:
        ranks.run(_raise_on_rank_one, 2, backend=None, timeout=30)
    message = str(info.value)
    assert "1 of 2 ranks failed" in message
    assert "--- rank 1 ---" in message and "ValueError: boom from rank one" in message


def test_a_hanging_rank_fails_within_the_timeout_with_its_stack(ranks):
    start = time.monotonic()
    outcomes = ranks.launch(_hang_on_rank_zero, 2, backend=None, timeout=6)
    elapsed = time.monotonic() - start
    assert elapsed < 20
    assert outcomes[1].ok and outcomes[1].value == 1
    assert not outcomes[0].ok
    assert "timed out after 6 s" in outcomes[0].error
    assert "_hang_on_rank_zero" in outcomes[0].error  # faulthandler's stack of the hung rank


def test_collective_through_the_launcher(ranks):
    assert ranks.run(_collective_sum, 4, timeout=60) == [10.0] * 4


def test_torchrun_helper_runs_a_real_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, torch, torch.distributed as dist, shardkit\n"
        "dist.init_process_group('shardkit')\n"
        "t = torch.ones(4) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: {t.tolist()}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    result = harness.run_torchrun(script, 2, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2: [3.0, 3.0, 3.0, 3.0]" in result.stdout
    assert "rank 1 of 2: [3.0, 3.0, 3.0, 3.0]" in result.stdout

"""Launchers other than torchrun: SLURM's ``srun`` without torchrun (the ``slurm://`` rendezvous), and containers
that share a host name but not /dev/shm (Kubernetes pods with ``hostNetwork``).

- The SLURM variables are read as SLURM documents them (host lists with brackets, tasks per node with repeat
  counts, the step's values over the job's); what is missing or malformed is refused naming the variable.
- ``srun``'s launch is reproduced exactly: 4 plain processes, 2 nodes of 2 tasks (the nodes simulated with
  SHARDKIT_HOST_ID, as each real node has its own host name), with ``SLURM_*`` variables and none of torchrun's.
  Every rank joins through ``init_method="slurm://"`` without importing shardkit first; asserted: the group's
  ranks and shardkit's host grouping are srun's (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID), the rendezvous port
  is the one derived from the job id, ``shardkit.auto``'s per-rank budget is the host's memory over its 2 ranks,
  and shardkit's DDP trains to the same losses and parameters as torch's DDP on a gloo group over the same ranks.
- Two processes under one host name and boot id, one of them with a /dev/shm of its own (a mount namespace):
  shardkit groups them as two hosts and their collectives are right; without a mount of its own they are one.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit import launchers
from shardkit.launchers import SlurmEnvironmentError

SUPPORT = Path(__file__).parent / "support"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def _slurm(**overrides: str) -> dict[str, str]:
    """The variables srun gives task 3 of a step of 4 tasks on 2 nodes (2 tasks each), job 123456."""
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "123456"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v != ""}


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node07", "node07"), ("node[07-09,12],gpu1", "node07"), ("gpu1,node[07-09]", "gpu1"),
    ("rack[2-3]-n[001-004]", "rack2-n001"), ("n[5,1-3]", "n5"), ("10.0.0.[4-5]", "10.0.0.4"),
])
def test_first_host_of_a_node_list(nodelist: str, first: str) -> None:
    assert launchers.first_host(nodelist) == first


def test_tasks_per_node() -> None:
    assert launchers.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert launchers.tasks_per_node("4") == [4]
    with pytest.raises(SlurmEnvironmentError, match=r"cannot read the tasks per node '2\(x\)'"):
        launchers.tasks_per_node("2(x)")


def test_placement_from_srun_variables() -> None:
    placement = launchers.slurm_placement(_slurm())
    assert placement == launchers.SlurmPlacement(rank=3, world_size=4, local_rank=1, local_world_size=2,
                                                 node_rank=1, num_nodes=2, master_addr="node07",
                                                 master_port=15000 + 3456)
    # The step's values win over the job's; MASTER_ADDR, MASTER_PORT and the URL's port over the derived ones.
    step = launchers.slurm_placement(_slurm(SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="3",
                                            SLURM_STEP_TASKS_PER_NODE="2,1",
                                            MASTER_ADDR="head", MASTER_PORT="29400"))
    assert (step.world_size, step.local_world_size, step.master_addr, step.master_port) == (3, 1, "head", 29400)
    assert launchers.slurm_placement(_slurm(MASTER_PORT="29400"), port=29999).master_port == 29999


@pytest.mark.parametrize(("overrides", "message"), [
    ({"SLURM_PROCID": ""}, "SLURM_PROCID is not set: this process was not started by srun"),
    ({"SLURM_NTASKS": "four"}, "SLURM_STEP_NUM_TASKS=.four. is not an integer"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside the step's 4 tasks"),
    ({"SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is outside the tasks per node \[2, 2\]"),
    ({"SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""},
     "SLURM_STEP_NODELIST or SLURM_JOB_NODELIST or SLURM_NODELIST is not set"),
    ({"SLURM_JOB_ID": "ab"}, "SLURM_JOB_ID='ab' gives no port: set MASTER_PORT or pass slurm://\\?port=N"),
])
def test_placement_errors_name_the_variable(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(SlurmEnvironmentError, match=f"^slurm:// rendezvous: {message}"):
        launchers.slurm_placement(_slurm(**overrides))


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(launchers.__file__).parents[1]),
                                                      env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_job_id() -> int:
    """A job id whose derived port (15000 + its last four digits) nobody listens on now."""
    for port in random.sample(range(15000, 25000), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return 7_000_000 + port - 15000
    raise RuntimeError("no free port in 15000-24999")


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs


@pytest.mark.timeout(120)
def test_srun_without_torchrun_trains_like_torch(tmp_path: Path) -> None:
    job = _free_job_id()
    procs = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**_clean_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(local),
               "SLURM_NODEID": str(node), "SLURM_STEP_NODELIST": "localhost,127.0.0.[2-9]",
               "SLURM_JOB_NODELIST": "localhost,127.0.0.[2-9]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
               "SLURM_JOB_ID": str(job), "SHARDKIT_HOST_ID": f"node{node}"}
        procs.append(subprocess.Popen([sys.executable, str(SUPPORT / "srun_rank.py"), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = _wait_all(procs, timeout=100)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{outputs[rank]}"
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["world"], record["backend"]) == (rank, 4, "shardkit")
        assert record["placement"]["master_addr"] == "localhost"
        assert record["placement"]["master_port"] == 15000 + job % 10000
        assert (record["host_of"], record["local_of"]) == ([0, 0, 1, 1], [0, 1, 0, 1])
        # The host's available memory over its 2 ranks (the smallest over ranks, which read it at other times).
        assert record["budget_gb"] == pytest.approx(record["available_gb"] / 2, rel=0.1)
        ours, reference = record["ours"], record["reference"]
        torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(reference[0]), rtol=1e-6, atol=1e-7)
        for got, want in zip(ours[1], reference[1], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)


_ALLREDUCE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("shardkit", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
from shardkit.backend import host_topology
print(host_topology().num_hosts, t.unique().tolist(), flush=True)
dist.destroy_process_group()
"""
# A mount namespace with a /dev/shm of its own, under the machine's host name and boot id.
_OWN_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=64m,mode=1777 own-shm /dev/shm && exec "$@"', "sh"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_shm", [True, False], ids=["own-shm", "shared-shm"])
def test_one_host_name_two_shm_mounts_are_two_hosts(tmp_path: Path, own_shm: bool) -> None:
    if own_shm and os.geteuid() != 0:
        pytest.skip("a mount namespace needs root here")
    env = {k: v for k, v in _clean_env().items() if k != "SHARDKIT_HOST_ID"}
    init = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([*(_OWN_SHM if own_shm and rank == 1 else []), sys.executable, "-c", _ALLREDUCE,
                               init, str(rank)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(2)]
    outputs = _wait_all(procs, timeout=50)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{outputs[rank]}"
        assert outputs[rank].strip().splitlines()[-1] == f"{2 if own_shm else 1} [3.0]"

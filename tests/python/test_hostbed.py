"""The multi-host test bed (support/hostbed.py) and collectives across its shaped links.

- Three namespace hosts on one bridge, each link shaped to 1000 Mbit/s both ways by tbf (checked in tc's own
  words), one rank each under torchrun: shardkit finds three hosts by itself (no SHARDKIT_HOST_ID), and
  all_reduce, all_gather_into_tensor and reduce_scatter_tensor give the exact results on the shardkit backend
  (exact, and int8 between hosts: its small integers quantize exactly) and on gloo (benchmarks/_hosts_rank.py, which
  checks every result; the benchmark runs the same script).
- Every collective against its exact or float64 answer on shaped hosts (support/host_collectives.py): 3 hosts x 2
  ranks (rails, three on each rail) and 2 uneven hosts of 2 and 1 ranks (the leader scheme); nothing of shardkit's
  left in any host's /dev/shm.
- A link cut mid-allreduce (`ip link set ... down` at the switch): every rank on both hosts raises within the
  group's timeout (plus the second the failure path waits for a root cause), each naming a rank of the host it cannot
  reach or the ranks that went silent.
- Training across two shaped hosts of two ranks (support/hosts_training_rank.py): shardkit's DDP, ZeRO-2,
  fully_shard and HSDP end where one process training on the whole global batch ends (rtol 1e-5), and fully_shard
  with int8 bytes between hosts follows the exact run's loss over 50 steps, sending a quarter of its bytes.
- A link shaped to a crawl is slow, not an error: an allreduce that needs seconds on the link finishes right
  within a timeout longer than that, and with a shorter timeout every rank raises at about its deadline.
- Nothing of the bed outlives it: its network namespaces are gone afterwards, also when a host failed.

Skips, saying why, where the bed cannot be made (not root, no `ip` / `tc` / `unshare`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.hostbed import HostBed, unavailable

RANK_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "_hosts_rank.py"
COLLECTIVES_SCRIPT = Path(__file__).resolve().parent / "support" / "hosts_collectives_rank.py"
LINK_CUT_SCRIPT = Path(__file__).resolve().parent / "support" / "link_cut_rank.py"
TRAINING_SCRIPT = Path(__file__).resolve().parent / "support" / "hosts_training_rank.py"
CRAWL_SCRIPT = Path(__file__).resolve().parent / "support" / "crawl_rank.py"


@pytest.fixture(scope="module")
def bed_available():
    why = unavailable()
    if why:
        pytest.skip(f"no namespace hosts here: {why}")


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDKIT_HOST_ID", "GLOO_SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.timeout(240)
def test_three_shaped_hosts_find_each_other_and_every_collective_is_exact(bed_available, tmp_path):
    out = tmp_path / "result.json"
    with HostBed(3, rate_mbit=1000) as bed:
        for h in range(3):
            for ns, ifname in ((bed.netns[h], bed.host_if[h]), (bed.switch, bed.switch_if[h])):
                qdisc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", ifname],
                                       capture_output=True, text=True).stdout
                assert "tbf" in qdisc and "rate 1Gbit" in qdisc, (ns, ifname, qdisc)
        commands = [bed.torchrun(h, 1, [str(RANK_SCRIPT), str(out), "--bytes", str(3 << 20), "--reps", "2"])
                    for h in range(3)]
        run = bed.launch(commands, env=_env(), timeout=180, logs=tmp_path / "logs")
        names = set(bed.made)
    assert run.ok, run.story()
    result = json.loads(out.read_text())
    assert result["world"] == 3 and result["host_of"] == [0, 1, 2]
    ops = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    backends = ("shardkit", "shardkit-int8", "shardkit-leaders", "gloo")
    assert sorted(result["seconds"]) == sorted(f"{op}/{backend}" for op in ops for backend in backends)
    assert not names & _netns_names(), "the bed left network namespaces behind"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks_per_host, scheme", [((2, 2, 2), "rails"), ((2, 1), "leaders")])
def test_every_collective_is_exact_across_shaped_hosts(bed_available, tmp_path, ranks_per_host, scheme):
    hosts = len(ranks_per_host)
    with HostBed(hosts, rate_mbit=1000) as bed:
        commands = [bed.torchrun(h, ranks_per_host[h], [str(COLLECTIVES_SCRIPT), str(tmp_path), scheme])
                    for h in range(hosts)]
        run = bed.launch(commands, env=_env(), timeout=240, logs=tmp_path / "logs")
    assert run.ok, run.story()
    world = sum(ranks_per_host)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    host_of = [h for h, count in enumerate(ranks_per_host) for _ in range(count)]
    for result in results:
        assert result["host_of"] == host_of and result["scheme"] == scheme
        assert result["every_collective"] is True and result["large_ops"] is True
        assert result["left_in_dev_shm"] == []


@pytest.mark.timeout(120)
def test_a_failing_host_ends_the_launch_and_the_bed_goes(bed_available, tmp_path):
    with HostBed(2) as bed:
        run = bed.launch([["sh", "-c", "exit 3"], ["sleep", "60"]], env=_env(), timeout=60, logs=tmp_path)
        names = set(bed.made)
    assert run.codes[0] == 3 and not run.ok and run.seconds < 30, run
    assert not names & _netns_names()


def test_the_bed_refuses_nonsense():
    with pytest.raises(ValueError, match="hosts must be in"):
        HostBed(0)
    with pytest.raises(ValueError, match="rate_mbit must be positive, got -5"):
        HostBed(2, rate_mbit=-5)


@pytest.mark.timeout(240)
def test_a_cut_link_makes_every_rank_raise_within_the_timeout_naming_the_other_host(bed_available, tmp_path):
    import threading
    import time

    group_timeout = 15
    with HostBed(2, rate_mbit=1000) as bed:
        # Not under torchrun: its agents' exit barrier would wait minutes for the host across the cut link.
        def ranks_of(h: int) -> str:
            return " ".join(f"RANK={2 * h + local} LOCAL_RANK={local} {shlex.quote(sys.executable)} "
                            f"{LINK_CUT_SCRIPT} {tmp_path} {group_timeout} &" for local in range(2))

        commands = [["env", f"GLOO_SOCKET_IFNAME={bed.host_if[h]}", f"MASTER_ADDR={bed.addr(0)}", "MASTER_PORT=29400",
                     "WORLD_SIZE=4", "LOCAL_WORLD_SIZE=2", "sh", "-c", f"{ranks_of(h)} wait"] for h in range(2)]
        launched = {}
        thread = threading.Thread(target=lambda: launched.update(
            run=bed.launch(commands, env=_env(), timeout=180, logs=tmp_path / "logs")))
        thread.start()
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("ready*"))) < 4 and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.1)
        assert len(list(tmp_path.glob("ready*"))) == 4, "the ranks did not start allreducing"
        cut_at = time.time()
        subprocess.run(["ip", "-n", bed.switch, "link", "set", bed.switch_if[1], "down"], check=True)
        thread.join()
    run = launched["run"]
    assert run.ok, run.story()
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"] is not None, f"rank {rank} never noticed the cut link ({result['ops']} ops)"
        seconds = result["raised_at"] - cut_at
        assert seconds < group_timeout + 5, f"rank {rank} raised {seconds:.1f} s after the cut: {result['error']}"
        other_host = (2, 3) if rank < 2 else (0, 1)
        assert any(f"rank {r}" in result["error"] for r in other_host), f"rank {rank}: {result['error']}"


@pytest.mark.timeout(300)
def test_training_across_shaped_hosts_ends_where_one_host_does(bed_available, tmp_path):
    with HostBed(2, rate_mbit=1000) as bed:
        commands = [bed.torchrun(h, 2, [str(TRAINING_SCRIPT), str(tmp_path)]) for h in range(2)]
        run = bed.launch(commands, env=_env(), timeout=240, logs=tmp_path / "logs")
    assert run.ok, run.story()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, result in enumerate(results):
        assert result["host_of"] == [0, 0, 1, 1] and result["scheme"] == "rails"
        for front, difference in result["differences"].items():
            assert difference <= 1e-5, f"rank {rank}: {front} is {difference:.2e} (relative) off one host's answer"
        exact, quantized = result["exact_losses"], result["quantized_losses"]
        assert exact[-1] < 0.5 * exact[0] and quantized != exact, (exact, quantized)
        last, want = sum(quantized[-10:]) / 10, sum(exact[-10:]) / 10
        assert abs(last - want) <= 0.02 * want, f"rank {rank}: final loss {last} vs {want} exact"
        ratio = result["quantized_bytes"] / result["exact_bytes"]
        assert 0.24 < ratio < 0.28, f"rank {rank}: int8 sent {ratio:.3f} of the exact run's bytes between hosts"


@pytest.mark.timeout(240)
def test_a_crawling_link_is_slow_not_an_error_until_the_deadline(bed_available, tmp_path):
    # 20 Mbit/s; an allreduce of 4 MiB per rank, 2 hosts x 2 ranks: 4 MiB must cross each host's link each way
    # (2 S (H-1)/H), about 1.7 s at the link's rate.
    bound_s = 4 * 2**20 / (20e6 / 8)
    outcomes = {}
    with HostBed(2, rate_mbit=20) as bed:
        for timeout_s in (30, 1):
            out = tmp_path / f"timeout{timeout_s}"
            out.mkdir()
            commands = [bed.torchrun(h, 2, [str(CRAWL_SCRIPT), str(out), str(timeout_s), "4"], port=29400 + timeout_s)
                        for h in range(2)]
            run = bed.launch(commands, env=_env(), timeout=150, logs=out / "logs")
            assert run.ok, run.story()
            outcomes[timeout_s] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, result in enumerate(outcomes[30]):
        assert result["error"] is None and result["right"], f"rank {rank}: {result}"
        assert result["seconds"] > 0.9 * bound_s, f"rank {rank}: {result['seconds']:.2f} s: the link did not crawl"
    for rank, result in enumerate(outcomes[1]):
        assert result["error"] is not None, f"rank {rank} finished in {result['seconds']:.2f} s within a 1 s timeout"
        # At the deadline (plus the in-host grace a local peer may wait, and the second the failure path waits
        # for a root cause), not before it.
        assert 1 <= result["seconds"] < 1 + 5 + 3, f"rank {rank} raised after {result['seconds']:.2f} s"

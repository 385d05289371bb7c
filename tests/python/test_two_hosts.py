"""Two real hosts on one machine, made of Linux namespaces, and no SHARDKIT_HOST_ID.

Each "host" is `unshare --uts --ipc --mount --propagation private` (plus a PID namespace, see support/hostbed.py) with
its own hostname and a private tmpfs on /dev/shm, so the two cannot share a segment and shardkit must find
out by itself (hostname + boot id) that they are two hosts. Where `ip netns` works, each host also gets its
own network namespace and the two are joined by a veth pair; elsewhere they share the machine's loopback.
On each host `torchrun --nnodes=2 --node_rank=H --nproc_per_node=2` starts two ranks of
two_host_script.py, which reports what it saw and the outcome of each collective check, and trains a small
MLP with shardkit DDP; the comparison is the same rank job (two_host_script.run_rank) on ONE host of 4 ranks:
this machine itself, in harness ranks, as no namespace is needed for a single host.

Skips, saying why, where namespaces cannot be made (no root and no user namespaces, no `unshare`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from support import harness, two_host_script
from support.harness import free_port
from support.hostbed import launch_hosts, namespaces_unavailable, run_in_session

SCRIPT = Path(__file__).parent / "support" / "two_host_script.py"
WORLD = 4
LAUNCH_TIMEOUT = 140.0  # s for one launch (normally ~15 s on 2 busy cores); two fit in pytest-timeout's 300
class Network:
    """Where the hosts talk: two network namespaces joined by a veth pair, or else the shared loopback.

    Names carry a random token so parallel runs never collide; the addresses live inside the private
    namespaces, so every run can use the same ones. Everything made is removed on exit, also on failure.
    """

    def __init__(self) -> None:
        token = secrets.token_hex(4)
        self.netns = [f"shardkit-{os.getpid()}-{token}-h{h}" for h in range(2)]
        self.veth = [f"skv{token}{h}" for h in range(2)]  # interface names: at most 15 characters
        self.addr = ["10.201.0.1", "10.201.0.2"]
        self.mode = "veth"
        self.note = ""

    def __enter__(self) -> Network:
        if os.geteuid() != 0:
            return self._loopback("`ip netns` needs root")
        a, b = self.veth
        steps = [["ip", "netns", "add", self.netns[0]], ["ip", "netns", "add", self.netns[1]],
                 ["ip", "link", "add", a, "type", "veth", "peer", "name", b]]
        for h in range(2):
            ns = self.netns[h]
            steps += [["ip", "link", "set", self.veth[h], "netns", ns],
                      ["ip", "-n", ns, "addr", "add", f"{self.addr[h]}/30", "dev", self.veth[h]],
                      ["ip", "-n", ns, "link", "set", self.veth[h], "up"],
                      ["ip", "-n", ns, "link", "set", "lo", "up"]]
        for step in steps:
            try:
                result = run_in_session(step, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as exc:
                result = subprocess.CompletedProcess(step, -1, "", str(exc))
            if result.returncode != 0:
                self._remove()
                return self._loopback(f"`{shlex.join(step)}` failed: {result.stderr.strip()}")
        return self

    def __exit__(self, *exc) -> None:
        if self.mode == "veth":
            self._remove()

    def _loopback(self, why: str) -> Network:
        self.mode, self.note = "loopback", why
        self.addr = ["127.0.0.1", "127.0.0.1"]
        return self

    def _remove(self) -> None:
        # Deleting a namespace whose processes are gone destroys its end of the veth and so the pair; the
        # link delete covers a pair that never left this namespace. Errors mean "was not there".
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.veth[0]], capture_output=True, timeout=30)

    def describe(self) -> str:
        if self.mode == "veth":
            return f"network: namespaces {self.netns[0]} / {self.netns[1]}, veth {self.addr[0]} <-> {self.addr[1]}"
        return f"network: shared loopback ({self.note})"

    def prefix(self, h: int) -> list[str]:
        return ["ip", "netns", "exec", self.netns[h]] if self.mode == "veth" else []

    def ifname(self, h: int) -> str:
        return self.veth[h] if self.mode == "veth" else "lo"


@dataclasses.dataclass
class Launch:
    out: Path
    seconds: float
    reports: list[dict]

    def params(self, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"params-rank{rank}.pt")

    def reference(self, order: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"reference-{order}.pt")


def _launch(hosts: list[tuple[list[str], str, list[str]]], out: Path, env: dict[str, str]) -> Launch:
    """Start each (network prefix, hostname, command) as a host, wait for all of them, read the reports."""
    run = launch_hosts(hosts, env=env, timeout=LAUNCH_TIMEOUT, logs=out)
    missing = [r for r in range(WORLD) if not (out / f"rank{r}.json").exists()]
    if not run.ok or missing:
        what = (f"timed out after {LAUNCH_TIMEOUT:.0f} s" if run.timed_out
                else f"failed (no report from ranks {missing})")
        raise AssertionError(f"namespace launch {what}:\n{run.story()}")
    return Launch(out, run.seconds, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)])


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDKIT_HOST_ID", "GLOO_SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _say(request, line: str) -> None:
    """A line in pytest's own output even without -s: how the hosts were joined, how long they took."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[two hosts] {line}")


@pytest.fixture(scope="module")
def namespaces(request) -> None:
    why = namespaces_unavailable()
    if why:
        _say(request, f"SKIPPED: Linux namespaces unavailable: {why}")
        pytest.skip(f"Linux namespaces unavailable: {why}")


@pytest.fixture(scope="module")
def two_hosts(namespaces, request, tmp_path_factory) -> tuple[Launch, Network]:
    out = tmp_path_factory.mktemp("two_hosts")
    with Network() as net:
        _say(request, net.describe())
        # In veth mode the port is only probed here, but host 0's network namespace is brand new: nothing in
        # it listens anywhere, so a port free here is free there too.
        port = free_port()
        hosts = []
        for h in range(2):
            # Gloo binds to this interface's address: the made-up hostnames resolve nowhere.
            command = ["env", f"GLOO_SOCKET_IFNAME={net.ifname(h)}", *_torchrun(
                "--nnodes=2", f"--node_rank={h}", "--nproc_per_node=2", f"--master_addr={net.addr[0]}",
                f"--master_port={port}", str(SCRIPT), str(out), "--collectives")]
            hosts.append((net.prefix(h), f"skhost{h}", command))
        launch = _launch(hosts, out, _base_env())
    _say(request, f"2 hosts x 2 ranks: {launch.seconds:.1f} s")
    return launch, net


def _one_host_rank(rank: int, world: int, out: Path) -> None:
    """A rank of the one-host baseline, set up as the torchrun workers of the two hosts are (no host id override,
    no interface pinned, one intra-op thread as torchrun's OMP_NUM_THREADS=1 gives), then two_host_script's own
    rank job: the training and references compared are the two hosts' code, only the launcher differs."""
    for name in ("SHARDKIT_HOST_ID", "GLOO_SOCKET_IFNAME"):
        os.environ.pop(name, None)  # before the group: the topology is built when it starts
    torch.set_num_threads(1)
    dist.init_process_group("shardkit", init_method=f"file://{out / 'store'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    try:
        two_host_script.run_rank(out, collectives=False)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_host(request, tmp_path_factory) -> Launch:
    """The baseline: 4 ranks on this machine, a real single host, so no namespace is needed; harness ranks instead
    of a torchrun launch (nothing compared depends on the launcher)."""
    out = tmp_path_factory.mktemp("one_host")
    start = time.monotonic()
    harness.run(_one_host_rank, WORLD, out, workdir=out / "ranks", backend=None, timeout=LAUNCH_TIMEOUT,
                env={"OMP_NUM_THREADS": "1"})
    launch = Launch(out, time.monotonic() - start,
                    [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)])
    _say(request, f"1 host x 4 ranks: {launch.seconds:.1f} s")
    return launch


def test_host_identity_comes_from_the_namespaces(two_hosts):
    launch, net = two_hosts
    reports = launch.reports
    assert [r["host_id_override"] for r in reports] == [None] * WORLD
    assert [r["hostname"] for r in reports] == ["skhost0", "skhost0", "skhost1", "skhost1"]
    assert [r["gloo_ifname"] for r in reports] == [net.ifname(h) for h in (0, 0, 1, 1)]
    ids = [r["host_id"] for r in reports]
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2], ids
    assert all(i.startswith(f"{r['hostname']}/") for i, r in zip(ids, reports)), ids
    devs = [r["shm_dev"] for r in reports]  # each host's /dev/shm is its own tmpfs
    assert devs[0] == devs[1] and devs[2] == devs[3] and devs[0] != devs[2], devs
    expected = {"host_of": [0, 0, 1, 1], "local_of": [0, 1, 0, 1], "num_hosts": 2}
    assert [r["topology"] for r in reports] == [expected] * WORLD


@pytest.mark.parametrize("check", [
    "check_all_reduce", "check_broadcast", "check_all_gather", "check_reduce_scatter",
    "check_coalesced_all_gather", "check_coalesced_reduce_scatter",
])
def test_collective_across_two_hosts(two_hosts, check):
    launch, _ = two_hosts
    failures = {r["rank"]: r["checks"][check] for r in launch.reports if r["checks"][check] != "ok"}
    assert not failures, "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in failures.items())


def _assert_same(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in actual:
        a, e = actual[name], expected[name]
        assert torch.equal(a, e), f"{what}: {name} differs, max |diff| {(a - e).abs().max().item():.3g}"


def _differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[name], b[name]) for name in a)


def test_ddp_training_on_two_hosts_matches_one_host(two_hosts, one_host):
    two, _ = two_hosts
    assert [r["topology"]["num_hosts"] for r in one_host.reports] == [1] * WORLD
    for launch, label in ((two, "two hosts"), (one_host, "one host")):
        for rank in range(1, WORLD):
            _assert_same(launch.params(rank), launch.params(0), f"{label}: rank {rank} vs rank 0")
    # The two layouts cannot agree bit for bit: one host sums ((g0+g1)+g2)+g3 in shared memory, two hosts
    # sum (g0+g1)+(g2+g3), each host's part first, and float addition is not associative. So each layout
    # must reach, bit for bit, the collective-free training that sums in its order; that this data makes
    # the two orders differ is checked too, or those two comparisons could not tell the orders apart.
    _assert_same(one_host.params(0), one_host.reference("flat"), "one host vs reference-flat")
    _assert_same(two.params(0), two.reference("hier"), "two hosts vs reference-hier")
    assert _differs(two.reference("flat"), two.reference("hier"))
    # ... and the layouts agree to fp32 parity (docs/design.md: rtol 1e-5).
    for name, value in two.params(0).items():
        torch.testing.assert_close(value, one_host.params(0)[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

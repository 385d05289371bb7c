"""Several real hosts on one machine, joined by links of a chosen rate: what the multi-host tests and
benchmarks/hosts.py run on (issue 28's test bed).

    with HostBed(hosts=3, rate_mbit=1000) as bed:        # None: links at veth speed
        result = bed.launch([command_for(h) for h in range(3)], env=env, timeout=120, logs=out_dir)

A host is a network namespace with one veth into a bridge that lives in a switch namespace of its own (the
machine's own network is never touched), and its processes run under ``unshare`` with their own UTS, IPC, mount
and PID namespaces: its own hostname and a private tmpfs on /dev/shm, so shardkit must find the host boundaries
itself (hostname + boot id) and shared memory cannot leak across. With ``rate_mbit`` both directions of every
host's link are shaped by a token bucket (``tc qdisc ... tbf``: the host end shapes what it sends, the switch end
what it receives). netem is not in this kernel, so there is no added delay: a link here is a rate, not a distance.

Host h has address ``10.203.0.{h+1}`` (``bed.addr(h)``); the first host's is the rendezvous address. Names carry
the pid and a random token, so parallel runs never collide; everything made is removed on exit, also on failure,
and killing a host's ``unshare`` kills every process in it (its PID namespace). ``unavailable()`` says why a bed
cannot be made here (not root, no ``unshare``, no ``ip`` or ``tc``), for tests to skip with.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

# A PID namespace too: when `unshare` dies, its child (the namespace's init) is killed (--kill-child) and the
# kernel kills everything else in the namespace with it, torchrun's workers included (they run in sessions of
# their own, out of reach of a process-group kill).
UNSHARE = ["unshare", "--uts", "--ipc", "--mount", "--propagation", "private",
           "--pid", "--fork", "--kill-child", "--mount-proc"]
if os.geteuid() != 0:
    UNSHARE.insert(1, "--map-root-user")  # without root, a user namespace grants the others
# Inside the new namespaces: name the host, give it a /dev/shm of its own, then become the command.
HOST_SHELL = 'hostname "$1" && mount -t tmpfs -o size=256m,mode=1777 shardkit-shm /dev/shm && shift && exec "$@"'


def run_in_session(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; on timeout kill its whole process group, then raise."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def namespaces_unavailable() -> str | None:
    """Why a host's UTS/IPC/mount/PID namespaces cannot be made here, or None."""
    probe = [*UNSHARE, "sh", "-c", HOST_SHELL, "sh", "shardkit-probe", "true"]
    try:
        result = run_in_session(probe, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{shlex.join(probe)}` could not run: {exc}"
    if result.returncode != 0:
        return f"`{shlex.join(probe)}` failed (exit {result.returncode}): {result.stderr.strip()}"
    return None


def unavailable() -> str | None:
    """Why a HostBed cannot be made here (network namespaces need root; `ip`, `tc` and `unshare`), or None."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"`{tool}` is not installed"
    return namespaces_unavailable()


@dataclasses.dataclass
class HostRun:
    """What each host's command did: exit codes, output, the wall time of the whole launch."""
    codes: list[int | None]
    outputs: list[str]
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.codes)

    def story(self) -> str:
        return "\n".join(f"--- host {h} (exit {code}) ---\n{text[-6000:]}"
                         for h, (code, text) in enumerate(zip(self.codes, self.outputs)))


class HostBed:
    """``hosts`` namespace hosts on one bridge, each link at ``rate_mbit`` Mbit/s both ways (None: unshaped)."""

    def __init__(self, hosts: int, rate_mbit: float | None = None) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"HostBed: hosts must be in [1, 200], got {hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"HostBed: rate_mbit must be positive, got {rate_mbit}")
        token = secrets.token_hex(3)
        self.hosts, self.rate_mbit = hosts, rate_mbit
        self.switch = f"shardkit-{os.getpid()}-{token}-sw"
        self.netns = [f"shardkit-{os.getpid()}-{token}-h{h}" for h in range(hosts)]
        # Interface names: at most 15 characters.
        self.host_if = [f"skh{token}{h}" for h in range(hosts)]
        self.switch_if = [f"sks{token}{h}" for h in range(hosts)]
        self.made: list[str] = []

    def addr(self, h: int) -> str:
        return f"10.203.0.{h + 1}"

    def prefix(self, h: int) -> list[str]:
        """What runs a command in host h's network namespace (add UNSHARE + HOST_SHELL for the rest: launch())."""
        return ["ip", "netns", "exec", self.netns[h]]

    def torchrun(self, h: int, ranks_per_host: int, script_and_args: list[str], port: int = 29400) -> list[str]:
        """Host h's command for launch(): torchrun starting ``ranks_per_host`` ranks of the script, gloo bound to the
        host's link (the made-up hostnames resolve nowhere), rendezvous on host 0."""
        return ["env", f"GLOO_SOCKET_IFNAME={self.host_if[h]}", sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={self.hosts}", f"--node_rank={h}", f"--nproc_per_node={ranks_per_host}",
                f"--master_addr={self.addr(0)}", f"--master_port={port}", *script_and_args]

    def describe(self) -> str:
        rate = f"{self.rate_mbit:g} Mbit/s each way (tbf)" if self.rate_mbit else "unshaped veth"
        return f"{self.hosts} namespace hosts on one bridge, links {rate}"

    # --- set-up and tear-down ----------------------------------------------------------------------------
    def __enter__(self) -> HostBed:
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"HostBed: cannot make hosts here: {why}")
        try:
            self._ip("netns", "add", self.switch)
            self.made.append(self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            for h in range(self.hosts):
                ns, host_if, switch_if = self.netns[h], self.host_if[h], self.switch_if[h]
                self._ip("netns", "add", ns)
                self.made.append(ns)
                self._ip("link", "add", host_if, "type", "veth", "peer", "name", switch_if)
                self._ip("link", "set", host_if, "netns", ns)
                self._ip("link", "set", switch_if, "netns", self.switch)
                self._ip("-n", self.switch, "link", "set", switch_if, "master", "br0")
                self._ip("-n", self.switch, "link", "set", switch_if, "up")
                self._ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", host_if)
                self._ip("-n", ns, "link", "set", host_if, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                if self.rate_mbit:
                    self._shape(ns, host_if)  # what host h sends
                    self._shape(self.switch, switch_if)  # what host h receives
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _shape(self, ns: str, ifname: str) -> None:
        rate_bytes = self.rate_mbit * 1e6 / 8
        # The bucket holds 10 ms of traffic (at least 64 KiB): tbf needs a burst of at least rate / HZ to reach
        # its rate, and a deeper one only lets short bursts pass the rate.
        burst = max(int(rate_bytes / 100), 64 << 10)
        self._run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifname, "root", "tbf",
                   "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"])

    def _ip(self, *args: str) -> None:
        self._run(["ip", *args])

    @staticmethod
    def _run(cmd: list[str]) -> None:
        result = run_in_session(cmd, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"HostBed: `{shlex.join(cmd)}` failed: {result.stderr.strip()}")

    def _remove(self) -> None:
        # Deleting a namespace destroys the veth ends in it, and so each pair. Errors mean "was not there".
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    # --- running ---------------------------------------------------------------------------------------------
    def launch(self, commands: list[list[str]], *, env: dict[str, str], timeout: float, logs: Path) -> HostRun:
        """Runs ``commands[h]`` as host h (its network namespace, its own hostname ``host{h}``); see launch_hosts."""
        if len(commands) != self.hosts:
            raise ValueError(f"HostBed.launch: {len(commands)} commands for {self.hosts} hosts")
        return launch_hosts([(self.prefix(h), f"host{h}", command) for h, command in enumerate(commands)],
                            env=env, timeout=timeout, logs=logs)


def launch_hosts(hosts: list[tuple[list[str], str, list[str]]], *, env: dict[str, str], timeout: float,
                 logs: Path) -> HostRun:
    """Runs each (network prefix, hostname, command) as a host: after the prefix (e.g. ``ip netns exec NS``),
    under unshare with that hostname and a /dev/shm of its own, all at once. Waits until every one has exited,
    one has failed (the others would only wait for it), or ``timeout`` s passed; then kills whatever still runs
    (with its PID namespace). Output goes to ``logs/host{h}.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    start = time.monotonic()
    for h, (prefix, hostname, command) in enumerate(hosts):
        # `timeout -s KILL` is for the case where the caller itself dies: no host outlives it for long.
        cmd = ["timeout", "-s", "KILL", str(int(timeout) + 60), *prefix, *UNSHARE, "sh", "-c", HOST_SHELL,
               "sh", hostname, *command]
        log = open(logs / f"host{h}.log", "w+")
        files.append(log)
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    deadline = start + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(code not in (None, 0) for code in codes):
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        timed_out = None in codes and all(code in (None, 0) for code in codes)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # kills `unshare`, and with it the host's PID namespace
                proc.wait()
    outputs = []
    for log in files:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return HostRun([p.returncode for p in procs], outputs, time.monotonic() - start, timed_out)

"""Start-up is bounded: a rank that dies or fails anywhere in ``init_process_group("shardkit")`` makes every peer
raise within 2 s naming it and why, and nothing stays in /dev/shm (the conftest fixture checks it after every
test). Before, the peers waited out the whole init timeout (30 minutes by default), and a creator that died left
its segment behind; a /dev/shm too small for the segment failed rank 0 and left the others waiting.

Run as a script (``python test_startup_failures.py WORLD``) it is the ranks of the small-/dev/shm case: it starts
WORLD ranks and prints one JSON line per rank, then one with what /dev/shm holds afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support import harness  # noqa: E402
from support.collective_cases import topology_env  # noqa: E402

INIT_TIMEOUT = timedelta(seconds=60)  # what the peers used to wait out; the test's deadline is below it


def _kill_myself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_in_start_up(rank: int, victim: int, how: str) -> None:
    """Arranges this rank's part of the case: the victim dies at its point of the start-up, the others maybe
    attach late (so that the creator is inside its attach wait when it dies)."""
    from shardkit import _C

    construct = _C.ProcessGroupShardkit
    if rank == victim and how == "before_attach":
        # Dies where the C++ start-up would begin: after the host exchange and the gloo rendezvous, before it
        # made (creator) or opened (the others) the segment; a moment after its own rendezvous, so that the peers'
        # are done too (a death inside gloo's connect is bounded by its connect timeout instead: _startup.py).
        def die(*args, **kwargs):
            time.sleep(0.3)
            _kill_myself()

        _C.ProcessGroupShardkit = die
    elif rank == victim and how == "creator_after_create":
        # Dies once its segment exists (the name carries its pid), while it waits for the others to attach; it
        # makes the segment a moment after its gloo rendezvous, so that the peers' are done too.
        def late_creator(*args, **kwargs):
            time.sleep(0.3)
            return construct(*args, **kwargs)

        _C.ProcessGroupShardkit = late_creator
        mark = f"-{os.getpid()}-"

        def watch() -> None:
            while not any(mark in name for name in os.listdir("/dev/shm")):
                time.sleep(0.0005)
            _kill_myself()

        threading.Thread(target=watch, daemon=True).start()
    elif how == "creator_after_create":
        def late(*args, **kwargs):
            time.sleep(0.5)
            return construct(*args, **kwargs)

        _C.ProcessGroupShardkit = late


def _init_timed(rank: int, world: int, store_path: str, victim: int, how: str, store_port: int | None = None):
    """init_process_group("shardkit") timed; through a FileStore at ``store_path``, or the TCPStore server at
    ``store_port`` (see the store_port fixture)."""
    import torch.distributed as dist

    import shardkit  # noqa: F401 - registers the backend

    _die_in_start_up(rank, victim, how)
    start = time.monotonic()
    try:
        if store_port is None:
            dist.init_process_group("shardkit", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                    timeout=INIT_TIMEOUT)
        else:
            store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=INIT_TIMEOUT)
            dist.init_process_group("shardkit", store=dist.PrefixStore(store_path, store), rank=rank,
                                    world_size=world, timeout=INIT_TIMEOUT)
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="module")
def store_port():
    """A TCPStore server in the test's process (port 0: the kernel picks a free one), for the ranks' start-up.
    Not a FileStore: a victim killed at an arbitrary moment (creator_after_create kills from a thread) can die
    between the two writes of one FileStore record, and torch's FileStore then spins forever re-reading the torn
    record under its file lock, so every survivor's next Store call hangs (seen in CI: 45 s in
    StartupWatch.publish's compare_set). A TCPStore server drops a client that died mid-message."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                           timeout=INIT_TIMEOUT)
    yield server.port
    del server


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["before_attach", "creator_after_create"])
@pytest.mark.parametrize("world, hosts", [(2, None), (4, None), (4, [0, 0, 1, 1])],
                         ids=["w2", "w4", "2x2hosts"])
def test_a_rank_dying_in_start_up_is_named_by_every_peer_within_2s(ranks, tmp_path: Path, world: int, hosts, how: str,
                                                                   store_port: int):
    # On simulated hosts the other host's ranks cannot watch the victim's pid: they hear of it through the notice.
    victims = [0] if how == "creator_after_create" else [0, world - 1]
    for victim in victims:
        prefix = f"{tmp_path.name}-{victim}"  # this launch's keys on the shared server
        outcomes = ranks.launch(_init_timed, world, prefix, victim, how, store_port=store_port, backend=None,
                                timeout=45, env=topology_env(hosts))
        for outcome in harness.survivors(outcomes, victim):
            assert outcome.value is not None, f"rank {outcome.rank}: the start-up succeeded without rank {victim}"
            elapsed, message = outcome.value
            assert elapsed < 2.0, f"rank {outcome.rank} took {elapsed:.2f} s: {message}"
            assert f"rank(s) {victim} (pid" in message and "exited" in message and "start-up" in message, message
            assert message.startswith(("RuntimeError: shardkit", "StartupFailed: shardkit")), message


def _init_in_a_small_dev_shm(rank: int, world: int, store_path: str):
    return _init_timed(rank, world, store_path, victim=-1, how="none")


SMALL_DEV_SHM_WORLDS = (2, 4)


@pytest.fixture(scope="module")
def small_dev_shm_runs() -> dict[int, list[dict]]:
    """Each world of SMALL_DEV_SHM_WORLDS started in turn in one mount namespace whose /dev/shm is a 1 MB tmpfs
    (one interpreter, one namespace for both): world -> the JSON lines its ranks and then /dev/shm's listing gave."""
    from support.hostbed import UNSHARE, namespaces_unavailable, run_in_session

    why = namespaces_unavailable()
    if why:
        pytest.skip(f"no mount namespace for a small /dev/shm: {why}")
    # 1 MB: less than one rank's slots (the segment takes 2 x ranks x 1 MiB and a header).
    shell = 'mount -t tmpfs -o size=1m,mode=1777 shardkit-shm /dev/shm && exec "$@"'
    worlds = [str(w) for w in SMALL_DEV_SHM_WORLDS]
    result = run_in_session([*UNSHARE, "sh", "-c", shell, "sh", sys.executable, __file__, *worlds], timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    runs: dict[int, list[dict]] = {w: [] for w in SMALL_DEV_SHM_WORLDS}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            parsed = json.loads(line)
            runs[parsed["world"]].append(parsed)
    return runs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", SMALL_DEV_SHM_WORLDS)
def test_a_dev_shm_without_room_for_the_segment_fails_every_rank_within_2s(small_dev_shm_runs, world: int):
    lines = small_dev_shm_runs[world]
    by_rank = {line["rank"]: line for line in lines if "rank" in line}
    assert sorted(by_rank) == list(range(world)), lines
    for rank, line in by_rank.items():
        assert line["error"] is not None, f"rank {rank} started in a /dev/shm without room: {line}"
        elapsed, message = line["error"]
        assert elapsed < 2.0, f"rank {rank} took {elapsed:.2f} s: {message}"
        assert "No space left on device" in message and "rank 0" in message, message
        if rank:  # the others hear rank 0's reason
            assert "the group's start-up failed" in message, message
    left = next(line["dev_shm"] for line in lines if "dev_shm" in line)
    assert left == [], f"/dev/shm after the failed start-up: {left}"


def _script(worlds: list[int]) -> None:
    """The small-/dev/shm case's ranks (run inside its mount namespace), each world in turn: one JSON line per
    rank, then /dev/shm's listing."""
    for world in worlds:
        workdir = Path(tempfile.mkdtemp())
        outcomes = harness.launch(_init_in_a_small_dev_shm, world, str(workdir / "store"), backend=None,
                                  workdir=workdir, timeout=60)
        for outcome in outcomes:
            print(json.dumps({"world": world, "rank": outcome.rank, "error": outcome.value,
                              "failure": outcome.error}), flush=True)
        print(json.dumps({"world": world, "dev_shm": sorted(os.listdir("/dev/shm"))}), flush=True)


if __name__ == "__main__":
    _script([int(w) for w in sys.argv[1:]])


_QUIET_WAIT = """
import threading, time
from datetime import timedelta
import torch.distributed as dist
from shardkit import _startup
server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
watch = _startup.StartupWatch(client, 0, [0], timedelta(seconds=30))
threading.Timer(1.0, lambda: server.set("late", "1")).start()
started = time.monotonic()
watch.wait_for(["late"], "waiting for a late key")
print(f"waited {time.monotonic() - started:.2f} s")
"""


def test_a_start_up_wait_on_a_tcp_store_prints_no_socket_warning():
    """A start-up wait that lasts (a peer still starting) prints nothing: under torchrun (a TCPStore) each wait
    that timed out in a slice made torch's client log '[c10d] waitForInput: poll for socket ... timed out', six of
    them on the first screen of `make demo`. The key comes a second late; the wait sees it within a poll."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _QUIET_WAIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    waited = float(done.stdout.split()[1])
    assert 1.0 <= waited < 1.5, done.stdout
    assert "waitForInput" not in done.stderr and "timed out" not in done.stderr, done.stderr

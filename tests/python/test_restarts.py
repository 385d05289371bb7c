"""Restarts under real ``torchrun --max-restarts``: a rank SIGKILLed while training, and the next attempt starts up
and trains to the end (issue #39).

torchrun keeps one TCPStore across its restart rounds, holding every key the killed attempt wrote; the shardkit
backend's start-up reads only its own attempt's (python/shardkit/_attempt.py), and torch's gloo runs on
``shardkit.attempt_store()``. The worker is support/restart_script.py: on attempt A < the kills, rank 1 kills itself
after 3 steps; the last attempt trains every front listed, on one group (here torch's FSDP2 and DDP on gloo: each
killed attempt trains the next). The four shardkit fronts' kill-restart cycles are test_resume.py's (each restart
starts up, resumes from the newest checkpoint, ends bitwise equal and leaves no segment). Without torchrun: the
agreement on a Store holding a dead attempt's entry; gloo reading a dead group's listener address from a shared
Store (the cause, for torch's own backends) and not on attempt_store; a segment left by a start-up killed in its
attach, removed by the next start-up. ``make chaos``
(tests/chaos/restart_cycles.py) runs 20 cycles per front at random moments.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from support import harness

SCRIPT = Path(__file__).parent / "support" / "restart_script.py"


def _segments(tag: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if f"shardkit-{tag}-" in n} if os.path.isdir("/dev/shm") else set()


def _run_cycles(tmp_path: Path, fronts: list[str]) -> None:
    """Runs a job of len(fronts) killed attempts and a last one that trains every front; asserts that it exited 0,
    that every attempt started on both ranks, that the last finished, and that no segment is left."""
    tag = f"restart{uuid.uuid4().hex[:8]}"
    markers = tmp_path / "markers"
    markers.mkdir()
    kills = len(fronts)
    shardkit = not fronts[0].startswith("torch_")
    result = harness.run_torchrun(SCRIPT, 2, "--front", ",".join(fronts), "--markers", str(markers),
                                  "--kill-at", "3", "--kills", str(kills), "--steps", "4",
                                  torchrun_args=["--max-restarts", str(kills)], timeout=60.0 * (kills + 1),
                                  env={"SHARDKIT_SHM_TAG": tag})
    found = sorted(p.name for p in markers.iterdir() if not p.name.endswith((".began", ".error")))
    assert result.returncode == 0, f"torchrun exited {result.returncode}; markers {found}\n{result.stderr[-6000:]}"
    # A killed attempt's rank 0 may raise before torchrun stops it: for its peer's death (shardkit's error names
    # that peer; torch's gloo says "Connection closed by peer" or "reset by peer").
    for attempt in range(kills + 1):
        error = markers / f"attempt{attempt}.rank0.error"
        if error.exists():
            victim = (markers / f"attempt{attempt}.rank1.began").read_text().split()[1]
            says = [f"rank(s) 1 (pid {victim}) exited"] if shardkit else ["closed by peer", "reset by peer"]
            assert attempt < kills and any(s in error.read_text() for s in says), error.read_text()
    assert not (markers / f"attempt{kills}.rank1.error").exists()
    # Every attempt started on both ranks, and each killed one lost its rank 1.
    expected = sorted([f"attempt{a}.rank{r}.started" for a in range(kills + 1) for r in range(2)]
                      + [f"attempt{a}.killed" for a in range(kills)]
                      + [f"attempt{kills}.rank{r}.done" for r in range(2)])
    assert found == expected, result.stderr[-6000:]
    done = (markers / f"attempt{kills}.rank0.done").read_text().splitlines()
    assert [line.split()[0] for line in done] == fronts
    assert _segments(tag) == set()


@pytest.mark.timeout(240)
def test_torch_fsdp2_and_ddp_on_gloo_restart_on_attempt_store(tmp_path):
    """torch's own FSDP2 and DDP on gloo, started on shardkit.attempt_store(): gloo's rendezvous reads no killed
    attempt's listener address (plain init_process_group("gloo"): 3 restarts of 5 started here, a race)."""
    _run_cycles(tmp_path, ["torch_fsdp2", "torch_ddp"])


@pytest.mark.timeout(60)
def test_attempt_scopes_ignore_what_a_killed_attempt_left(ranks):
    """The agreement itself, three times on one Store holding a killed attempt's entry (its rank 1's nonce, never
    answered): every rank agrees the same generation each time, a new one each time."""
    results = ranks.run(_agree_three_times, 3)
    assert results[0] == results[1] == results[2], results
    assert results[0][0] < results[0][1] < results[0][2], results


def _agree_three_times(rank: int, world_size: int) -> list[int]:
    from datetime import timedelta

    import torch.distributed as dist

    from shardkit import _attempt

    store = dist.PrefixStore("agree-test", dist.distributed_c10d._get_default_store())
    if rank == 0:
        store.set("shardkit/attempt/ask/1", "0" * 24)
    dist.barrier()
    return [_attempt.agree_generation(store, rank, world_size, timedelta(seconds=20), f"rank {rank}")
            for _ in range(3)]


@pytest.mark.timeout(90)
def test_gloo_reads_a_dead_attempts_address_unless_on_attempt_store(ranks):
    """The cause, as torchrun's shared Store shows it to torch's gloo: a gloo group starts and its ranks exit; on
    the same Store, a second group's rank 0 starts before its rank 1 has written anything (here: rank 1 never
    comes, so no race decides it). gloo's rendezvous keys (each rank's listener address) are still the first group's:
    rank 0 reads rank 1's dead address and fails (Connection refused). A third group, on attempt_store, connects with
    rank 1 a second late."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    first = ranks.run(_gloo_attempt, 2, server.port, 0.0, False, backend=None)
    assert [ok for ok, _ in first] == [True, True], first
    # gloo gives up on the dead address only after about 5 times its timeout (measured: 25 s at 5 s, 5 s at 1 s).
    # 1 s here: no timeout lets a group without its rank 1 connect, and the keys it reads are there already.
    plain = ranks.run(_gloo_attempt, 2, server.port, None, False, 1.0, backend=None)
    # A connect to the dead listener: refused, or (the port's state after the exit varies) timed out.
    assert not plain[0][0] and "connectFullMesh failed" in plain[0][1], plain
    assert "Connection refused" in plain[0][1] or "Connect timeout" in plain[0][1], plain
    scoped = ranks.run(_gloo_attempt, 2, server.port, 1.0, True, backend=None)
    assert [ok for ok, _ in scoped] == [True, True], scoped


def _gloo_attempt(rank: int, world_size: int, port: int, late: float | None, scoped: bool,
                  timeout: float = 5.0) -> tuple[bool, str]:
    """A gloo group's start-up on the Store at ``port``: (connected, error). ``late``: seconds rank 1 waits first
    (None: rank 1 does not take part); ``timeout``: gloo's."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    if scoped:
        import shardkit
    if rank == 1:
        if late is None:
            return False, "absent"
        time.sleep(late)  # after the imports, whose time varies more than that
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=30))
    if scoped:
        store, _, _ = shardkit.attempt_store(store, rank, world_size, timeout=timedelta(seconds=30))
    try:
        # The Store's keys as init_process_group("gloo") names them for the default group.
        group = dist.ProcessGroupGloo(dist.PrefixStore("default_pg/0//cpu/", store), rank, world_size,
                                      timedelta(seconds=timeout))
    except RuntimeError as error:
        return False, str(error)
    # Connected: wait for the peer to be connected too before this rank drops the group; a rank that returned at
    # once closed its side while the other was still connecting ("Connection closed by peer": 2 runs in 6 here).
    group.barrier().wait()
    return True, ""


@pytest.mark.timeout(90)
def test_the_next_start_up_removes_a_segment_that_a_killed_start_up_left(ranks, tmp_path):
    """Every rank of a start-up killed between the segment's creation and the last attach (its creator waiting for
    rank 1, which never attaches): nobody of that attempt is left to remove the segment. The next start-up on the
    same Store, as torchrun's restart makes it, removes it."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    tag = os.environ["SHARDKIT_SHM_TAG"]
    before = _segments(tag)
    killed = ranks.launch(_start_up_on, 2, server.port, str(tmp_path / "rank0.pid"), backend=None, timeout=30.0)
    assert [o.exitcode for o in killed] == [-9, -9], killed
    left = _segments(tag) - before
    assert len(left) == 1, left  # what the killed start-up left
    assert ranks.run(_start_up_on, 2, server.port, None, backend=None) == [True, True]
    assert not left & _segments(tag)


def _process_is_gone(pid: int) -> bool:
    """Exited (a zombie until its parent reaps it, then no /proc entry at all)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _start_up_on(rank: int, world_size: int, port: int, kill_in_attach_via: str | None) -> bool:
    """One start-up of the shardkit backend. With ``kill_in_attach_via`` (a file for rank 0's pid): rank 1 never
    attaches; rank 0 SIGKILLs itself once its segment exists, and only then does rank 1 SIGKILL itself. In that order
    rank 0 never sees its peer die (it would raise and remove the segment itself)."""
    import signal
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from shardkit import _C

    if kill_in_attach_via is not None:
        tag = os.environ["SHARDKIT_SHM_TAG"]
        pid_file = Path(kill_in_attach_via)
        if rank == 0:
            pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
            pid_file.with_suffix(".tmp").rename(pid_file)
        else:
            _C.ProcessGroupShardkit = lambda *args, **kwargs: time.sleep(60)  # never attaches

        def die_in_order() -> None:
            while not _segments(tag):
                time.sleep(0.0005)
            if rank == 1:
                while not pid_file.exists() or not _process_is_gone(int(pid_file.read_text())):
                    time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die_in_order, daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=30))
    dist.init_process_group("shardkit", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    dist.barrier()
    dist.destroy_process_group()
    return True

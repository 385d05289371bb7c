"""shardkit.integrations.torchft.ProcessGroupShardkit, torchft's reconfigurable process group on shardkit's backend.

- Every op torchft's Manager and its wrappers issue gives what torchft's own ProcessGroupGloo gives on the same
  inputs (bitwise for data movement and for sums whose order cannot matter; against a float64 or rank-order
  reference where gloo refuses the op or reduces in another order), at world 2 and 3, on one host and on two
  simulated hosts.
- abort() from another thread ends an allreduce that its peer never issues within ~1 s, with an error naming the
  quorum and the rank; the peer's group is ended too; the next configure works.
- 200 configures in a row, the world shrinking and growing, some aborted mid-op: no /dev/shm segment, fd or thread
  left behind.
- Isolation: a torchft group's peer dies; the group's op fails naming it, errored() reports it, and the process's
  shardkit default group goes on. A group made without isolation, the control, takes the default group down with it.

Ranks run through the harness (backend=None: the ranks make their groups themselves), and reach one TCPStore on port
0 that the test process hosts, as torchft's lighthouse-given addresses ("host:port/prefix") reach theirs.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from support.collective_cases import topology_env

# (world size, host of each rank)
TOPOLOGIES = {
    "1host-w2": (2, None),
    "1host-w3": (3, None),
    "2hosts-w2": (2, [0, 1]),
    "2hosts-w3": (3, [0, 0, 1]),
}


@pytest.fixture(scope="module")
def store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield store.port
    del store


def _configure(pg, port: int, prefix: str, rank: int, world: int, quorum: int, global_ranks=None) -> None:
    pg.configure(f"127.0.0.1:{port}/{prefix}", str(rank), rank, world, quorum_id=quorum, group_rank=0,
                 group_world_size=1, global_ranks=global_ranks)


def _done(work) -> list:
    work.wait()
    return work


# --- every op, against torchft's gloo group ----------------------------------------------------------------------
def _ops_match_gloo(rank, world, port, prefix):
    from torch.distributed.distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        ReduceOp,
        ReduceScatterOptions,
    )
    from torchft.process_group import ProcessGroupGloo

    from shardkit.integrations.torchft import ProcessGroupShardkit

    sk, gloo = ProcessGroupShardkit(timeout=timedelta(seconds=20)), ProcessGroupGloo(timeout=timedelta(seconds=20))
    _configure(sk, port, f"{prefix}/sk", rank, world, quorum=3)
    _configure(gloo, port, f"{prefix}/gloo", rank, world, quorum=3)
    assert sk.getBackendName() == "torchft-shardkit" and sk.size() == world
    checked = []

    def data(r, n=1000, integral=False, salt=0):
        g = torch.Generator().manual_seed(1000 * r + salt)
        if integral:  # sums of small integers are exact in any order: gloo's and shardkit's agree bitwise
            return torch.randint(-50, 50, (n,), generator=g).float()
        return torch.randn(n, generator=g)

    def rank_order_sum(tensors):  # shardkit's reduction: f32, rank 0 first
        total = tensors[0].clone()
        for t in tensors[1:]:
            total += t
        return total

    def on_both(op):  # op(pg) -> the tensors it produced; returns (shardkit's, gloo's)
        return op(sk), op(gloo)

    # allreduce, SUM: integral data bitwise equal to gloo; random data bitwise equal to the rank-order f32 sum
    # (shardkit's order) and close to gloo's (which adds in another order at world 3).
    for integral in (True, False):
        def allreduce(pg, integral=integral):
            t = data(rank, integral=integral)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            work = pg.allreduce([t], opts)
            # the Future's value, which torchft's Manager chains its callbacks on: the tensor, reduced in place
            assert work.get_future().wait()[0].data_ptr() == t.data_ptr()
            return t
        mine, theirs = on_both(allreduce)
        expected = rank_order_sum([data(r, integral=integral) for r in range(world)])
        assert torch.equal(mine, expected), "allreduce SUM differs from the rank-order sum"
        if integral:
            assert torch.equal(mine, theirs)
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    checked.append("allreduce SUM")
    # MAX: bitwise with gloo. AVG (gloo has none): the float64 mean.
    def allreduce_max(pg):
        t = data(rank)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MAX
        pg.allreduce([t], opts).wait()
        return t
    mine, theirs = on_both(allreduce_max)
    assert torch.equal(mine, theirs)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.AVG
    t = data(rank)
    sk.allreduce([t], opts).wait()
    mean = torch.stack([data(r).double() for r in range(world)]).mean(0)
    torch.testing.assert_close(t.double(), mean, rtol=1e-6, atol=1e-6)
    checked += ["allreduce MAX", "allreduce AVG"]

    # allreduce_coalesced
    def coalesced(pg):
        ts = [data(rank, 100, True, 1), data(rank, 7, True, 2)]
        _done(pg.allreduce_coalesced(ts, AllreduceCoalescedOptions()))
        return ts
    mine, theirs = on_both(coalesced)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    checked.append("allreduce_coalesced")

    # allgather, allgather_into_tensor_coalesced
    def allgather(pg):
        out = [[torch.empty(300) for _ in range(world)]]
        _done(pg.allgather(out, [data(rank, 300)], AllgatherOptions()))
        return out[0]
    mine, theirs = on_both(allgather)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert all(torch.equal(mine[r], data(r, 300)) for r in range(world))

    def allgather_coalesced(pg):
        outs = [torch.empty(world * 5), torch.empty(world * 3)]
        ins = [data(rank, 5), torch.arange(3.0) + 10 * rank]
        _done(pg.allgather_into_tensor_coalesced(outs, ins, AllgatherOptions()))
        return outs
    mine, theirs = on_both(allgather_coalesced)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert torch.equal(mine[0], torch.cat([data(r, 5) for r in range(world)]))
    checked += ["allgather", "allgather_into_tensor_coalesced"]

    # broadcast from every root (also through torchft's broadcast_one)
    for root in range(world):
        def broadcast(pg, root=root):
            t = data(rank, 257, salt=root)
            opts = BroadcastOptions()
            opts.rootRank = root
            _done(pg.broadcast([t], opts))
            return t
        mine, theirs = on_both(broadcast)
        assert torch.equal(mine, theirs) and torch.equal(mine, data(root, 257, salt=root))
    t = torch.zeros(4)
    if rank == world - 1:
        t += 5
    sk.broadcast_one(t, world - 1).wait()
    assert torch.equal(t, torch.full((4,), 5.0))
    checked.append("broadcast")

    # reduce_scatter and reduce_scatter_tensor_coalesced: torchft's gloo group refuses both; the rank-order sum.
    with pytest.raises(RuntimeError, match="does not support reduce_scatter"):
        gloo.reduce_scatter([torch.empty(3)], [[torch.empty(3)] * world], ReduceScatterOptions())
    chunks = [[data(r, 64, salt=10 + k) for k in range(world)] for r in range(world)]  # chunks[r][k]: r's for k
    out = torch.empty(64)
    _done(sk.reduce_scatter([out], [chunks[rank]], ReduceScatterOptions()))
    assert torch.equal(out, rank_order_sum([chunks[r][rank] for r in range(world)]))
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.AVG
    flat = [torch.cat(chunks[r]) for r in range(world)]
    second = [data(r, 6 * world, salt=20).double() for r in range(world)]
    outs = [torch.empty(64), torch.empty(6, dtype=torch.float64)]
    _done(sk.reduce_scatter_tensor_coalesced(outs, [flat[rank].clone(), second[rank].clone()], opts))
    mean0 = torch.stack([f.double() for f in flat]).mean(0)[rank * 64:(rank + 1) * 64]
    mean1 = torch.stack(second).mean(0)[rank * 6:(rank + 1) * 6]
    torch.testing.assert_close(outs[0].double(), mean0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], mean1, rtol=1e-12, atol=1e-12)
    checked += ["reduce_scatter", "reduce_scatter_tensor_coalesced"]

    # alltoall_base, uneven splits: rank r sends (r + k + 1) elements to rank k
    def alltoall(pg):
        send = [r * 100 + rank * 10 + k for k in range(world) for r in range(rank + k + 1)]
        recv_splits = [k + rank + 1 for k in range(world)]
        out = torch.empty(sum(recv_splits))
        _done(pg.alltoall_base(out, torch.tensor(send, dtype=torch.float32), recv_splits,
                               [rank + k + 1 for k in range(world)], AllToAllOptions()))
        return out
    mine, theirs = on_both(alltoall)
    assert torch.equal(mine, theirs)
    checked.append("alltoall_base")

    _done(sk.barrier(BarrierOptions()))
    _done(sk.barrier())
    checked.append("barrier")

    # send / recv around a ring (what torchft's checkpoint transport uses), tags as it uses them
    def ring(pg):
        got = torch.empty(1000)
        sent = pg.send([data(rank, salt=5)], (rank + 1) % world, 2)
        received = pg.recv([got], (rank - 1) % world, 2)
        received.wait(timedelta(seconds=10))
        sent.wait()
        return got
    mine, theirs = on_both(ring)
    assert torch.equal(mine, theirs) and torch.equal(mine, data((rank - 1) % world, salt=5))
    checked.append("send/recv")

    assert sk.errored() is None
    sk.shutdown()
    gloo.shutdown()
    return checked


@pytest.mark.timeout(100)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_every_op_matches_torchft_gloo(ranks, store_port, topology):
    world, hosts = TOPOLOGIES[topology]
    results = ranks.run(_ops_match_gloo, world, store_port, f"ops-{uuid.uuid4().hex}", backend=None, timeout=90,
                        env=topology_env(hosts))
    assert results[0] == ["allreduce SUM", "allreduce MAX", "allreduce AVG", "allreduce_coalesced", "allgather",
                          "allgather_into_tensor_coalesced", "broadcast", "reduce_scatter",
                          "reduce_scatter_tensor_coalesced", "alltoall_base", "barrier", "send/recv"]


# --- abort mid-op ------------------------------------------------------------------------------------------------
def _abort_mid_op(rank, world, port, prefix, one_host):
    from torch.distributed.distributed_c10d import AllreduceOptions

    from shardkit.integrations.torchft import ProcessGroupShardkit

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    pg = ProcessGroupShardkit(timeout=timedelta(seconds=30))
    outcome = {}
    # set_timeout: the current group's ops wait that long (and the next configure's start-up).
    _configure(pg, port, f"{prefix}/q5", rank, world, quorum=5)
    if rank == 0:
        pg.set_timeout(timedelta(seconds=0.5))
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            pg.allreduce([torch.ones(10)], AllreduceOptions()).wait()
        outcome["timed_out_after_s"] = time.monotonic() - start
        outcome["timeout_error"] = str(failure.value)
        pg.set_timeout(timedelta(seconds=30))
        store.set(f"{prefix}/timed-out", "1")
    else:
        store.wait([f"{prefix}/timed-out"])
    # A receive that waits for a send that never comes (torchft's checkpoint transport's), aborted the same way.
    _configure(pg, port, f"{prefix}/q6", rank, world, quorum=6)
    if rank == 0:
        work = pg.recv([torch.empty(10)], 1, 3)
        threading.Timer(0.3, pg.abort).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            work.wait()
        outcome["recv_ended_after_s"] = time.monotonic() - start
        outcome["recv_error"] = str(failure.value)
        store.set(f"{prefix}/recv-aborted", "1")
    else:  # (ending its own group closes the connection the receive waits on: only once rank 0 is done)
        store.wait([f"{prefix}/recv-aborted"])
    _configure(pg, port, f"{prefix}/q7", rank, world, quorum=7)
    if rank == 0:  # an allreduce rank 1 never issues, aborted from another thread after 0.3 s
        aborted_at = {}

        def abort_later():
            time.sleep(0.3)
            aborted_at["t"] = time.monotonic()
            pg.abort()

        work = pg.allreduce([torch.ones(1000)], AllreduceOptions())  # asynchronous: queued on the group's worker
        aborter = threading.Thread(target=abort_later)
        aborter.start()
        with pytest.raises(RuntimeError) as failure:
            work.wait()
        outcome["ended_after_abort_s"] = time.monotonic() - aborted_at["t"]
        aborter.join()
        outcome["error"] = str(failure.value)
        outcome["errored"] = str(pg.errored())  # the abort, until the next configure (as torchft's NCCL group)
        store.set(f"{prefix}/aborted", "1")
    else:
        store.wait([f"{prefix}/aborted"])
        if one_host:  # its own group learns of the abort too (the segment's flag): its next op fails with the reason
            with pytest.raises(RuntimeError) as failure:
                pg.allreduce([torch.ones(10)], AllreduceOptions()).wait()
            outcome["error"] = str(failure.value)
            assert pg.errored() is not None
        # Across hosts it is not tried: rank 0's gloo allreduce, given up on, is still posted on the connection
        # between the hosts (gloo cannot cancel it), and another op issued there now would be matched with it
        # (docs/reliability.md, "A rank dies while training"). torchft configures the next quorum instead.
    # The next quorum works.
    _configure(pg, port, f"{prefix}/q8", rank, world, quorum=8)
    assert pg.errored() is None
    t = torch.full((5,), float(rank + 1))
    pg.allreduce([t], AllreduceOptions()).wait()
    assert torch.equal(t, torch.full((5,), 3.0))
    pg.shutdown()
    return outcome


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [None, [0, 1]], ids=["1host", "2hosts"])
def test_abort_ends_an_op_in_flight_naming_quorum_and_rank(ranks, store_port, hosts):
    first, second = ranks.run(_abort_mid_op, 2, store_port, f"abort-{uuid.uuid4().hex}", hosts is None,
                              backend=None, timeout=50, env=topology_env(hosts))
    reason = "the process group of quorum 7 was aborted by rank 0"
    assert reason in first["error"], first["error"]
    assert first["ended_after_abort_s"] < 1.0, first
    assert reason in first["errored"], first["errored"]
    assert "recv from rank 1 did not complete" in first["recv_error"], first["recv_error"]
    assert "the process group of quorum 6 was aborted by rank 0" in first["recv_error"], first["recv_error"]
    assert first["recv_ended_after_s"] < 1.3, first
    assert 0.4 < first["timed_out_after_s"] < 2.0 and "Timed out" in first["timeout_error"], first
    if hosts is None:
        assert reason in second["error"], second["error"]


# --- 200 configures ----------------------------------------------------------------------------------------------
CYCLES = 200


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(measure, baseline: int | None = None, within: float = 5.0) -> int:
    """measure() after a garbage collection, polled until it is back to ``baseline`` (detached Store threads end
    within ~0.5 s) or ``within`` seconds passed; without a baseline, measured once."""
    import gc

    gc.collect()
    deadline = time.monotonic() + within
    while True:
        value = measure()
        if baseline is None or value <= baseline or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _many_configures(rank, world, port, prefix):
    from torch.distributed.distributed_c10d import AllreduceOptions

    from shardkit.integrations.torchft import ProcessGroupShardkit

    tag = os.environ["SHARDKIT_SHM_TAG"]
    # torchft's configure connects a new TCPStore client each time. In this sandbox (gVisor) about every 26th new
    # connection to a TCPStore stalls 5 s before the server sees the client's first message (plain TCPStores show
    # it, without shardkit), which would make this test's time mostly stalls: the ranks reuse one client here.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))

    def store_client(store_addr: str, timeout: timedelta) -> dist.Store:
        return dist.PrefixStore(store_addr.partition("/")[2], store)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr("torchft.process_group.create_store_client", store_client)
    pg = ProcessGroupShardkit(timeout=timedelta(seconds=20))

    def cycle(i: int) -> None:
        # Every 4th quorum, rank 2 is out (the world shrinks to 2, then grows back); every 10th, rank 0 aborts an
        # allreduce the others never issue.
        members = [0, 1] if i % 4 == 3 else [0, 1, 2]
        if rank not in members:
            return
        _configure(pg, port, f"{prefix}/{i}", members.index(rank), len(members), quorum=i, global_ranks=members)
        if i % 10 == 5:
            if rank == 0:
                work = pg.allreduce([torch.ones(8)], AllreduceOptions())
                timer = threading.Timer(0.02, pg.abort)
                timer.start()
                with pytest.raises(RuntimeError, match=f"quorum {i} was aborted"):
                    work.wait()
                timer.join()
            return
        t = torch.full((16,), float(rank + 1))
        pg.allreduce([t], AllreduceOptions()).wait()
        assert torch.equal(t, torch.full((16,), float(sum(m + 1 for m in members)))), (i, t)

    cycle(0)  # what the first group leaves for the process's life (torch's and gloo's own state)
    pg.shutdown()
    threads, fds = _settled(_threads), _settled(_fds)
    start = time.monotonic()
    for i in range(1, CYCLES + 1):
        cycle(i)
    per_configure = (time.monotonic() - start) / CYCLES
    pg.shutdown()
    after_threads, after_fds = _settled(_threads, threads), _settled(_fds, fds)
    assert after_threads <= threads, f"rank {rank}: {after_threads} threads after {CYCLES} configures, {threads} before"
    assert after_fds <= fds, f"rank {rank}: {after_fds} fds after {CYCLES} configures, {fds} before"
    segments = [n for n in os.listdir("/dev/shm") if f"shardkit-{tag}-" in n]
    assert not segments, segments
    monkeypatch.undo()
    return per_configure


@pytest.mark.timeout(120)
def test_many_configures_leave_nothing_behind(ranks, store_port):
    per_configure = ranks.run(_many_configures, 3, store_port, f"cycles-{uuid.uuid4().hex}", backend=None,
                              timeout=110)
    print(f"per configure (configure + one allreduce, world 2-3, one host): {1e3 * max(per_configure):.1f} ms")


# --- isolation -----------------------------------------------------------------------------------------------------
def _isolation(rank, world, port, prefix, default_store):
    from torch.distributed.distributed_c10d import AllreduceOptions

    import shardkit
    from shardkit.integrations import torchft as skft

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    if rank < 2:  # ranks 0 and 1: a shardkit job of their own (its default group), which must outlive the peer
        dist.init_process_group("shardkit", init_method=f"file://{default_store}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
    outcome = {}
    # Phase 1: the torchft group {0, 1, 2} (global ranks 0, 2, 4, as torchft's Manager numbers replica groups of
    # size 2); rank 2 dies.
    # Phase 2, the control: the same with a group made without isolation, {0, 1, 3}; rank 3 dies.
    for phase, (victim, isolated) in enumerate([(2, True), (3, False)]):
        members = [0, 1, victim]
        if rank not in members:
            continue
        skft.ProcessGroupShardkit._isolated = isolated
        pg = skft.ProcessGroupShardkit(timeout=timedelta(seconds=20))
        _configure(pg, port, f"{prefix}/{phase}", members.index(rank), 3, quorum=phase,
                   global_ranks=[2 * m for m in members])
        t = torch.ones(4)
        pg.allreduce([t], AllreduceOptions()).wait()
        assert torch.equal(t, torch.full((4,), 3.0))
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            pg.allreduce([torch.ones(1000)], AllreduceOptions()).wait()
        outcome[f"{phase}/error"] = str(failure.value)
        outcome[f"{phase}/error_after_s"] = time.monotonic() - start
        outcome[f"{phase}/errored"] = str(pg.errored())
        # The default group: does it still work?
        t = torch.full((3,), float(rank + 1))
        try:
            dist.all_reduce(t)
            outcome[f"{phase}/default"] = t.tolist()
        except RuntimeError as error:
            outcome[f"{phase}/default"] = str(error)
        time.sleep(0.5)  # deaths are recorded in the background: give the record time to show
        # How many deaths the job's Store (the default group's) holds: add(0) reads the count.
        outcome[f"{phase}/job_deaths_recorded"] = shardkit.backend.cpu_backend().job_store().add("shardkit/deaths", 0)
        if phase == 0:
            store.set(f"{prefix}/phase0-done/{rank}", "1")
            store.wait([f"{prefix}/phase0-done/0", f"{prefix}/phase0-done/1"])
        pg.shutdown()
    return outcome


DEAD = r"rank\(s\) {} \(pid \d+\) exited"  # how shardkit names a rank that died (its global rank)


@pytest.mark.timeout(90)
def test_a_failed_torchft_group_leaves_the_other_groups_working(ranks, store_port, tmp_path):
    outcomes = ranks.launch(_isolation, 4, store_port, f"isolation-{uuid.uuid4().hex}", str(tmp_path / "default"),
                            backend=None, timeout=80)
    for victim in (2, 3):
        assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    for survivor in outcomes[:2]:
        assert survivor.ok, survivor.error
        got = survivor.value
        # The isolated group's op fails naming the dead rank (global rank 4), and errored() says so.
        assert re.search(DEAD.format(4), got["0/error"]), got["0/error"]
        assert got["0/error_after_s"] < 5.0, got
        assert re.search(DEAD.format(4), got["0/errored"]), got["0/errored"]
        # The default group goes on; the job's Store has no death record from the torchft group.
        assert got["0/default"] == [3.0, 3.0, 3.0], got["0/default"]
        assert got["0/job_deaths_recorded"] == 0
        # The control: without isolation, the torchft group's failure aborts the default group too.
        assert re.search(DEAD.format(6), got["1/error"]), got["1/error"]
        assert isinstance(got["1/default"], str) and re.search(DEAD.format(6), got["1/default"]), got["1/default"]
        assert got["1/job_deaths_recorded"] >= 1


# --- comm=shardkit.Quantized(...) -----------------------------------------------------------------------------------
def _quantized(rank, world, port, prefix):
    from torch.distributed.distributed_c10d import AllreduceOptions

    import shardkit
    from shardkit.integrations.torchft import ProcessGroupShardkit

    exact, quantized = ProcessGroupShardkit(), ProcessGroupShardkit(comm=shardkit.Quantized(grads="int8"))
    _configure(exact, port, f"{prefix}/exact", rank, world, quorum=1)
    _configure(quantized, port, f"{prefix}/int8", rank, world, quorum=1)
    inputs = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    results = []
    for pg in (exact, quantized):
        t = inputs[rank].clone()
        pg.allreduce([t], AllreduceOptions()).wait()
        results.append(t)
    sent = quantized._quorum.backend.inter_host_bytes()
    exact.shutdown()
    quantized.shutdown()
    return results, sent


@pytest.mark.timeout(60)
def test_quantized_cross_replica_bytes(ranks, store_port):
    """comm=shardkit.Quantized(grads="int8"): the sum crosses hosts as int8 records (1 byte and 1/256 of a scale
    per element instead of 4), and is the exact sum within int8's rounding."""
    (mine, sent), _ = ranks.run(_quantized, 2, store_port, f"quantized-{uuid.uuid4().hex}", backend=None,
                                timeout=50, env=topology_env([0, 1]))
    exact, quantized = mine
    assert not torch.equal(exact, quantized)  # int8 on the wire between the hosts
    torch.testing.assert_close(quantized, exact, rtol=0, atol=0.05)
    assert 0 < sent < 4096 * 4 / 2, sent  # int8 records: under half of the f32 bytes

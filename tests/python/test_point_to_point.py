"""Point-to-point on the shardkit backend: the direct route between two ranks of one host (csrc/comm/local_p2p.h: the
receiver reads the bytes from the sender's memory; a descriptor and a receipt travel over gloo) and gloo for the
rest, against the exact bytes sent.

Asserted, on one host and on 2 simulated hosts (a pair on one host goes direct, a pair across hosts through gloo):
every message arrives intact, whatever its dtype and size (either side of SHARDKIT_P2P_DIRECT_BYTES), in the order
sent, with tags; ranks that wait for their own send before their posted receive (pipeline stages do) finish; receives
from
any source name their sender; the bytes read directly are counted exactly (``direct_p2p_bytes``), and none where
SHARDKIT_P2P_DIRECT_READ=0 sends them over gloo after the descriptor; a size that differs from the sender's, and a
tag in shardkit's reserved range, are refused naming the values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.collective_cases import TOPOLOGIES, run_on

THRESHOLD = 2 << 20  # SHARDKIT_P2P_DIRECT_BYTES's default


def _direct_bytes() -> int:
    return dist.group.WORLD._get_backend(torch.device("cpu")).direct_p2p_bytes()


def _message(src: int, dst: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * src + 10 * dst + n + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, (n,), generator=g, dtype=dtype)


def _shapes() -> list[tuple[int, torch.dtype]]:
    """(elements, dtype): below the threshold, at it, above it, odd sizes."""
    return [(1000, torch.float32), (THRESHOLD // 4, torch.float32), (3 * THRESHOLD // 2 + 7, torch.bfloat16),
            (THRESHOLD // 8 * 5 + 3, torch.int64)]


def _ring_exchange(rank: int, world: int, hosts: list[int] | None) -> dict:
    """Every rank sends every shape to the next rank and receives from the previous one, both posted at once by
    batch_isend_irecv (as pipeline stages exchange) and waited for send first: a send's Work must not wait for
    its receiver's wait()."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    expected_direct = 0
    before = _direct_bytes()
    for i, (n, dtype) in enumerate(_shapes()):
        out = _message(rank, nxt, n, dtype)
        got = torch.empty(n, dtype=dtype)
        ops = [dist.P2POp(dist.isend, out, nxt, tag=i), dist.P2POp(dist.irecv, got, prv, tag=i)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.equal(got, _message(prv, rank, n, dtype)), f"rank {rank}: shape {n} {dtype} from {prv}"
        same_host = hosts is None or hosts[prv] == hosts[rank]
        if same_host and got.nbytes >= THRESHOLD:
            expected_direct += got.nbytes
    return {"direct": _direct_bytes() - before, "expected": expected_direct}


@pytest.mark.parametrize("topology", ["1host-w2", "1host-w3", "2x2hosts"])
def test_messages_arrive_intact_on_the_direct_route_and_through_gloo(ranks, topology):
    world, hosts = TOPOLOGIES[topology]
    results = run_on(ranks, topology, _ring_exchange, hosts, timeout=120)
    for rank, result in enumerate(results):
        assert result["direct"] == result["expected"], (rank, result)
    assert sum(r["direct"] for r in results) > 0


def _order_tags_and_any_source(rank: int, world: int) -> dict:
    """Rank 1 sends three large messages to rank 0 (tags 0, 5, 0); rank 0 receives the tag-5 one first, then the
    two tag-0 ones in order; then rank 0 receives a large message from any source."""
    n = THRESHOLD // 2
    if rank == 1:
        works = [dist.isend(_message(1, 0, n, torch.float32, salt=s), 0, tag=t) for s, t in ((0, 0), (1, 5), (2, 0))]
        dist.send(_message(1, 0, n, torch.float32, salt=3), 0, tag=7)
        for work in works:
            work.wait()
        return {}
    got = {s: torch.empty(n) for s in range(4)}
    dist.recv(got[1], 1, tag=5)
    dist.recv(got[0], 1, tag=0)
    dist.recv(got[2], 1, tag=0)
    source = dist.recv(got[3], tag=7)  # from any source
    for s, tensor in got.items():
        assert torch.equal(tensor, _message(1, 0, n, torch.float32, salt=s)), f"message {s}"
    return {"source": source, "direct": _direct_bytes()}


def test_order_per_tag_and_receives_from_any_source(ranks):
    results = run_on(ranks, "1host-w2", _order_tags_and_any_source, timeout=90)
    assert results[0] == {"source": 1, "direct": 4 * (THRESHOLD // 2) * 4}


def _bytes_over_gloo(rank: int, world: int) -> int:
    """Four messages (tags 0, 1, 0, 1), received in the reverse order: no message waits behind another."""
    n, tags = THRESHOLD, (0, 1, 0, 1)
    if rank == 0:
        works = [dist.isend(_message(0, 1, n, torch.float32, salt=i), 1, tag=t) for i, t in enumerate(tags)]
        for work in works:
            work.wait()
    else:
        got = [torch.empty(n) for _ in tags]
        works = [dist.irecv(got[i], 0, tag=t) for i, t in enumerate(tags)]
        for work in reversed(works):
            work.wait()
        for i, tensor in enumerate(got):
            assert torch.equal(tensor, _message(0, 1, n, torch.float32, salt=i)), f"message {i}"
    return _direct_bytes()


@pytest.mark.parametrize("read", ["1", "0"])
def test_receives_waited_in_reverse_order_directly_and_with_the_bytes_over_gloo(ranks, read):
    results = ranks.run(_bytes_over_gloo, 2, timeout=90, env={"SHARDKIT_P2P_DIRECT_READ": read})
    assert results == [0, 4 * THRESHOLD * 4 if read == "1" else 0]


def _never_waited(rank: int, world: int) -> bool:
    """A receive nobody waits for still completes (as gloo's does), and the sender ends its group at once."""
    import time

    n = THRESHOLD
    if rank == 0:
        dist.send(_message(0, 1, n, torch.float32), 1)
        started = time.monotonic()
        dist.destroy_process_group()
        assert time.monotonic() - started < 5.0
        return True
    got = torch.empty(n)
    dist.irecv(got, 0)  # its Work is dropped unwaited
    deadline = time.monotonic() + 10
    while not torch.equal(got, _message(0, 1, n, torch.float32)):
        assert time.monotonic() < deadline, "the bytes never arrived"
        time.sleep(0.05)
    dist.destroy_process_group()
    return True


def test_a_receive_nobody_waits_for_completes(ranks):
    assert run_on(ranks, "1host-w2", _never_waited, timeout=60) == [True, True]


def _size_mismatch(rank: int, world: int) -> str:
    if rank == 0:
        dist.send(torch.zeros(THRESHOLD), 1)  # completes: the bytes are staged
        dist.barrier()
        return "sent"
    try:
        dist.recv(torch.empty(THRESHOLD + 16), 0)
    except RuntimeError as error:
        dist.barrier()
        return str(error)
    raise AssertionError("a receive of the wrong size succeeded")


def test_a_receive_of_another_size_is_refused_naming_both(ranks):
    results = run_on(ranks, "1host-w2", _size_mismatch, timeout=90)
    assert results[0] == "sent"
    assert (f"recv of {(THRESHOLD + 16) * 4} bytes from rank 0 met a send of {THRESHOLD * 4} bytes: sender and "
            "receiver must agree on the tensor's size") in results[1], results[1]


def _reserved_tag(rank: int, world: int) -> list[str]:
    messages = []
    for n in (10, THRESHOLD):  # both routes
        try:
            if rank == 0:
                dist.send(torch.zeros(n), 1, tag=1 << 30)
            else:
                dist.recv(torch.zeros(n), 0, tag=1 << 30)
        except (RuntimeError, ValueError) as error:
            messages.append(str(error))
        else:
            raise AssertionError(f"a reserved tag was accepted for {n} elements")
    return messages


def test_a_tag_in_the_reserved_range_is_refused(ranks):
    for messages in run_on(ranks, "1host-w2", _reserved_tag, timeout=60):
        for message in messages:
            assert f"tag {1 << 30} is outside [0, {1 << 30}): shardkit keeps the tags above" in message, message


def _abort_while_receiving(rank: int, world: int) -> str:
    import threading
    import time

    if rank == 0:
        time.sleep(3)  # never sends; stays alive until rank 1 has aborted (its exit would close the connection)
        return ""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    work = dist.irecv(torch.empty(THRESHOLD), 0)
    threading.Timer(0.3, backend.abort_with, ("test: abort while receiving",)).start()
    try:
        work.wait()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("an aborted receive returned")


def test_abort_ends_a_direct_receive_that_waits(ranks):
    message = run_on(ranks, "1host-w2", _abort_while_receiving, timeout=60)[1]
    assert message.startswith("shardkit recv (rank 1): the point-to-point op was aborted"), message


def _sender_ends_first(rank: int, world: int) -> bool:
    import time

    n = THRESHOLD
    if rank == 0:
        dist.send(_message(0, 1, n, torch.float32), 1)  # complete: the receiver has posted, not yet read
        dist.destroy_process_group()  # waits for the receipt: the receiver reads this process's memory
        return True
    work = dist.irecv(got := torch.empty(n), 0)
    time.sleep(1.0)
    work.wait()
    assert torch.equal(got, _message(0, 1, n, torch.float32))
    dist.destroy_process_group()
    return True


def test_a_sender_that_ends_its_group_first_waits_for_the_read(ranks):
    assert run_on(ranks, "1host-w2", _sender_ends_first, timeout=60) == [True, True]


def _init_only(rank: int, world: int) -> None:
    return None


def test_ranks_that_disagree_on_the_threshold_are_refused_at_start_up(ranks):
    from support.harness import RanksFailed

    env = [{"SHARDKIT_P2P_DIRECT_BYTES": "4096"}, {"SHARDKIT_P2P_DIRECT_BYTES": "8192"}]
    with pytest.raises(RanksFailed, match="SHARDKIT_P2P_DIRECT_BYTES is 8192 here but 4096 on rank 0: every rank "
                                          "must use the same"):
        ranks.run(_init_only, 2, timeout=60, env=env)

"""shardkit's checksummed torchft CheckpointTransport (integrations/_torchft_transport.py, issue 40).

Ranks are processes of the harness, each configuring torchft's ProcessGroupGloo over a TCPStore that the test
serves on port 0. What is asserted:
- a state of every shape the Manager hands over (nested dicts and lists, OrderedDict, int keys, tuples, fp32 /
  bf16 / int / bool tensors, non-contiguous views, a 0-d and an empty tensor, Python scalars and strings) arrives
  bitwise, with its containers' classes, and a receive with nothing sent ends at its deadline;
- a transfer whose bytes are changed on the wire (one byte of one tensor flipped after its CRC32C was taken, by a
  subclass overriding the one method that hands bytes to the group) is refused naming that tensor's key path, the
  step and the source rank, and the next transfer on the same group arrives intact;
- a value weights_only will not read is refused by the sender, and the receiver says why;
- DTensors arrive as DTensors over the receiver's own mesh and placements (its state_dict), and without one they
  are refused by name;
- under torchft's Manager (a Lighthouse in the test process, two replica groups of one rank), the recovering
  replica's first recovery is corrupted and refused, that step is not committed and its model is not touched,
  the next quorum recovers it, and both replicas end with bitwise-equal parameters and optimizer state.
"""

from __future__ import annotations

import collections
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from shardkit import _C
from shardkit.integrations._torchft_transport import (
    PROTOCOL,
    CheckpointTransferError,
    ChecksummedTransport,
)
from support.harness import assert_same

TIMEOUT = timedelta(seconds=20)


def _gloo(rank: int, world_size: int, store_port: int, prefix: str) -> Any:
    from torchft.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(f"localhost:{store_port}/{prefix}", "transport-test", rank, world_size)
    return pg


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)
    return {
        "model": collections.OrderedDict([
            ("fc.weight", torch.randn(5, 7, generator=g)),
            ("fc.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("transposed", base.t()),                      # non-contiguous
            ("strided", base[:, ::3]),                     # non-contiguous, offset 0
            ("tail", base[2:]),                            # contiguous with a storage offset
            ("special", special),
        ]),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 2, generator=g, dtype=torch.float64)},
                      1: {"step": torch.tensor(7, dtype=torch.int64), "mask": torch.rand(4, generator=g) > 0.5}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None, "amsgrad": False,
                              "params": [0, 1], "name": "dense"}],
        },
        "counters": [torch.arange(10, dtype=torch.int32), torch.empty(0, 3), ("x", 2, 3.5), "text", 42],
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
    }


class _FlipOneByte(ChecksummedTransport):
    """Test-only: flips one byte of ``target``'s bytes, after their CRC32C was taken, on the first ``flips`` sends of
    it. The flipped copy is what goes to the group: real bytes on the wire, the receiver's check untouched."""

    def __init__(self, *args: Any, target: str, flips: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target = target
        self.flips = flips
        self.flipped = 0

    def _send_tensor_bytes(self, path: str, data: torch.Tensor, dst_rank: int, tag: int) -> Any:
        if path == self.target and self.flipped < self.flips:
            self.flipped += 1
            data = data.clone()
            data[data.numel() // 2] ^= 0x10
        return super()._send_tensor_bytes(path, data, dst_rank, tag)


class _Opaque:
    """A class weights_only does not know."""


def _round_trip(rank: int, world_size: int, store_port: int) -> bool:
    from torch.distributed import TCPStore

    pg = _gloo(rank, world_size, store_port, "round-trip")
    store = TCPStore("localhost", store_port, is_master=False, timeout=TIMEOUT)
    transport = ChecksummedTransport(pg, timeout=TIMEOUT)
    if rank == 0:
        transport.send_checkpoint([1], step=5, state_dict=_state(0), timeout=TIMEOUT)
        store.wait(["round-trip-done"])  # alive, sending nothing, while rank 1 waits out its deadline
    else:
        assert_same(transport.recv_checkpoint(0, PROTOCOL, step=5, timeout=TIMEOUT), _state(0))
        # A live sender that never sends: the receive ends at its deadline, naming what it waited for.
        start = time.monotonic()
        with pytest.raises(CheckpointTransferError, match=r"^the state of step 6 from rank 0: receiving the header "
                                                          r"failed: .*[Tt]imed out"):
            transport.recv_checkpoint(0, PROTOCOL, step=6, timeout=timedelta(seconds=1))
        assert time.monotonic() - start < 10
        store.set("round-trip-done", "1")
    return True


def _corrupted_then_clean(rank: int, world_size: int, store_port: int) -> list[str]:
    pg = _gloo(rank, world_size, store_port, "corrupted")
    target = "['model']['fc.weight']"
    said: list[str] = []
    if rank == 0:
        transport = _FlipOneByte(pg, timeout=TIMEOUT, target=target)
        transport.send_checkpoint([1], step=7, state_dict=_state(1), timeout=TIMEOUT)
        transport.send_checkpoint([1], step=8, state_dict=_state(2), timeout=TIMEOUT)
        with pytest.raises(CheckpointTransferError, match="_Opaque"):
            transport.send_checkpoint([1], step=9, state_dict={"w": torch.ones(2), "x": _Opaque()}, timeout=TIMEOUT)
        said.append(f"flipped {transport.flipped}")
    else:
        transport = ChecksummedTransport(pg, timeout=TIMEOUT)
        with pytest.raises(CheckpointTransferError) as refused:
            transport.recv_checkpoint(0, PROTOCOL, step=7, timeout=TIMEOUT)
        said.append(str(refused.value))
        assert_same(transport.recv_checkpoint(0, PROTOCOL, step=8, timeout=TIMEOUT), _state(2))
        with pytest.raises(CheckpointTransferError) as refused:
            transport.recv_checkpoint(0, PROTOCOL, step=9, timeout=TIMEOUT)
        said.append(str(refused.value))
    return said


def _dtensors(rank: int, world_size: int, store_port: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(rank)
    own = {"model": {"rep": DTensor.from_local(torch.randn(4, 3, generator=g), mesh, [Replicate()], run_check=False),
                     "shard": DTensor.from_local(torch.randn(2, 5, generator=g).to(torch.bfloat16), mesh, [Shard(0)],
                                                 run_check=False)},
           "step": 3}
    pg = _gloo(rank, world_size, store_port, "dtensors")
    if rank == 0:
        transport = ChecksummedTransport(pg, timeout=TIMEOUT)
        transport.send_checkpoint([1], step=3, state_dict=own, timeout=TIMEOUT)
        transport.send_checkpoint([1], step=4, state_dict=own, timeout=TIMEOUT)
        return [str(own["model"]["rep"].to_local().sum().item())]
    got = ChecksummedTransport(pg, timeout=TIMEOUT, state_dict=lambda: own).recv_checkpoint(0, PROTOCOL, 3, TIMEOUT)
    sent = torch.Generator().manual_seed(0)
    sent_rep, sent_shard = torch.randn(4, 3, generator=sent), torch.randn(2, 5, generator=sent).to(torch.bfloat16)
    for name, local in (("rep", sent_rep), ("shard", sent_shard)):
        tensor = got["model"][name]
        assert isinstance(tensor, DTensor), type(tensor)
        assert (tensor.device_mesh, tensor.placements, tensor.shape) == (own["model"][name].device_mesh,
                                                                          own["model"][name].placements,
                                                                          own["model"][name].shape)
        assert_same(tensor.to_local(), local, name)
    with pytest.raises(CheckpointTransferError) as refused:
        ChecksummedTransport(pg, timeout=TIMEOUT).recv_checkpoint(0, PROTOCOL, 4, TIMEOUT)
    return [str(refused.value)]


@pytest.fixture
def store_port():
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


@pytest.mark.timeout(60)
def test_state_round_trips_bitwise_over_torchft_gloo(ranks, store_port):
    assert ranks.run(_round_trip, 2, store_port, backend=None, timeout=45) == [True, True]


@pytest.mark.timeout(60)
def test_bytes_changed_on_the_wire_are_refused_naming_the_tensor_then_a_clean_transfer_succeeds(ranks, store_port):
    sender, receiver = ranks.run(_corrupted_then_clean, 2, store_port, backend=None, timeout=45)
    assert sender == ["flipped 1"]
    corrupt, unreadable = receiver
    # What the receiver computed is the CRC32C of exactly the flipped bytes: they are what crossed the wire.
    sent = _state(1)["model"]["fc.weight"].reshape(-1).view(torch.uint8).clone()
    flipped = sent.clone()
    flipped[flipped.numel() // 2] ^= 0x10
    crc = [_C.crc32c(bytes(t.tolist())) for t in (flipped, sent)]
    assert corrupt == ("refused the state of step 7 from rank 0: 1 of 12 tensors arrived with bytes other than the "
                       f"sender's: ['model']['fc.weight'] (CRC32C {crc[0]:#010x}, sent {crc[1]:#010x})"), corrupt
    assert unreadable.startswith("the state of step 9 from rank 0: the sender refused to send it: the state of "
                                 "step 9: shardkit refuses to read it"), unreadable
    assert "_Opaque" in unreadable


@pytest.mark.timeout(60)
def test_dtensors_are_rebuilt_over_the_receivers_own_mesh_and_placements(ranks, store_port):
    _, (refused,) = ranks.run(_dtensors, 2, store_port, backend="gloo", timeout=45)
    assert refused == ("the state of step 4 from rank 0: ['model']['rep'] is a DTensor, and no state_dict was given: "
                       "a received DTensor takes its mesh and placements from this side's own DTensor "
                       "(ChecksummedTransport(state_dict=...))")


def test_a_peer_on_another_transport_is_refused_before_anything_is_received():
    transport = ChecksummedTransport(pg=None, timeout=TIMEOUT)
    with pytest.raises(CheckpointTransferError, match=r"from rank 3: the sender's transport is '<n/a>', not "
                                                      r"'shardkit-crc32c-transport/1'"):
        transport.recv_checkpoint(3, "<n/a>", step=1, timeout=TIMEOUT)


def test_tensor_subclasses_and_sparse_tensors_are_refused_by_name():
    from shardkit.integrations import _torchft_transport as module

    with pytest.raises(TypeError, match=r"\['a'\]\[1\] is a torch.sparse_coo tensor"):
        module._split({"a": [torch.ones(1), torch.eye(2).to_sparse()]}, "", [], torch.arange(2))


# --- under torchft's Manager --------------------------------------------------------------------------------------
STEPS = 4


def _replica(rank: int, world_size: int, lighthouse: str) -> dict[str, Any]:
    """Replica group ``rank`` (one rank). Replica 0 is the healthy source (its transport corrupts its first send);
    replica 1 starts from other parameters and must be healed. Each step: quorum, gradients of a per-step input,
    should_commit, then the optimizer step only if committed."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    if rank == 0:
        transport: ChecksummedTransport = _FlipOneByte(pg, timeout=TIMEOUT, target="['user']['default']['model']"
                                                                                   "['weight']")
    else:
        transport = ChecksummedTransport(pg, timeout=TIMEOUT)
    torch.manual_seed(100 + rank)
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = model.weight.detach().clone()

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(pg=pg, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      min_replica_size=1, use_async_quorum=False, replica_id=f"replica{rank}", store_addr="localhost",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse, port=0,
                      timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, checkpoint_transport=transport)
    history = []
    try:
        while manager.current_step() < STEPS:
            manager.start_quorum()
            step = manager.current_step()
            inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            committed = manager.should_commit()
            errored = manager.errored()
            history.append((step, committed, str(errored.original_exception) if errored else None,
                            torch.equal(model.weight, initial)))
            if committed:
                optimizer.step()
    finally:
        manager.shutdown(wait=False)
    return {"history": history, "flipped": getattr(transport, "flipped", None),
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]}


@pytest.mark.timeout(90)
def test_manager_refuses_a_corrupted_recovery_commits_nothing_and_heals_at_the_next_quorum(ranks):
    from torchft.coordination import LighthouseServer

    # min_replicas=2: every quorum holds both groups, so the first one recovers replica 1 (torchft's init_sync:
    # at step 0 the non-primary replica heals from the primary, replica0 by name) and the two stay in step.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        healthy, healed = ranks.run(_replica, 2, lighthouse.address(), backend=None, timeout=80)
    finally:
        lighthouse.shutdown()
    assert healthy["flipped"] == 1
    assert [(s, c) for s, c, _, _ in healthy["history"]] == [(s, True) for s in range(STEPS)], healthy["history"]
    (step, committed, error, untouched), *after = healed["history"]
    # The corrupted recovery: refused naming the tensor, the step and the source; nothing committed or loaded.
    assert (step, committed, untouched) == (0, False, True), healed["history"]
    assert error is not None and error.startswith(
        "refused the state of step 0 from rank 0: 1 of 2 tensors arrived with bytes other than the sender's: "
        "['user']['default']['model']['weight'] (CRC32C 0x"), error
    # The next quorum heals it from step 1 on, and every later step commits.
    assert [(s, c, e) for s, c, e, _ in after] == [(s, True, None) for s in range(1, STEPS)], healed["history"]
    assert_same(healed["model"], healthy["model"])
    assert_same(healed["momentum"], healthy["momentum"])

"""Asynchronous checkpoint saves (issue #39): shardkit.checkpoint.save(..., async_save=True) and its AsyncSave.

What each test can catch:
- a staged copy that is not the snapshot (a training step right after save returns leaks into the checkpoint),
  or that DCP writes differently from the live state (a PieceTensor / DTensor / in-place optimizer state staged
  as another kind, a value lost): each front's async checkpoint is compared with a sync save of the same state,
  every value bit for bit and every data file's size and CRC32C;
- a rank SIGKILLed while staging, writing, agreeing or committing (worlds 2 and 4) that hangs the survivors,
  costs the previous checkpoint, leaves files beside it or segments in /dev/shm, or breaks the next save;
- a second save that does not queue behind the first (or whose status does not say so), a sync save that
  does not wait for the writer;
- a failing save (an unwritable directory, a value one rank cannot stage) whose error does not come out of
  every rank's result(), naming the cause; a result() that waits past its timeout;
- destroy_process_group() that hangs with a save in flight.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from test_fully_shard import _global_step, _optimizer, _wrapped, tiny_lm

FRONTS = ("ddp", "zero2", "fully_shard", "fsdp1")


def _gate_at(status: str) -> threading.Event:
    """Holds every asynchronous save's writer when its status becomes ``status`` until the event is set (30 s at
    most): the test decides what runs while a save is in flight."""
    from shardkit.checkpoint import _async

    release = threading.Event()
    set_status = _async._Job._enter

    def gated(self, new: str) -> None:
        set_status(self, new)
        if new == status:
            release.wait(30)

    _async._Job._enter = gated
    return release


# --- an async save writes what a sync save writes, the state of the step it was taken at -------------------------

def _front(front: str, world: int):
    import shardkit

    if front == "ddp":
        model = shardkit.DistributedDataParallel(tiny_lm())
        return model, _optimizer("adamw", model.parameters())
    return _wrapped({"fully_shard": "shardkit"}.get(front, front), world)


def _save_both_ways(rank: int, world: int, front: str, directory: str) -> str:
    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict

    model, optimizer = _front(front, world)
    for step in range(2):
        _global_step(model, optimizer, rank, world, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 2, "note": b"async"}
    checkpoint.save(state, os.path.join(directory, "sync"))
    release = _gate_at("writing")
    handle = checkpoint.save(state, os.path.join(directory, "async"), async_save=True)
    assert isinstance(handle, checkpoint.AsyncSave)
    _global_step(model, optimizer, rank, world, 2)  # changes the live tensors while the save is held in flight
    release.set()
    handle.result(timeout=60)
    assert handle.done()
    return handle.status


def _consolidated(directory: Path, out: Path) -> dict:
    from shardkit import checkpoint

    checkpoint.consolidate(directory, out)
    return torch.load(out, weights_only=True)


def _assert_bitwise(a, b, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}, {b.dtype}; {a.shape}, {b.shape}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where}: values differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_bitwise(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _data_files(directory: Path) -> dict:
    import json

    files = json.loads((directory / ".shardkit-manifest.json").read_text())["files"]
    return {name: record for name, record in files.items() if name != ".metadata"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("front", FRONTS)
def test_an_async_save_writes_what_a_sync_save_writes_at_the_step_it_was_taken(ranks, tmp_path: Path, front):
    statuses = ranks.run(_save_both_ways, 2, front, str(tmp_path), timeout=150)
    assert statuses == ["committed", "committed"]
    sync = _consolidated(tmp_path / "sync", tmp_path / "sync.pt")
    later = _consolidated(tmp_path / "async", tmp_path / "async.pt")
    assert sync["model"] and sync["optim"]["state"], sync.keys()
    _assert_bitwise(later, sync)  # not the state after the step taken while the save was in flight
    assert _data_files(tmp_path / "async") == _data_files(tmp_path / "sync")  # the same bytes in every data file


# --- a rank killed at each phase of an async save ----------------------------------------------------------------

def _values(rank: int, version: int) -> dict:
    generator = torch.Generator().manual_seed(1000 * version + rank)
    return {f"w{rank}": torch.rand(64, 33, generator=generator),
            f"h{rank}": torch.rand(17, generator=generator).to(torch.bfloat16),
            f"i{rank}": torch.randint(0, 1 << 40, (5,), generator=generator)}


def _state(rank: int, version: int) -> dict:
    return {"version": version, **_values(rank, version)}


def _skeleton(world: int) -> dict:
    state: dict = {"version": -1}
    for rank in range(world):
        state.update({k: torch.full_like(v, -1) for k, v in _values(rank, 0).items()})
    return state


def _expected(world: int, version: int) -> dict:
    state: dict = {"version": version}
    for rank in range(world):
        state.update(_values(rank, version))
    return state


def _note_pid(directory: str, rank: int) -> None:
    Path(directory, f"pid{rank}").write_text(str(os.getpid()))


def _kill_this_rank(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _async_save_and_die(rank: int, world: int, path: str, victim: int, phase: str) -> str:
    """Commits version 1 by an async save, then async-saves version 2 with rank ``victim`` SIGKILLed at ``phase``:
    'staging' (its foreground copy), 'writing' (after DCP wrote its first item), 'agreeing' (as its writer enters
    the agreement on every rank's files), 'committing' (rank 0, manifest written, before the publish rename)."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from shardkit import checkpoint
    from shardkit.checkpoint import _async, _commit

    _note_pid(str(Path(path).parent.parent), rank)
    checkpoint.save(_state(rank, 1), path, async_save=True).result(timeout=60)
    if rank == victim:
        if phase == "staging":
            _async.copy_into_staging = _kill_this_rank
        elif phase == "writing":
            write_item = dcp_filesystem._write_item

            def write_then_die(*args, **kwargs):
                write_item(*args, **kwargs)
                _kill_this_rank()

            dcp_filesystem._write_item = write_then_die
        elif phase == "agreeing":
            set_status = _async._Job._enter

            def die_when_agreeing(self, status: str) -> None:
                if status == "agreeing":
                    _kill_this_rank()
                set_status(self, status)

            _async._Job._enter = die_when_agreeing
        else:
            assert phase == "committing" and rank == 0
            _commit.publish = _kill_this_rank
    handle = checkpoint.save(_state(rank, 2), path, async_save=True)
    with pytest.raises(checkpoint.CheckpointSaveError) as raised:
        handle.result(timeout=60)
    assert handle.done() and handle.status.startswith("failed: "), handle.status
    return str(raised.value)


def _recover(rank: int, world: int, path: str) -> dict:
    """Fresh ranks: what loads now, then an async save of version 3 into the same directory and what loads."""
    from shardkit import checkpoint

    _note_pid(str(Path(path).parent.parent), rank)
    loaded = _skeleton(world)
    checkpoint.load(loaded, path)
    checkpoint.save(_state(rank, 3), path, async_save=True).result(timeout=60)
    reloaded = _skeleton(world)
    checkpoint.load(reloaded, path)
    return {"loaded": loaded, "reloaded": reloaded}


def _torch_segments_of(pid_dir: Path) -> list[str]:
    pids = [p.read_text() for p in pid_dir.glob("pid*")]
    if not os.path.isdir("/dev/shm"):
        return []
    return sorted(n for n in os.listdir("/dev/shm") for pid in pids if n.startswith(f"torch_{pid}_"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("phase", ["staging", "writing", "agreeing", "committing"])
def test_a_rank_killed_during_an_async_save_keeps_the_previous_checkpoint(ranks, tmp_path: Path, world, phase):
    parent = tmp_path / "checkpoints"
    path = str(parent / "ckpt")
    victim = 0 if phase == "committing" else world - 1
    outcomes = ranks.launch(_async_save_and_die, world, path, victim, phase, timeout=120, pg_timeout=20)
    for outcome in outcomes:
        if outcome.rank == victim:
            assert outcome.exitcode == -signal.SIGKILL and not outcome.finished, outcome
            continue
        assert outcome.ok, f"rank {outcome.rank}: {outcome.error}"
        if victim == 0:  # rank 0 died around the commit: either checkpoint may be there, never a mix
            assert f"could not learn whether rank 0 committed {path}" in outcome.value, outcome.value
        else:
            assert "nothing was committed: the previous checkpoint there, if any, is intact" in outcome.value, \
                outcome.value
    assert _torch_segments_of(tmp_path) == [], "shared memory left in /dev/shm"
    if victim != 0:  # rank 0 lived: it removed the staging directory
        assert sorted(p.name for p in parent.iterdir()) == ["ckpt"]
    for rank, got in enumerate(ranks.run(_recover, world, path, timeout=120)):
        _assert_bitwise(got["loaded"], _expected(world, 1), f"rank {rank}, after the kill")
        _assert_bitwise(got["reloaded"], _expected(world, 3), f"rank {rank}, the next save")
    assert sorted(p.name for p in parent.iterdir()) == ["ckpt"], "the next save left leftovers"
    assert _torch_segments_of(tmp_path) == []


# --- queueing, failures, timeouts, shutdown ---------------------------------------------------------------------

def _queue_fail_and_destroy(rank: int, world: int, directory: str) -> dict:
    import torch.distributed as dist

    from shardkit import checkpoint
    from shardkit.checkpoint import _async

    first, second = os.path.join(directory, "first"), os.path.join(directory, "second")
    out: dict = {}
    # A second save queues behind the first, held in flight; result(timeout) ends in TimeoutError naming it.
    release = _gate_at("writing")
    one = checkpoint.save(_state(rank, 1), first, async_save=True)
    two = checkpoint.save(_state(rank, 2), second, async_save=True)
    out["queued"] = two.status
    with pytest.raises(TimeoutError) as late:
        one.result(timeout=0.2)
    out["timeout"] = str(late.value)
    blocks = [block for job in _async._WRITER.pending() for block in job.staged.buffers.blocks]
    out["staged in shared memory"] = (len(blocks), all(block.is_shared() for block in blocks))
    out["in /dev/shm"] = [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")]
    release.set()
    two.result(timeout=60)
    out["statuses"] = [one.status, two.status]
    # The live state changed after the saves: a sync save now waits for the writer, then writes its own.
    checkpoint.save(_state(rank, 3), first)
    loaded = _skeleton(world)
    checkpoint.load(loaded, first)
    out["first"] = loaded
    loaded = _skeleton(world)
    checkpoint.load(loaded, second)
    out["second"] = loaded
    # An unwritable directory, and a value one rank cannot stage: result() raises on every rank.
    blocker = Path(directory, "a-file")
    if rank == 0:
        blocker.write_text("not a directory")
    dist.barrier()
    errors = []
    for target, state in [(str(blocker / "ckpt"), _state(rank, 4)),
                          (second, {**_state(rank, 4), **({"odd": torch.zeros(3).to_sparse()} if rank == 1 else {})})]:
        with pytest.raises(checkpoint.CheckpointSaveError) as raised:
            checkpoint.save(state, target, async_save=True).result(timeout=60)
        errors.append(str(raised.value))
    out["errors"] = errors
    # destroy_process_group with a save held in flight returns; the save then ends, one way or the other.
    release = _gate_at("preparing")
    three = checkpoint.save(_state(rank, 5), os.path.join(directory, "third"), async_save=True)
    dist.destroy_process_group()
    release.set()
    try:
        three.result(timeout=60)
    except checkpoint.CheckpointSaveError as error:
        out["after destroy"] = str(error)
    out["pending"] = len(_async.pending_saves())
    return out


@pytest.mark.timeout(180)
def test_saves_queue_errors_reach_every_rank_and_destroy_does_not_hang(ranks, tmp_path: Path):
    first, second = tmp_path / "first", tmp_path / "second"
    results = ranks.run(_queue_fail_and_destroy, 2, str(tmp_path), timeout=150, pg_timeout=30)
    for rank, out in enumerate(results):
        assert out["queued"] == f"waiting for the save of {first} to finish", out["queued"]
        assert out["timeout"].startswith(f"shardkit checkpoint save (rank {rank}): the asynchronous save of {first} "
                                         "has not ended after 0.2 s (it is writing)"), out["timeout"]
        assert out["staged in shared memory"] == (2, True)  # a set per save: the first is in flight
        assert out["in /dev/shm"] == []
        assert out["statuses"] == ["committed", "committed"]
        _assert_bitwise(out["first"], _expected(2, 3), f"rank {rank}, first")
        _assert_bitwise(out["second"], _expected(2, 2), f"rank {rank}, second")
        unwritable, unstageable = out["errors"]
        assert f"(rank {rank}): saving {tmp_path / 'a-file' / 'ckpt'} failed" in unwritable, unwritable
        assert "rank 0, preparing the staging directory: FileExistsError" in unwritable \
            or "NotADirectoryError" in unwritable, unwritable
        assert f"(rank {rank}): saving {second} failed and nothing was committed" in unstageable, unstageable
        assert "rank 1, staging its state: StagingError: the tensor at 'odd' (torch.sparse_coo" in unstageable, \
            unstageable
        assert out["pending"] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("store-", "rank"))) == \
        ["a-file", "first", "second"] + (["third"] if "after destroy" not in results[0] else [])

"""Resuming where training stopped, exactly (issue #39): shardkit.checkpoint.Checkpointer, shardkit.data's
ResumableSampler and DataLoader, and examples/train_gpt.py --checkpoint-dir.

What each test can catch:
- load_latest that loads (or crashes on) the newest checkpoint when it is torn, bit-flipped, not committed or a
  staging leftover, that falls back on some ranks only, or skips one without a warning naming it;
- retention that removes the checkpoint just written, a newer one, an uncommitted directory or a staging one,
  or keeps more than K; with an async save, one that prunes before the save in flight is committed;
- a sampler position that repeats or skips samples when resumed at another world size, or that counts the
  indices the DataLoader's workers prefetched as trained (num_workers=2);
- RNG states not restored, restored from another rank's (DCP keeps one copy of identical keys), or silently
  restored at another world size;
- a resumed train_gpt run (fully_shard, ZeRO-2, DDP, the FSDP1 front) whose weights or optimizer state differ in
  any bit from the run never interrupted, or whose loss differs at any step from the resume on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import random
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from support import harness
from support.fsdp_cases import adamw, block_policy, net, train_global
from support.resume_train_gpt import final_bits

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_gpt.py"
MANIFEST = ".shardkit-manifest.json"


# --- a model, its state and its exact values ----------------------------------------------------------------------

def _model(seed: int = 0):
    import shardkit

    model = shardkit.FullyShardedDataParallel(net(seed=seed, depth=2, d_in=7), auto_wrap_policy=block_policy())
    return model, adamw(model.parameters())


def _bits(model, optimizer) -> dict[str, bytes]:
    """Every parameter's and optimizer state tensor's full value, as bytes (a collective: gathered)."""
    from shardkit.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    values = {f"model.{k}": v for k, v in model_sd.items()}
    values.update({f"optim.{name}.{k}": v for name, entry in optim_sd["state"].items() for k, v in entry.items()})
    return {k: v.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in values.items()}


def _save_steps(rank: int, world: int, root: str, steps: int) -> dict[int, dict[str, bytes]]:
    from shardkit.checkpoint import Checkpointer

    model, optimizer = _model()
    ckpt = Checkpointer(root, every=1)
    state = {"model": model, "optim": optimizer}
    bits = {}
    for step in range(1, steps + 1):
        train_global(model, optimizer, rank, world, range(step - 1, step))
        assert ckpt.save_if_due(step, state)
        bits[step] = _bits(model, optimizer)
    return bits


def _load_latest(rank: int, world: int, root: str) -> tuple[int | None, list[str], dict[str, bytes]]:
    from shardkit.checkpoint import Checkpointer

    model, optimizer = _model(seed=123)  # other values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = Checkpointer(root).load_latest({"model": model, "optim": optimizer})
    return step, [str(w.message) for w in caught], _bits(model, optimizer)


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _data_file(directory: Path) -> Path:
    return sorted(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]


@pytest.mark.timeout(240)
def test_load_latest_skips_torn_uncommitted_and_bit_flipped_checkpoints_naming_each(ranks, tmp_path: Path):
    root = tmp_path / "ckpts"
    saved = ranks.run(_save_steps, 2, str(root), 4, timeout=200)[0]
    assert sorted(p.name for p in root.iterdir()) == [f"step-0000000{s}" for s in (1, 2, 3, 4)]
    _flip_a_bit(_data_file(root / "step-00000004"))                    # a bit flip: the CRC32C catches it
    torn = _data_file(root / "step-00000003")
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])     # torn: a file truncated
    uncommitted = root / "step-00000005"                                # a directory no shardkit save committed
    shutil.copytree(root / "step-00000002", uncommitted)
    (uncommitted / MANIFEST).unlink()
    staging = root / ".step-00000006.shardkit-staging-0123abcd"       # what a save killed while writing leaves
    shutil.copytree(root / "step-00000002", staging)

    for step, messages, bits in ranks.run(_load_latest, 2, str(root), timeout=200):
        assert step == 2
        assert bits == saved[2]
        text = "\n".join(messages)
        assert f"skipped {uncommitted}: not committed (no shardkit manifest)" in text, text
        assert f"skipped {staging}: the staging directory of an interrupted save" in text, text
        assert f"skipped {root / 'step-00000004'}: it failed verification" in text and "CRC32C" in text, text
        assert f"skipped {root / 'step-00000003'}: it failed verification" in text and "(truncated)" in text, text
    # Nothing was removed or repaired by loading.
    assert sorted(p.name for p in root.iterdir()) == [staging.name, *[f"step-0000000{s}" for s in range(1, 6)]]


def test_load_latest_without_checkpoints_returns_none(tmp_path: Path):
    from shardkit.checkpoint import Checkpointer

    model = torch.nn.Linear(3, 2)
    assert Checkpointer(tmp_path / "none").load_latest({"model": model}) is None
    (tmp_path / "empty").mkdir()
    assert Checkpointer(tmp_path / "empty").load_latest({"model": model}) is None


# --- retention ----------------------------------------------------------------------------------------------------

def _linear_state(value: float) -> dict:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model}


def test_retention_keeps_the_newest_k_and_never_uncommitted_or_newer_ones(tmp_path: Path):
    from shardkit.checkpoint import Checkpointer

    root = tmp_path / "ckpts"
    Checkpointer(root).save(9, _linear_state(9.0))         # newer than what this run writes (an earlier run's)
    (root / "step-00000000").mkdir()                        # not committed by shardkit
    (root / "step-00000000" / "notes.txt").write_text("mine")
    leftover = root / ".step-00000007.shardkit-staging-feed"  # another save's staging directory
    leftover.mkdir()
    ckpt = Checkpointer(root, every=1, keep=2)
    for step in range(1, 6):
        ckpt.save_if_due(step, _linear_state(float(step)))
        committed = sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file())
        kept = [f"step-{s:08d}" for s in range(max(1, step - 1), step + 1)]
        assert committed == [*kept, "step-00000009"], (step, committed)
    assert (root / "step-00000000" / "notes.txt").read_text() == "mine"
    assert leftover.is_dir()
    assert not [p for p in root.iterdir() if "pruning" in p.name]


def test_every_and_keep_are_checked():
    from shardkit.checkpoint import Checkpointer

    with pytest.raises(ValueError, match=r"every=0; save every 1 or more steps"):
        Checkpointer("x", every=0)
    with pytest.raises(ValueError, match=r"keep=0; keep 1 or more checkpoints"):
        Checkpointer("x", keep=0)
    with pytest.raises(ValueError, match=r"state\['optim'\] is an optimizer over parameters of no module"):
        Checkpointer("x").save(1, {"optim": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)})
    with pytest.raises(TypeError, match=r"state\['n'\] is a int"):
        Checkpointer("x").save(1, {"n": 3})


def test_an_lr_scheduler_and_the_optimizers_settings_come_back(tmp_path: Path):
    from shardkit.checkpoint import Checkpointer

    def fresh():
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        return {"model": model, "optim": optimizer, "sched": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}

    state = fresh()
    for _ in range(5):
        state["model"](torch.ones(2, 4)).sum().backward()
        state["optim"].step()
        state["sched"].step()
    Checkpointer(tmp_path).save(5, state)
    loaded = fresh()
    assert Checkpointer(tmp_path).load_latest(loaded) == 5
    assert loaded["sched"].state_dict() == state["sched"].state_dict()
    assert loaded["optim"].param_groups[0]["lr"] == 0.025
    moments = [s["optim"].state_dict()["state"][0]["exp_avg"] for s in (loaded, state)]
    assert torch.equal(*moments)


def test_async_retention_prunes_only_after_the_save_in_flight_is_committed(tmp_path: Path):
    from shardkit.checkpoint import Checkpointer

    root = tmp_path / "ckpts"
    ckpt = Checkpointer(root, every=1, keep=1, async_save=True)
    ckpt.save(1, _linear_state(1.0))
    ckpt.save(2, _linear_state(2.0))  # waits for step 1's save, prunes (nothing older), starts step 2's
    assert (root / "step-00000001" / MANIFEST).is_file()  # step 2's is not committed yet, or not pruned after it
    ckpt.wait()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]
    state = _linear_state(0.0)
    assert Checkpointer(root).load_latest(state) == 2
    assert state["model"].weight.eq(2.0).all()
    ckpt.close()


# --- the data position ------------------------------------------------------------------------------------------

class _Indices(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _consume(sampler, batches: int | None, batch_size: int = 2, num_workers: int = 0, torch_loader: bool = False):
    """The natural loop: ``for batch in loader``, ``batches`` of them (None: the whole pass); returns the indices
    the loop received."""
    from shardkit import data

    loader_type = torch.utils.data.DataLoader if torch_loader else data.DataLoader
    loader = loader_type(sampler.dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen += batch.tolist()
        if batches is not None and i + 1 == batches:
            break
    return seen


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("new_world", [3, 1])
def test_sampler_saved_at_world_2_resumes_at_another_world_size_seeing_one_epoch_exactly(num_workers: int,
                                                                                        new_world: int):
    from shardkit.data import ResumableSampler

    dataset = _Indices(62)  # 5 steps x 2 ranks x 2 = 20 consumed; 42 remain, which 3 and 1 divide
    seen, states = [], []
    for rank in range(2):
        sampler = ResumableSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(3)
        seen += _consume(sampler, 5, num_workers=num_workers)
        states.append(sampler.state_dict())
    assert states[0] == states[1] == {"epoch": 3, "offset": 20, "dataset_size": 62, "seed": 7, "shuffle": True}
    for rank in range(new_world):
        sampler = ResumableSampler(dataset, num_replicas=new_world, rank=rank, shuffle=True, seed=7)
        sampler.load_state_dict(states[0])
        sampler.set_epoch(sampler.epoch)  # the resumed loop's first set_epoch keeps the position
        assert len(sampler) == 42 // new_world
        seen += _consume(sampler, None, num_workers=num_workers)
    assert sorted(seen) == list(range(62))  # every sample once: none repeated, none skipped
    order = torch.randperm(62, generator=torch.Generator().manual_seed(7 + 3)).tolist()
    assert set(seen[:20]) == set(order[:20])  # the epoch's own order, not another epoch's


def test_a_torch_dataloader_with_workers_runs_the_sampler_ahead_the_shardkit_one_does_not():
    """Why shardkit.data.DataLoader exists: torch's pulls indices for the batches its workers prefetch."""
    from shardkit.data import ResumableSampler

    dataset = _Indices(64)
    ahead = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    _consume(ahead, 3, num_workers=2, torch_loader=True)
    assert ahead.state_dict()["offset"] > 6
    exact = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    assert _consume(exact, 3, num_workers=2) == list(range(6))
    assert exact.state_dict()["offset"] == 6
    plain = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=False)  # torch's, num_workers=0: exact too
    _consume(plain, 3, num_workers=0, torch_loader=True)
    assert plain.state_dict()["offset"] == 6


def test_sampler_epoch_end_and_mismatches():
    from shardkit.data import ResumableSampler

    dataset = _Indices(10)
    sampler = ResumableSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=1)
    assert len(_consume(sampler, None)) == 5
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["offset"] == 0  # the next epoch's start
    other = ResumableSampler(_Indices(11), num_replicas=2, rank=0, seed=2)
    with pytest.raises(ValueError, match=r"rank 0\): dataset_size 10 saved but 11 here, seed 1 saved but 2 here"):
        other.load_state_dict(sampler.state_dict())


# --- RNG states ---------------------------------------------------------------------------------------------------

def _draws() -> list[float]:
    import numpy as np

    return [*torch.rand(3).tolist(), random.random(), random.gauss(0, 1), float(np.random.rand())]


def _seed(seed: int) -> None:
    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _rng_round_trip(rank: int, world: int, root: str) -> tuple[list[float], list[float]]:
    from shardkit.checkpoint import Checkpointer

    _seed(100 + rank)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    ckpt = Checkpointer(root)
    ckpt.save(1, {"extra": {"w": torch.full((2,), float(rank))}})
    expected = _draws()
    _seed(999)
    assert ckpt.load_latest({"extra": {"w": torch.zeros(2)}}) == 1
    return expected, _draws()


@pytest.mark.timeout(120)
def test_rng_states_come_back_per_rank(ranks, tmp_path: Path):
    pytest.importorskip("numpy")
    got = ranks.run(_rng_round_trip, 2, str(tmp_path / "ckpts"), timeout=100)
    for expected, drawn in got:
        assert drawn == expected
    assert got[0][0] != got[1][0]  # each rank its own stream, not rank 0's

    # At another world size: not restored, with a warning that says so.
    _seed(5)
    expected = _draws()
    _seed(5)
    from shardkit.checkpoint import Checkpointer

    with pytest.warns(UserWarning, match=r"it was saved by 2 ranks, this job has 1: the RNG states are not restored"):
        assert Checkpointer(tmp_path / "ckpts").load_latest({"extra": {"w": torch.zeros(2)}}) == 1
    assert _draws() == expected


def test_rng_states_saved_with_generators_this_process_lacks_are_not_restored(monkeypatch, tmp_path: Path):
    """A checkpoint saved where CUDA was available, resumed on a CPU-only process: the rest loads, with a warning."""
    from shardkit.checkpoint import Checkpointer, _rng

    capture = _rng.capture
    monkeypatch.setattr(_rng, "capture", lambda: {**capture(), "cuda": torch.zeros(1, 16, dtype=torch.uint8)})
    Checkpointer(tmp_path).save(3, {"extra": {"w": torch.ones(2)}})
    monkeypatch.setattr(_rng, "capture", capture)
    torch.manual_seed(4)
    expected = torch.rand(2)
    torch.manual_seed(4)
    state = {"extra": {"w": torch.zeros(2)}}
    with pytest.warns(UserWarning, match=r"its RNG states \['cuda'\] do not fit this process's generators"):
        assert Checkpointer(tmp_path).load_latest(state) == 3
    assert state["extra"]["w"].tolist() == [1.0, 1.0]
    assert torch.equal(torch.rand(2), expected)  # this process's own stream, untouched


# --- examples/train_gpt.py, stopped (or killed under torchrun) and resumed ------------------------------------

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2",
        "--log-every", "100", "--json"]


class _Stopped(Exception):
    pass


def _train_gpt(rank: int, world: int, argv: list[str], port: int, stop_at: int | None) -> dict[int, float]:
    """examples/train_gpt.py's main in this rank; with ``stop_at``, the run stops (an exception on every rank)
    before computing that step. Returns rank 0's loss at each step, exactly (what its progress was given)."""
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    if stop_at is not None:
        batches = example.batches

        def stopping(*args, **kwargs):
            batch = batches(*args, **kwargs)

            def at(step: int):
                if step == stop_at:
                    raise _Stopped
                return batch(step)
            return at
        example.batches = stopping
    losses: dict[int, float] = {}
    shown = example.Progress.step

    def step(self, step: int, loss: float, *args, **kwargs) -> None:
        losses[step] = loss
        shown(self, step, loss, *args, **kwargs)
    example.Progress.step = step
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            example.main(argv)
        except _Stopped:
            dist.destroy_process_group()
    return losses




RESTARTING = REPO / "tests" / "python" / "support" / "resume_train_gpt.py"


def run_restarting(nproc: int, args: list[str], kills: str, events: Path, timeout: float,
                   max_restarts: int = 3, shm_tag: str = "") -> subprocess.CompletedProcess:
    """tests/python/support/resume_train_gpt.py (train_gpt.py with the faults ``kills`` names) under torchrun
    --max-restarts (the standalone rendezvous; a port picked free); ``shm_tag``: SHARDKIT_SHM_TAG, to find the job's
    shared-memory segments."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", str(RESTARTING), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKIT_TEST_KILLS": kills, "SHARDKIT_TEST_EVENTS": str(events),
           "SHARDKIT_SHM_TAG": shm_tag}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _stop_and_rerun(run, whole: dict[int, float], tmp_path: Path) -> None:
    """In-process: the run stops before step 8 (the newest checkpoint is step 6's) and the same command runs again:
    it recomputes steps 6 and 7 with the uninterrupted run's losses and ends with its bits."""
    first = run(tmp_path / "stopped", 8)
    assert sorted(first) == list(range(8))
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == ["step-00000003", "step-00000006"]
    resumed = run(tmp_path / "stopped", None)
    assert sorted(resumed) == [6, 7, 8, 9]  # steps 6 and 7 recomputed
    assert resumed == {step: whole[step] for step in resumed}
    assert final_bits(tmp_path / "stopped", 10, tmp_path) == final_bits(tmp_path / "whole", 10, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["fully_shard", "zero2", "ddp", "fsdp"])
def test_train_gpt_stopped_or_killed_and_resumed_ends_bitwise_equal_to_the_uninterrupted_run(ranks, tmp_path: Path,
                                                                                             strategy: str):
    """Under torchrun --max-restarts (rank 1 SIGKILLs itself as attempt 0 begins step 8; torchrun restarts the job):
    the job resumes at step 6's checkpoint and ends with the uninterrupted run's bits, keeping the last two
    checkpoints. For fully_shard also stopped and rerun in-process (_stop_and_rerun); what the resume does is the
    same code for every front, which the killed runs exercise."""
    pytest.importorskip("numpy")  # DCP's plans travel through numpy
    args = [*TINY, "--strategy", strategy, "--steps", "10", "--checkpoint-every", "3"]

    def run(directory: Path, stop_at: int | None) -> dict[int, float]:
        argv = [*args, "--checkpoint-dir", str(directory)]
        return ranks.run(_train_gpt, 2, argv, harness.free_port(), stop_at, timeout=200, backend=None)[0]

    whole = run(tmp_path / "whole", None)
    assert sorted(whole) == list(range(10))
    if strategy == "fully_shard":
        _stop_and_rerun(run, whole, tmp_path)

    killed = tmp_path / "killed"
    tag = f"resume{uuid.uuid4().hex[:8]}"
    done = run_restarting(2, [*args, "--checkpoint-dir", str(killed)], "0:1:8:step", tmp_path / "events",
                          timeout=300, shm_tag=tag)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert not [n for n in os.listdir("/dev/shm") if f"shardkit-{tag}-" in n]  # the killed attempt's included
    assert "resumed at step 6" in done.stdout, done.stdout
    events = [json.loads(line) for line in (tmp_path / "events.rank1").read_text().splitlines()]
    assert [e["attempt"] for e in events if e["event"] == "start"] == [0, 1]
    assert [(e["step"], e["where"]) for e in events if e["event"] == "kill"] == [(8, "step")]
    assert final_bits(killed, 10, tmp_path) == final_bits(tmp_path / "whole", 10, tmp_path)
    # keep=2 (the default): the end's checkpoint and the one before it
    assert sorted(p.name for p in killed.iterdir()) == ["step-00000009", "step-00000010"]


@pytest.mark.timeout(300)
def test_train_gpt_with_async_saves_stopped_while_one_is_in_flight_resumes_bitwise(ranks, tmp_path: Path):
    """--checkpoint-async: the run stops (destroying its process group) while the save of step 8 may still be in
    flight, so the rerun resumes from step 8's checkpoint if it was committed, else from step 4's, skipping what the
    interrupted save left; either way it ends with the uninterrupted run's bits."""
    pytest.importorskip("numpy")
    args = [*TINY, "--strategy", "fully_shard", "--steps", "12", "--checkpoint-every", "4", "--checkpoint-async"]

    def run(directory: Path, stop_at: int | None) -> dict[int, float]:
        argv = [*args, "--checkpoint-dir", str(directory)]
        return ranks.run(_train_gpt, 2, argv, harness.free_port(), stop_at, timeout=120, backend=None)[0]

    whole = run(tmp_path / "whole", None)
    run(tmp_path / "stopped", 9)
    resumed = run(tmp_path / "stopped", None)
    assert min(resumed) in (4, 8) and sorted(resumed) == list(range(min(resumed), 12))
    assert resumed == {step: whole[step] for step in resumed}
    assert final_bits(tmp_path / "stopped", 12, tmp_path) == final_bits(tmp_path / "whole", 12, tmp_path)


# --- the README's Checkpoints section, as written --------------------------------------------------------------------

def _run_readme_loop(rank: int, world: int, code: str, workdir: str, crash_at: int | None,
                     seed: int = 5) -> dict[str, bytes]:
    """The README's loop on this rank: a shardkit.data.DataLoader over 3 epochs of 70 steps, each
    step's batch the loop's only input; with ``crash_at`` the job stops (every rank) inside that step."""
    import torch.nn.functional as F

    from shardkit import data

    os.chdir(workdir)  # the snippet's paths are relative
    g = torch.Generator().manual_seed(11)
    dataset = torch.utils.data.TensorDataset(torch.randn(280, 7, generator=g), torch.randn(280, 4, generator=g))
    sampler = data.ResumableSampler(dataset, shuffle=True, seed=3)
    loader = data.DataLoader(dataset, batch_size=2, sampler=sampler)  # (workers: a rank here is a daemon process)
    model, optimizer = _model(seed=seed)
    done = []

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        if len(done) + 1 == crash_at:
            raise _Stopped
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        done.append(1)

    namespace = {"model": model, "optimizer": optimizer, "sampler": sampler, "loader": loader, "epochs": 3,
                 "train_step": train_step}
    with contextlib.suppress(_Stopped):
        exec(compile(code, "README.md#checkpoints", "exec"), namespace)
    return _bits(model, optimizer)


@pytest.mark.timeout(300)
def test_the_readme_checkpoints_loop_runs_as_written_and_resumes_exactly(ranks, tmp_path: Path):
    pytest.importorskip("numpy")
    (code_lang, code), (cmd_lang, commands) = harness.readme_blocks("Checkpoints")[:2]
    assert (code_lang, cmd_lang) == ("python", "bash")
    assert "Checkpointer(" in code and "load_latest(" in code
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    whole.mkdir()
    interrupted.mkdir()
    expected = ranks.run(_run_readme_loop, 2, code, str(whole), None, timeout=250)
    ranks.run(_run_readme_loop, 2, code, str(interrupted), 180, timeout=250)  # the newest checkpoint: step 100
    assert sorted(p.name for p in (interrupted / "ckpts").iterdir()) == ["step-00000100"]
    # The rerun builds other weights (seed 6), which the checkpoint of step 100 (mid-epoch 1) replaces.
    resumed = ranks.run(_run_readme_loop, 2, code, str(interrupted), None, 6, timeout=250)
    assert resumed == expected
    assert sorted(p.name for p in (interrupted / "ckpts").iterdir()) == ["step-00000100", "step-00000200"]
    for line in commands.splitlines():
        command = line.split("#")[0].split()
        assert command[:3] == ["python", "-m", "shardkit"], line
        done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, cwd=interrupted,
                              timeout=120)
        assert done.returncode == 0, f"{line}\n{done.stderr}"

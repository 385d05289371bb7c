"""Ray Train on shardkit: ``TorchTrainer(..., torch_config=TorchConfig(backend="shardkit"))`` on a local Ray cluster
(started here, once for the module) trains shardkit's DistributedDataParallel and ``fully_shard`` to the same bits as
torch's own wrappers on ``backend="gloo"``, and a worker killed mid-run fails the run with Ray's error carrying
shardkit's message naming the dead rank.

Ray Train here is V2 (the default in ray 2.60: ``RAY_TRAIN_V2_ENABLED`` unset): ``ray.train.torch.TorchTrainer`` is
``ray.train.v2.torch.torch_trainer.TorchTrainer``, run by a controller actor that polls the worker actors; its
failures are ``ray.train.TrainingFailedError`` (here its subclass ``ray.train.WorkerGroupError``).

The train loop (support/ray_train_loop.py) names no backend and imports shardkit only after Ray made the group:
Ray's workers find ``"shardkit"`` through torch's autoloading (the wheel's ``torch.backends`` entry point), as any
framework that calls ``init_process_group(backend=...)`` for its users does.

Oracles:
- parity: the same loop under ``TorchConfig(backend="gloo")`` with torch's own ``DistributedDataParallel`` and
  ``fully_shard`` (no shardkit code on its path). 2 ranks, so every sum has one order: each rank's losses and a
  sha256 of every parameter's bytes after 3 AdamW steps must be **bitwise** equal, for both fronts.
- the kill: rank 1 SIGKILLs itself between a forward and a backward (FailureConfig(max_failures=0)); ``fit()``
  must raise ``WorkerGroupError`` whose rank 0 failure is shardkit's RuntimeError naming rank 1 and its pid, and
  whose text (what the user sees) carries that message. Ray fails the run on the first poll (every 2 s) that finds
  any error, with that poll's errors only: rank 0's error is in it only if rank 0 failed before that poll. So rank 1
  dies just after a poll (see ``ray_train_loop._die_just_after_a_poll``); killed at a random moment instead, rank 1's
  death alone was Ray's error in 1 run of 5 here (shardkit needs up to 0.2 s to see a pid gone, Ray ~0).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError, WorkerGroupError  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from support import ray_train_loop  # noqa: E402

WORKERS = 2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")  # ray.data's, at import


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray cluster for the module: 3 logical CPUs (the 2 workers take 1 each; Ray Train's controller 0).
    Its processes inherit this environment, so the workers import the shardkit this test imports (PYTHONPATH, made
    absolute) and tests/python's support package, keep conftest's SHARDKIT_SHM_TAG (its /dev/shm check covers them)
    and write shardkit's flight-recorder files under the module's temp dir. Yields that dir."""
    base = tmp_path_factory.mktemp("ray")
    paths = [str(TESTS)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(paths))
        env.setenv("SHARDKIT_TRACE_DIR", str(base / "traces"))
        started = time.monotonic()
        # Ray's logs (worker ones included) stay there; log_to_driver=False keeps the workers' out of pytest's output
        ray.init(num_cpus=3, object_store_memory=128 << 20, include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(base / "r"), logging_level=logging.WARNING)
        print(f"ray.init: {time.monotonic() - started:.1f} s; logs in {base / 'r'}")
        try:
            yield base
        finally:
            ray.shutdown()


def fit(cluster: Path, out: Path, tag: str, backend: str, **config: Any) -> None:
    """One TorchTrainer run of ray_train_loop.train_loop on 2 CPU workers, no retry."""
    trainer = TorchTrainer(
        ray_train_loop.train_loop,
        train_loop_config={"out": str(out), "tag": tag, "backend": backend, **config},
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(name=tag, storage_path=str(cluster / "results"),
                             failure_config=FailureConfig(max_failures=0)),
    )
    started = time.monotonic()
    try:
        trainer.fit()
    finally:
        print(f"{tag}: fit() took {time.monotonic() - started:.1f} s")


def ranks(out: Path, tag: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(WORKERS)]


@pytest.mark.timeout(150)
def test_shardkit_ddp_and_fully_shard_under_torch_trainer_are_bitwise_gloo(cluster, tmp_path):
    fit(cluster, tmp_path, "shardkit", "shardkit", wrappers="shardkit")
    fit(cluster, tmp_path, "gloo", "gloo", wrappers="torch")
    ours, theirs = ranks(tmp_path, "shardkit"), ranks(tmp_path, "gloo")

    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        assert mine["backend"] == "shardkit" and ref["backend"] == "gloo"
        assert mine["wrappers"][0] == "shardkit.ddp.DistributedDataParallel", mine["wrappers"]
        assert mine["wrappers"][1].endswith("/shardkit/fsdp/_fully_shard.py"), mine["wrappers"]
        assert ref["wrappers"][0] == "torch.nn.parallel.distributed.DistributedDataParallel", ref["wrappers"]
        assert "/torch/distributed/" in ref["wrappers"][1], ref["wrappers"]
        # The workers ran the shardkit this process would import, found by the backend's name: the gloo run's workers
        # had loaded none of shardkit's package when the loop started (only torch's entry point), the shardkit run's
        # had, the group's creator having imported it.
        assert mine["shardkit_file"] == importlib.util.find_spec("shardkit").origin, mine["shardkit_file"]
        assert ref["loaded_at_start"] == ["_shardkit_autoload"], ref["loaded_at_start"]
        assert mine["loaded_at_start"] == ["_shardkit_autoload", "shardkit"], mine["loaded_at_start"]
        for seen in (mine, ref):
            assert seen["env"]["RANK"] == seen["env"]["LOCAL_RANK"] == str(rank), seen["env"]
            assert seen["env"]["WORLD_SIZE"] == seen["env"]["LOCAL_WORLD_SIZE"] == str(WORKERS), seen["env"]
            assert seen["env"]["SHARDKIT_SHM_TAG"] == os.environ["SHARDKIT_SHM_TAG"]  # conftest's /dev/shm check
        for front in ("ddp", "fully_shard"):
            assert mine[front] == ref[front], f"rank {rank} {front}: shardkit {mine[front]} vs gloo {ref[front]}"
            assert mine[front]["sha256"] != mine["initial_sha256"], f"{front} did not change the parameters"
            assert len(mine[front]["losses"]) == ray_train_loop.STEPS
    assert ours[0]["ddp"]["losses"] != ours[1]["ddp"]["losses"]  # the ranks trained on different data
    assert ours[0]["ddp"]["sha256"] == ours[1]["ddp"]["sha256"]  # and hold the same model
    assert ours[0]["fully_shard"]["sha256"] == ours[1]["fully_shard"]["sha256"]


@pytest.mark.timeout(90)
def test_a_worker_killed_mid_run_fails_the_run_with_shardkits_message_naming_it(cluster, tmp_path):
    with pytest.raises(TrainingFailedError) as caught:
        fit(cluster, tmp_path, "killed", "shardkit", wrappers="shardkit", kill_at=1)
    error = caught.value
    text = str(error)
    notes = {name: tmp_path / f"killed-rank{name}.json" for name in ("1-killed", "0-failed")}
    assert notes["1-killed"].is_file(), f"rank 1 did not get to kill itself: {text}"
    killed = json.loads(notes["1-killed"].read_text())
    failed = json.loads(notes["0-failed"].read_text()) if notes["0-failed"].is_file() else {}
    timeline = (f"rank 1 polled at 0, killed at {killed['killed'] - killed['polled']:.2f} s; rank 0 failed at "
                f"{failed.get('failed', float('nan')) - killed['polled']:.2f} s: {failed.get('error')}")
    print(timeline)
    assert isinstance(error, WorkerGroupError), f"{type(error).__name__}: {text}"
    assert sorted(error.worker_failures) == [0, 1], f"{timeline}\n{text}"

    # rank 0: shardkit's error, raised in the backward's allreduce, naming rank 1 and its pid
    survivor = error.worker_failures[0]
    named = rf"rank\(s\) 1 \(pid {killed['pid']}\) exited before arriving"
    message = rf"shardkit allreduce #\d+ \(f32 x \d+, sum\) for DDP bucket 0 of 1 \(.*\) \(rank 0\): {named}"
    assert isinstance(survivor, RuntimeError) and re.search(message, str(survivor)), f"{timeline}\n{survivor!r}"
    assert "[Rank 0 Error Snippet]" in text and re.search(f"RuntimeError: {message}", text), text  # what users read
    trace = re.search(r"this rank's last collectives are in (\S+);", str(survivor))
    assert trace and Path(trace[1]).is_relative_to(cluster / "traces") and Path(trace[1]).is_file(), str(survivor)

    # rank 1: Ray's own account of the death
    dead = error.worker_failures[1]
    assert type(dead).__name__ == "WorkerHealthCheckFailedError", repr(dead)
    assert isinstance(dead.health_check_failure, ray.exceptions.ActorDiedError), repr(dead.health_check_failure)
    assert f"pid: {killed['pid']}" in text, text

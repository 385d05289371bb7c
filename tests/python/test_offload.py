"""``shardkit.optim.OffloadedAdamW`` / ``OffloadedAdam``: torch's AdamW / Adam with the moments in a file on disk.

The oracle is ``torch.optim.AdamW(fused=True)`` (``Adam`` for OffloadedAdam) on a deep copy of the model, same
batches: the update runs torch's fused kernel chunk by chunk on the state streamed from the file, element by element,
so parameters and state are asserted **bitwise** equal after every step, with chunks that split parameters and end
short (several buffer sets, amsgrad, maximize, weight decay). Also: the state in memory is only ``step``; a state dict
taken mid-run continues bitwise (into a fresh OffloadedAdamW and into torch's AdamW, and back); shardkit's DDP,
ZeRO-1 (``ZeroRedundancyOptimizer(optimizer_class=OffloadedAdamW)``) and ``fully_shard`` (the DTensor shards'
state) at world 2 give what torch's AdamW gives under torch's wrappers on gloo; the file is removed with the
optimizer; a file removed or truncated
under the optimizer, and what is not supported yet, raise naming it. And the point of it: a run whose model state
exceeds a memory cap (a cgroup) is OOM-killed with torch's AdamW and completes with OffloadedAdamW, with the same
losses bit for bit.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.optim import OffloadedAdam, OffloadedAdamW

CHUNK = 4 * 4096  # 4096 elements: parameters of 3001 x 37 span many chunks, most end short
STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 3001), nn.Tanh(), nn.Linear(3001, 5))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, seed: int = 0) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * seed + step)
        x, y = torch.randn(8, 37, generator=g), torch.randn(8, 5, generator=g)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_same(model: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs by {(a - b).abs().max().item():.3e}"


VARIANTS = {
    "adamw": (OffloadedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    "adamw-amsgrad-3-buffers": (OffloadedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "adamw-maximize-decay": (OffloadedAdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, maximize=True)),
    "adam-decay": (OffloadedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, betas=(0.8, 0.99))),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_step_is_bitwise_torchs_fused_optimizer(tmp_path, variant):
    ours_class, torch_class, kwargs = VARIANTS[variant]
    model, reference = _model(), _model()
    buffers = 3 if "3-buffers" in variant else 2
    optimizer = ours_class(model.parameters(), path=tmp_path, chunk_bytes=CHUNK, buffers=buffers, **kwargs)
    anchor = torch_class(reference.parameters(), fused=True, **kwargs)
    for step in range(STEPS):
        _train(model, optimizer, range(step, step + 1))
        _train(reference, anchor, range(step, step + 1))
        _assert_same(model, reference, f"{variant} step {step}")
    # the state in memory is the step counter; the moments are in the file, and are torch's bit for bit
    assert all(set(state) == {"step"} for state in optimizer.state.values())
    ours, theirs = optimizer.state_dict()["state"], anchor.state_dict()["state"]
    for index, state in theirs.items():
        for key, value in state.items():
            assert torch.equal(ours[index][key], value), (index, key)
    assert optimizer.direct_io, optimizer.direct_io_refused  # tmp_path is on ext4 here


def test_a_state_dict_taken_mid_run_continues_bitwise_here_and_in_torchs_adamw(tmp_path):
    model, reference = _model(), _model()
    optimizer = OffloadedAdamW(model.parameters(), lr=1e-2, path=tmp_path, chunk_bytes=CHUNK)
    anchor = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    _train(model, optimizer, range(5))
    _train(reference, anchor, range(5))
    saved = optimizer.state_dict()
    # ... into a fresh OffloadedAdamW on a copy of the model, and into torch's AdamW on another copy
    resumed_model, torch_model = copy.deepcopy(model), copy.deepcopy(model)
    resumed = OffloadedAdamW(resumed_model.parameters(), lr=1e-2, path=tmp_path / "resumed", chunk_bytes=CHUNK)
    resumed.load_state_dict(copy.deepcopy(saved))
    assert all(set(state) == {"step"} for state in resumed.state.values())  # written back into its file
    into_torch = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, fused=True)
    into_torch.load_state_dict(copy.deepcopy(saved))
    # ... and torch's own state dict into an OffloadedAdamW
    from_torch_model = copy.deepcopy(reference)
    from_torch = OffloadedAdamW(from_torch_model.parameters(), lr=1e-2, path=tmp_path / "from_torch",
                                chunk_bytes=CHUNK)
    from_torch.load_state_dict(copy.deepcopy(anchor.state_dict()))
    for m, o in ((model, optimizer), (reference, anchor), (resumed_model, resumed), (torch_model, into_torch),
                 (from_torch_model, from_torch)):
        _train(m, o, range(5, STEPS))
    for m, what in ((resumed_model, "resumed"), (torch_model, "into torch"), (from_torch_model, "from torch"),
                    (model, "uninterrupted")):
        _assert_same(m, reference, what)


def _front_rank(rank: int, world: int, front: str, directory: str) -> list[float]:
    """``front`` with OffloadedAdamW against the same with torch.optim.AdamW(fused=True), torch's wrapper on gloo as
    the anchor: parameters bitwise equal after every step (2 ranks: every gradient sum has one order)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    gloo = dist.new_group(backend="gloo")

    def offloaded(params):
        return OffloadedAdamW(params, lr=1e-2, path=directory, chunk_bytes=CHUNK)

    if front == "ddp":
        model = shardkit.DistributedDataParallel(_model())
        optimizer = offloaded(model.parameters())
    elif front == "zero1":
        model = shardkit.DistributedDataParallel(_model())
        optimizer = shardkit.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=OffloadedAdamW, lr=1e-2,
                                                     path=directory, chunk_bytes=CHUNK)
    else:  # fully_shard: the state of each rank's DTensor shards
        model = _model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                shardkit.fully_shard(layer)
        shardkit.fully_shard(model)
        optimizer = offloaded(model.parameters())
    if front == "zero1":  # the same slices with torch's AdamW: ZeRO splits parameters at slice boundaries, and
        # the fused kernel's vector blocks start at each slice, so torch's DDP + AdamW is only 1 ulp away; the exact
        # anchor is torch's optimizer on the same slices (ZeRO itself against torch: test_zero.py)
        anchor_model = shardkit.DistributedDataParallel(_model())
        anchor = shardkit.ZeroRedundancyOptimizer(anchor_model.parameters(), optimizer_class=torch.optim.AdamW,
                                                  lr=1e-2, fused=True)
    elif front == "fully_shard":
        anchor_model = _model()
        mesh = DeviceMesh.from_group(gloo, "cpu")
        for layer in anchor_model:
            if isinstance(layer, nn.Linear):
                torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(anchor_model, mesh=mesh)
    elif front == "ddp":
        anchor_model = nn.parallel.DistributedDataParallel(_model(), process_group=gloo)
    if front != "zero1":
        anchor = torch.optim.AdamW(anchor_model.parameters(), lr=1e-2, fused=True)
    losses = []
    for step in range(STEPS):
        losses += _train(model, optimizer, range(step, step + 1), seed=rank + 1)
        _train(anchor_model, anchor, range(step, step + 1), seed=rank + 1)
        for (name, a), b in zip(model.named_parameters(), anchor_model.parameters(), strict=True):
            a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b))
            assert torch.equal(a, b), f"rank {rank} {front} step {step}: {name} by {(a - b).abs().max().item():.3e}"
    return losses


@pytest.mark.parametrize("front", ["ddp", "zero1", "fully_shard"])
def test_every_front_at_world_2_as_torch_adamw_under_torchs_wrapper(ranks, tmp_path, front):
    results = ranks.run(_front_rank, 2, front, str(tmp_path), timeout=120)
    assert results[0] != results[1]  # each rank trains on its own batches


def test_the_file_goes_with_the_optimizer_and_a_removed_or_truncated_one_is_named(tmp_path):
    model = _model()
    optimizer = OffloadedAdamW(model.parameters(), path=tmp_path, chunk_bytes=CHUNK)
    path = optimizer.state_path
    assert Path(path).parent == tmp_path and os.path.exists(path)
    _train(model, optimizer, range(1))
    os.truncate(path, 4096)
    with pytest.raises(RuntimeError, match=f"shardkit state file {path}: the file was truncated to 4096 of its"):
        _train(model, optimizer, range(1))
    os.unlink(path)
    with pytest.raises(RuntimeError, match=f"shardkit state file {path}: the file was removed under the optimizer"):
        _train(model, optimizer, range(1))
    second = OffloadedAdamW(model.parameters(), path=tmp_path, chunk_bytes=CHUNK)
    second_path = second.state_path
    del second
    gc.collect()
    assert not os.path.exists(second_path)


def test_what_is_not_built_yet_is_refused_by_name(tmp_path):
    with pytest.raises(NotImplementedError, match=r"OffloadedAdamW: torch.bfloat16 parameters \(fp32 master weights "
                                                  "on disk\\) are not supported yet"):
        OffloadedAdamW([nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], path=tmp_path)
    with pytest.raises(ValueError, match="OffloadedAdamW: chunk_bytes must be a positive multiple of 4096, got 1000"):
        OffloadedAdamW([nn.Parameter(torch.zeros(4))], path=tmp_path, chunk_bytes=1000)
    with pytest.raises(ValueError, match="OffloadedAdamW: buffers must be at least 2"):
        OffloadedAdamW([nn.Parameter(torch.zeros(4))], path=tmp_path, buffers=1)


# --- a run that does not fit in memory without it ---------------------------------------------------------------

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
# support/offload_memory_script.py peaks at ~1010 MB of RSS with torch's AdamW and ~720 MB with the moments on disk
# (measured here; the model state is 656 MB, of which the moments are 328 MB): a cap between the two.
MEMORY_CAP = 880 * 10**6


def _run_capped(kind: str, tmp_path: Path, cap: int | None) -> tuple[subprocess.CompletedProcess, dict | None, int]:
    """The script in a memory cgroup of its own capped at ``cap`` bytes (None: no cgroup): its outcome, its JSON
    (None where it did not finish) and the cgroup's peak usage."""
    out = tmp_path / f"{kind}.json"
    script = Path(__file__).parent / "support" / "offload_memory_script.py"
    group = CGROUP_V1 / f"shardkit-test-{os.getpid()}-{kind}"
    preexec = None
    if cap is not None:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(cap))

        def preexec() -> None:  # the child joins the group before it execs: everything it maps is counted
            (group / "cgroup.procs").write_text(str(os.getpid()))
    try:
        result = subprocess.run([sys.executable, str(script), kind, str(tmp_path / "state"), str(out)],
                                capture_output=True, text=True, timeout=120, preexec_fn=preexec,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        peak = int((group / "memory.max_usage_in_bytes").read_text()) if cap is not None else 0
    finally:
        if cap is not None:
            group.rmdir()
    return result, (json.loads(out.read_text()) if out.exists() else None), peak


@pytest.mark.timeout(300)
def test_a_run_that_does_not_fit_in_memory_fits_with_the_moments_on_disk(tmp_path):
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory)")
    free, reference, _ = _run_capped("torch", tmp_path, None)
    assert free.returncode == 0, free.stderr[-2000:]
    capped, _, _ = _run_capped("torch", tmp_path, MEMORY_CAP)
    assert capped.returncode == -signal.SIGKILL, (capped.returncode, capped.stderr[-2000:])  # the OOM killer
    offloaded, result, peak = _run_capped("offloaded", tmp_path, MEMORY_CAP)
    assert offloaded.returncode == 0, offloaded.stderr[-2000:]
    assert result is not None and reference is not None
    assert result["losses"] == reference["losses"]  # bitwise: torch's fused kernel on the streamed state
    assert result["peak_rss_bytes"] < MEMORY_CAP and peak <= MEMORY_CAP
    assert not any((tmp_path / "state").iterdir())  # the state file went with the optimizer

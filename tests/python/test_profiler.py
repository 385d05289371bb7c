"""torch.profiler shows shardkit's work by name (the scheme of csrc/profile_span.h and docs/profiling.md).

Each case profiles real training steps and reads the exported Chrome trace (what a user opens in Perfetto),
asserting the exact labels: the DDP forward, each bucket's launch and copy-back, the reducer's end of
backward, the comm hooks per bucket, FSDP's all-gather and reduce-scatter per unit, ZeRO's step, and the
backend's collectives as c10d Work spans. Labels that a step does not produce must not appear either (a
hook's label without that hook), so a label emitted unconditionally fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from support.ddp_cases import batch, loss_fn, mlp, sgd


def _labels(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("shardkit::")}


def _profiled_steps(rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, trace: Path,
                    steps: int = 2) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            optimizer.step()
    prof.export_chrome_trace(str(trace))
    return _labels(trace)


def _ddp(rank, world, hook, workdir):
    import shardkit

    model = shardkit.DistributedDataParallel(mlp(), bucket_cap_mb=0.0001)  # several buckets after the rebuild
    if hook == "powersgd":
        state = shardkit.hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, shardkit.hooks.powerSGD_hook)
    elif hook == "bf16":
        model.register_comm_hook(None, shardkit.hooks.bf16_compress_hook)
    opt = sgd(model.parameters())
    for step in range(2):  # past the first iteration and the bucket rebuild: the steady state is profiled
        opt.zero_grad()
        loss_fn(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        opt.step()
    return sorted(_profiled_steps(rank, model, opt, Path(workdir) / f"ddp{rank}.json", steps=3))


@pytest.mark.parametrize("hook", ["none", "powersgd", "bf16"])
def test_ddp_step_labels(ranks, tmp_path, hook):
    labels = set(ranks.run(_ddp, 2, hook, str(tmp_path))[0])
    buckets = 5  # mlp()'s 6 parameters in 104-byte buckets after the rebuild (test_ddp.py)
    expected = {"shardkit::ddp.forward", "shardkit::ddp.finalize"}
    expected |= {f"shardkit::ddp.bucket[{i}]" for i in range(buckets)}
    expected |= {f"shardkit::ddp.copy_bucket_to_grad[{i}]" for i in range(buckets)}
    expected |= {"none": set(), "powersgd": {f"shardkit::powersgd[{i}]" for i in range(buckets)},
                 "bf16": {f"shardkit::bf16_compress[{i}]" for i in range(buckets)}}[hook]
    assert expected <= labels, sorted(expected - labels)
    assert "shardkit::allreduce" in labels  # the backend's Work for the buckets (or the hooks' allreduces)
    hook_labels = {label.split("[")[0] for label in labels if "compress" in label or "powersgd" in label}
    assert hook_labels == {"none": set(), "powersgd": {"shardkit::powersgd"},
                           "bf16": {"shardkit::bf16_compress"}}[hook]
    assert "shardkit::ddp.rebuild_buckets" not in labels  # happened before profiling began, once


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.second = nn.Linear(16, 4)

    def forward(self, x):
        return self.second(self.first(x))


def _fsdp(rank, world, workdir):
    import shardkit

    model = shardkit.FullyShardedDataParallel(_TwoBlocks(), auto_wrap_policy={nn.Sequential, nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return sorted(_profiled_steps(rank, model, opt, Path(workdir) / f"fsdp{rank}.json"))


def test_fsdp_step_labels(ranks, tmp_path):
    labels = set(ranks.run(_fsdp, 2, str(tmp_path))[0])
    units = ["first.0", "second"]  # "first" holds no parameter of its own: its Linear is a unit
    expected = {f"shardkit::fsdp.{what}[{unit}]" for unit in units
                for what in ("all_gather", "wait_all_gather", "reduce_scatter", "reduce_finish")}
    assert expected <= labels, sorted(expected - labels)
    assert {"shardkit::all_gather_into_tensor", "shardkit::reduce_scatter_tensor"} <= labels, sorted(labels)


def _zero(rank, world, workdir):
    import shardkit

    model = shardkit.DistributedDataParallel(mlp(), zero_stage=2)
    opt = shardkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    return sorted(_profiled_steps(rank, model, opt, Path(workdir) / f"zero{rank}.json"))


def test_zero_step_labels(ranks, tmp_path):
    labels = set(ranks.run(_zero, 2, str(tmp_path))[0])
    assert {"shardkit::ddp.forward", "shardkit::ddp.bucket[0]", "shardkit::reduce", "shardkit::zero.step",
            "shardkit::zero.all_gather"} <= labels, sorted(labels)


def _collective(rank, world, workdir):
    t = torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
    prof.export_chrome_trace(str(Path(workdir) / f"c{rank}.json"))
    return sorted(_labels(Path(workdir) / f"c{rank}.json"))


def test_collective_work_labels(ranks, tmp_path):
    assert ranks.run(_collective, 2, str(tmp_path))[0] == ["shardkit::allreduce", "shardkit::broadcast"]

"""``import shardkit`` and a DDP / ZeRO job load no part of torch's DCP, DTensor, FSDP2 or sympy (docs/design.md,
"Python"): those cost about as much CPU as torch's own import, paid by every rank of every job. The features that
need them load them at first use, and still work when they do.

torch's own optimizers import torch._dynamo as they are built (torch 2.13: ``Optimizer.add_param_group`` is wrapped by
``torch._disable_dynamo``), and dynamo imports DTensor, FSDP2 and sympy: after a ZeRO step the test allows exactly
what a plain torch optimizer loaded before it, and DCP still not.

Fresh processes (the test harness's forkserver preloads these modules, so its ranks cannot tell): two ranks
started as plain subprocesses on a file:// store, each printing a JSON line of what it found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ["torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp", "sympy"]

RANK = r"""
import json, sys, torch, torch.distributed as dist
HEAVY = {heavy!r}
found = {{}}
def loaded(stage):
    found[stage] = sorted(m for m in HEAVY if m in sys.modules)

import shardkit
loaded("import shardkit")
rank, store, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("shardkit", init_method=f"file://{{store}}", rank=rank, world_size=2)
loaded("init_process_group")

torch.manual_seed(0)
def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(6, 8) + rank

ddp = shardkit.DistributedDataParallel(mlp())
ddp.register_comm_hook(None, shardkit.hooks.fp16_compress_hook)
ddp(x).sum().backward()
loaded("DDP forward and backward with a comm hook")

t = torch.full((5,), float(rank + 1))
shardkit.all_reduce_(t)
assert t.tolist() == [3.0] * 5, t
loaded("all_reduce_")

opt = torch.optim.SGD(ddp.parameters(), lr=0.1)  # torch's own optimizer: imports torch._dynamo
opt.step()
loaded("torch optimizer step")

for stage in (1, 2):
    zero = shardkit.DistributedDataParallel(mlp(), zero_stage=stage)
    zopt = shardkit.ZeroRedundancyOptimizer(zero.module.parameters(), torch.optim.AdamW, lr=0.01)
    zero(x).sum().backward()
    zopt.step()
    loaded(f"ZeRO-{{stage}} step")

# First use: what needs DCP / FSDP2 loads it now, and works.
shardkit.checkpoint.save({{"model": ddp.module.state_dict()}}, ckpt)
loaded("checkpoint.save")
sharded = shardkit.fully_shard(mlp())
sharded(x).sum().backward()
loaded("fully_shard step")
dist.destroy_process_group()
print("RESULT " + json.dumps(found))
"""


@pytest.mark.timeout(240)
def test_heavy_modules_load_at_first_use(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(heavy=HEAVY))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")]))}
    ckpt = tmp_path / "ckpt"
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store"), str(ckpt)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=200) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, (proc, (out, err)) in enumerate(zip(ranks, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out}\n{err[-4000:]}"
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        found = json.loads(line.removeprefix("RESULT "))
        for stage in ("import shardkit", "init_process_group", "DDP forward and backward with a comm hook",
                      "all_reduce_"):
            assert found[stage] == [], f"rank {rank}: after {stage}, {found[stage]} were imported"
        assert "torch.distributed.checkpoint" not in found["torch optimizer step"], found
        for stage in ("ZeRO-1 step", "ZeRO-2 step"):
            assert found[stage] == found["torch optimizer step"], \
                f"rank {rank}: after {stage}, {found[stage]} were imported ({found['torch optimizer step']} by torch)"
        assert {"torch.distributed.checkpoint", "torch.distributed.tensor"} <= set(found["checkpoint.save"])
        assert "torch.distributed.fsdp" in found["fully_shard step"]
    assert (ckpt / ".metadata").is_file(), sorted(p.name for p in ckpt.iterdir())

"""One process of tests/python/test_accelerate_launch.py, started by ``accelerate launch``: shardkit's Accelerator
with no plugin argument (so the config file decides), 2 steps on a model of two ``Block``s, then
``OUT_DIR/rank{r}.json`` per rank (a file each: the ranks' stdout lines may interleave): world size, backend,
strategy, which modules became fully_shard units, the loss. ``train`` is the job on a given Accelerator.

    accelerate launch ... accelerate_launch_script.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from shardkit.integrations.accelerate import Accelerator


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def train(accelerator: Accelerator, out_dir: Path) -> None:
    """The job and its report. The test's anchor runs it too, in harness ranks, with the plugin given explicitly."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
    for _ in range(2):
        loss = model(data).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    from torch.distributed.fsdp import FSDPModule

    units = sorted(name or "(root)" for name, m in accelerator.unwrap_model(model).named_modules()
                   if isinstance(m, FSDPModule))
    plugin = accelerator.shardkit_plugin
    result = {"rank": accelerator.process_index, "world": accelerator.num_processes,
              "backend": accelerator.state.backend, "strategy": plugin.resolved_strategy,
              "auto_wrap": list(plugin.auto_wrap or []), "reshard_after_forward": plugin.reshard_after_forward,
              "units": units, "loss": float(loss)}
    (out_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


def main() -> None:
    train(Accelerator(), Path(sys.argv[1]))


if __name__ == "__main__":
    main()

"""A training run whose model state outgrows a memory cap unless the optimizer's state is on disk
(test_offload.py's cgroup test).

    python offload_memory_script.py torch|offloaded STATE_DIR OUT_JSON

4 x Linear(3200, 3200) (41M parameters, 164 MB in fp32): parameters and gradients 328 MB, AdamW's moments 328 MB
more. Trains 3 steps with torch.optim.AdamW(fused=True) or shardkit.optim.OffloadedAdamW (moments in STATE_DIR) and
writes the losses and the peak RSS to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

WIDTH, LAYERS, STEPS = 3200, 4, 3


def main(kind: str, state_dir: str, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    if kind == "torch":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        from shardkit.optim import OffloadedAdamW

        optimizer = OffloadedAdamW(model.parameters(), lr=1e-3, path=state_dir)
    losses = []
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(4, WIDTH, generator=g)
        optimizer.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with open("/proc/self/status") as status:  # VmHWM: this process's own peak (ru_maxrss keeps the parent's)
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        json.dump({"losses": losses, "peak_rss_bytes": peak_kib * 1024}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""One Lightning run, launched by tests/python/test_lightning.py under torchrun: Lightning's own ``DDPStrategy``
with the process group backend named on the command line (``shardkit`` or ``gloo``), as a Lightning user writes
it (``one_host_per_rank`` after them: simulated hosts); rank 0 writes the trained weights and the backend the job ran on to the result file (an .npz)."""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn


def main(backend: str, result: str, one_host_per_rank: bool) -> None:
    if one_host_per_rank:  # each rank on a simulated host of its own: the hierarchical engine
        import os

        os.environ["SHARDKIT_HOST_ID"] = f"host{os.environ['RANK']}"
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    import shardkit  # noqa: F401 - registers the "shardkit" backend

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    pl.seed_everything(0, verbose=False)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = Regression()
    initial = {f"initial/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                         max_steps=5, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)  # every rank holds the same weights
    hosts = 0
    if dist.get_backend() == "shardkit":
        from shardkit.backend import host_topology

        hosts = host_topology().num_hosts
    if dist.get_rank() == 0:
        same = all(np.array_equal(w[k], weights[k]) for w in gathered for k in weights)
        np.savez(result, backend=np.array(dist.get_backend()), ranks_agree=np.array(same),
                 world=np.array(dist.get_world_size()), hosts=np.array(hosts), **weights, **initial)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["one_host_per_rank"])

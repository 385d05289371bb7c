# shardkit's Lightning strategy (needs `pip install lightning`); the README's code, run with:
#   torchrun --standalone --nproc_per_node=2 examples/lightning_train.py
import lightning.pytorch as pl
import torch
from torch import nn

from shardkit.integrations.lightning import ShardkitStrategy


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=2, strategy=ShardkitStrategy("zero2"),
                     gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Regression(), data)
if trainer.is_global_zero:
    print(f"{trainer.world_size} processes, {trainer.strategy.resolved_strategy}: "
          f"loss {trainer.callback_metrics['loss']:.3f}")

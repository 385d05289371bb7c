# shardkit inside Hugging Face accelerate (needs `pip install accelerate`); the README's code, run with:
#   torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py
import torch
from torch import nn

from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

accelerator = Accelerator(gradient_accumulation_steps=2,
                          shardkit_plugin=ShardkitPlugin(strategy="fully_shard"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)

data = torch.randn(64, 32, generator=torch.Generator().manual_seed(accelerator.process_index))
for step in range(8):
    with accelerator.accumulate(model):
        x = data[step * 8:(step + 1) * 8]
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)  # the global norm
        optimizer.step()
        optimizer.zero_grad()

accelerator.save_state("accelerate_checkpoint")  # sharded, loads at any world size
accelerator.print(f"{accelerator.num_processes} processes on {accelerator.state.backend}: "
                  f"last gradient norm {norm:.3f}")

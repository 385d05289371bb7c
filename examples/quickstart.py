# The README's Quickstart, verbatim (tests/python/test_quickstart.py keeps the two equal). Run it with
#   torchrun --standalone --nproc_per_node=4 examples/quickstart.py
import torch
import torch.distributed as dist

import shardkit  # registers the "shardkit" backend

dist.init_process_group("shardkit")          # under torchrun; init_method="file://..." works too
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1024) * rank
dist.all_reduce(t, op=dist.ReduceOp.AVG)     # every rank now holds the mean of 0 .. world-1

torch.manual_seed(rank)                      # different data on each rank; DDP starts all from rank 0's weights
model = shardkit.DistributedDataParallel(torch.nn.Linear(16, 1))   # torch DDP's arguments
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(32, 16)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()                          # averages the gradients over the ranks
    optimizer.step()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f} (rank 0)")
if rank == 0:
    print(f"{world} ranks: all_reduce AVG = {t[0].item()}; 5 DDP steps done")
dist.destroy_process_group()

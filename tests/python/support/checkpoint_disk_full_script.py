"""Run by test_checkpoint_integrity.py inside a mount namespace where DIR is a small tmpfs (room for one
checkpoint of this model, not two): two ranks save a checkpoint into DIR/ckpt, train on, and save again over it,
which runs out of room. Prints one JSON line per rank: the second save's error, whether the first checkpoint
then loads with exactly its values, and what is left in DIR.

    python checkpoint_disk_full_script.py DIR
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

FEATURES = 512  # two Linear(512, 512) + AdamW's two moments: ~6.3 MB of checkpoint


def _model():
    import shardkit

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES))
    model = shardkit.FullyShardedDataParallel(layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + step)
    optimizer.zero_grad()
    model(torch.randn(4, FEATURES, generator=g)).square().mean().backward()
    optimizer.step()


def _full_bytes(model, optimizer) -> dict[str, bytes]:
    from shardkit.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    values = {f"model.{k}": v for k, v in model_sd.items()}
    values.update({f"optim.{name}.{k}": v for name, entry in optim_sd["state"].items() for k, v in entry.items()})
    return {k: bytes(v.reshape(-1).view(torch.uint8).tolist()) for k, v in values.items()}


def rank_main(rank: int, world: int, store: str, directory: str) -> dict:
    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("shardkit", init_method=f"file://{store}", rank=rank, world_size=world)
    path = os.path.join(directory, "ckpt")
    model, optimizer = _model()
    _step(model, optimizer, rank, 0)
    first = _full_bytes(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd}, path)
    _step(model, optimizer, rank, 1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        checkpoint.save({"model": model_sd, "optim": optim_sd}, path)
        error = None
    except checkpoint.CheckpointSaveError as failure:
        error = str(failure)
    dist.barrier()
    left = sorted(os.listdir(directory))
    fresh, fresh_optimizer = _model()
    model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, path)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_bytes(fresh, fresh_optimizer)
    dist.destroy_process_group()
    return {"rank": rank, "error": error, "left": left, "first_loaded": loaded == first, "tensors": len(first)}


if __name__ == "__main__":
    # The ranks start from the harness's forkserver, which imports torch, dynamo and shardkit once for both (a
    # spawned rank imports them itself: ~7 CPU-s each); the parent prints their lines, or their tracebacks and fails.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python: support.harness
    from support import harness

    harness.script_ranks(rank_main, 2, sys.argv[1], timeout=150)

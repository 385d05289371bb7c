"""Run by test_checkpoint_integrity.py inside a mount namespace where DIR is a small tmpfs (room for one
checkpoint of this model, not two): two ranks save a checkpoint into DIR/ckpt, train on, and save again over it,
which runs out of room. Prints one JSON line per rank: the second save's error, whether the first checkpoint
then loads with exactly its values, and what is left in DIR.

    python checkpoint_disk_full_script.py DIR
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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


def rank_main(rank: int, world: int, store: str, directory: str) -> None:
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
    line = json.dumps({"rank": rank, "error": error, "left": left, "first_loaded": loaded == first,
                       "tensors": len(first)})
    sys.stdout.write(line + "\n")  # one write under PIPE_BUF: the ranks' lines never interleave
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(2, tempfile.mkdtemp() + "/store", sys.argv[1]), nprocs=2)
    sys.exit(0)

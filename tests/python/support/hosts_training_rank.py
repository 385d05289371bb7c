"""One rank of test_hostbed's training check on namespace hosts (2 hosts x 2 ranks over shaped links), started by
torchrun on each host:

    hosts_training_rank.py OUT_DIR

Trains support.quantized_training's lm() (a TinyLM), from the same initial weights on the same per-rank batches, with
shardkit's DDP, DDP + ZeRO-2, fully_shard (1-D mesh over both hosts) and HSDP (fully_shard on a (replicate across
hosts, shard inside a host) mesh), each against one process training the same model on the whole global batch (the
one-host answer; SGD, fp32): the largest relative difference of any parameter after STEPS steps. Then fully_shard
with comm=shardkit.Quantized(int8, int8) for QUANTIZED_STEPS steps beside the exact fully_shard (AdamW): both loss
curves, and the bytes each rank sent between hosts. Writes OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import copy
import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python, for `support`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import shardkit  # noqa: E402
from shardkit.backend import host_topology, inter_host_scheme  # noqa: E402
from support.fsdp_cases import TinyLM  # noqa: E402
from support.quantized_training import _fully_shard, _train, batch, lm, lm_loss  # noqa: E402

STEPS, QUANTIZED_STEPS, LR = 4, 50, 0.05


def _one_host_answer(world: int) -> TinyLM:
    """One process, the whole global batch (every rank's rows; the mean over equal batches is DDP's average)."""
    torch.manual_seed(0)
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        lm_loss(model, torch.cat([batch(r, step) for r in range(world)])).backward()
        opt.step()
        opt.zero_grad()
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _largest_difference(model: torch.nn.Module, answer: TinyLM) -> float:
    """max over parameters of max|got - want| / max|want| (after `model`'s training)."""
    want = dict(answer.named_parameters())
    got = _full(model)
    prefix = "module." if next(iter(got)).startswith("module.") else ""
    return max(((got[prefix + name] - value.detach()).abs().max() / value.detach().abs().max()).item()
               for name, value in want.items())


def _trained(rank: int, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
    opt = make_optimizer(model)
    for step in range(STEPS):
        lm_loss(model, batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    return model


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("shardkit", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    answer = _one_host_answer(world)
    torch.manual_seed(0)
    base = lm()
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=LR)  # noqa: E731
    differences = {
        "ddp": _largest_difference(_trained(rank, shardkit.DistributedDataParallel(copy.deepcopy(base)), sgd), answer),
        "zero2": _largest_difference(_trained(
            rank, shardkit.DistributedDataParallel(copy.deepcopy(base), zero_stage=2),
            lambda model: shardkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=LR)), answer),
        "fully_shard": _largest_difference(_trained(rank, _fully_shard(None)(copy.deepcopy(base)), sgd), answer),
    }
    hosts, per_host = host_topology().num_hosts, world // host_topology().num_hosts
    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    hsdp = copy.deepcopy(base)
    for layer in hsdp.layers:
        shardkit.fully_shard(layer, mesh=mesh)
    shardkit.fully_shard(hsdp, mesh=mesh)
    differences["hsdp"] = _largest_difference(_trained(rank, hsdp, sgd), answer)
    exact_losses, exact_bytes, _ = _train(rank, _fully_shard(None), QUANTIZED_STEPS)
    comm = shardkit.Quantized(weights="int8", grads="int8", block=256)
    losses, quantized_bytes, _ = _train(rank, _fully_shard(comm), QUANTIZED_STEPS)
    result = {"host_of": list(host_topology().host_of), "scheme": inter_host_scheme(), "differences": differences,
              "exact_losses": exact_losses, "quantized_losses": losses, "exact_bytes": exact_bytes,
              "quantized_bytes": quantized_bytes}
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

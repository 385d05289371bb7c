"""Training with shardkit.Quantized across (simulated) hosts, run inside the ranks: fully_shard and DDP, each beside
the same wrapper unquantized on the same batches."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardkit
from shardkit.backend import inter_host_bytes
from support.fsdp_cases import Block, TinyLM

VOCAB, D, SEQ = 600, 128, 8  # every unit's all-gather (and reduce-scatter) is 256 KiB or more: rails carry them all


def lm() -> TinyLM:
    return TinyLM(2, VOCAB, D)


def batch(rank: int, step: int) -> torch.Tensor:
    """A learnable stream: each row counts up from a random start (mod VOCAB), so the loss falls."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step)
    starts = torch.randint(0, VOCAB, (4, 1), generator=g)
    return (starts + torch.arange(SEQ + 1)) % VOCAB


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _mean_loss(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks (on the world group)."""
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    if getattr(model, "zero_stage", 0):
        return shardkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3)
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(rank: int, wrap, steps: int) -> tuple[list[float], int, nn.Module]:
    torch.manual_seed(0)
    model = wrap(lm())
    opt = _adamw(model)
    losses = []
    before = inter_host_bytes()
    for step in range(steps):
        loss = lm_loss(model, batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_loss(loss))
    return losses, inter_host_bytes() - before, model


def _fully_shard(comm):
    def wrap(model: TinyLM) -> TinyLM:
        for layer in model.layers:
            shardkit.fully_shard(layer, comm=comm)
        shardkit.fully_shard(model, comm=comm)
        return model
    return wrap


def _fsdp1(comm):
    return lambda model: shardkit.FullyShardedDataParallel(model, auto_wrap_policy={Block}, comm=comm)


def _ddp(comm, zero_stage: int = 0):
    return lambda model: shardkit.DistributedDataParallel(model, zero_stage=zero_stage, comm=comm)


FRONTS = {"fully_shard": _fully_shard, "fsdp1": _fsdp1, "ddp": _ddp, "zero1": lambda comm: _ddp(comm, 1),
          "zero2": lambda comm: _ddp(comm, 2)}


def train_quantized(rank: int, world: int, front: str, grads: str, steps: int) -> dict:
    """`front` (FRONTS) trained `steps` steps exact, then quantized (int8 weights where the front gathers
    parameters, `grads` gradients), from the same initial model on the same batches: both runs' mean losses, their
    bytes between hosts, and whether the quantized DDP's replicas agree bit for bit."""
    wrap = FRONTS[front]
    exact_losses, exact_bytes, _ = _train(rank, wrap(None), steps)
    weights = None if front in ("ddp", "zero1", "zero2") else "int8"
    comm = shardkit.Quantized(weights=weights, grads=grads, block=256)
    losses, quantized_bytes, model = _train(rank, wrap(comm), steps)
    replicas_agree = None
    if front in ("ddp", "zero1", "zero2"):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        replicas_agree = all(torch.equal(e, flat) for e in everyone)
    return {"exact": exact_losses, "quantized": losses, "exact_bytes": exact_bytes,
            "quantized_bytes": quantized_bytes, "replicas_agree": replicas_agree}


def refusals(rank: int, world: int) -> list[str]:
    """The cases comm=Quantized cannot serve, each refused with its message (on a 2-rank group of one host)."""
    from torch.distributed.device_mesh import DeviceMesh

    comm = shardkit.Quantized()
    messages = []
    for attempt in (
        lambda: shardkit.DistributedDataParallel(nn.Linear(4, 4), zero_stage=1, comm=comm),
        lambda: shardkit.FullyShardedDataParallel(nn.Linear(4, 4), comm=comm,
                                                  process_group=dist.new_group(backend="gloo")),
        lambda: shardkit.DistributedDataParallel(nn.Linear(4, 4), comm="int8"),
        lambda: shardkit.DistributedDataParallel(nn.Linear(4, 4), comm=comm).register_comm_hook(
            None, lambda state, bucket: None),
        lambda: shardkit.fully_shard(nn.Linear(4, 4), comm=comm,
                                     mesh=DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")),
    ):
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                attempt()
        except (ValueError, TypeError) as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardkit.fully_shard(nn.Linear(4, 4), comm=comm)
    messages.append("; ".join(str(w.message) for w in caught))
    return messages


def secondary_copy_in_host(rank: int, world: int, per_host: int) -> dict:
    """ZeRO++'s hpZ with FSDP2's own knob: fully_shard(reshard_after_forward=<ranks per host>) keeps the post-forward
    shard inside the host, so the backward's re-gather never crosses hosts. One step after a warm-up, quantized, with
    reshard_after_forward=True and with per_host: the bytes each phase sent between hosts."""
    comm = shardkit.Quantized(weights="int8", grads="int8", block=256)
    phases = {}
    for reshard in (True, per_host):
        torch.manual_seed(0)
        model = lm()
        for layer in model.layers:
            shardkit.fully_shard(layer, comm=comm, reshard_after_forward=reshard)
        shardkit.fully_shard(model, comm=comm, reshard_after_forward=reshard)
        for step in range(2):
            start = inter_host_bytes()
            loss = lm_loss(model, batch(rank, step))
            forward = inter_host_bytes() - start
            loss.backward()
            backward = inter_host_bytes() - start - forward
            model.zero_grad()
        phases[str(reshard)] = {"forward": forward, "backward": backward}
    return phases

"""One rank of benchmarks/hosts_train.py, started by torchrun: trains the benchmarks' GPT with FSDP2 (fully_shard per
block + root) in up to three configurations side by side, and reports step times, bytes between hosts and losses.

    _hosts_train_rank.py OUT.json --mode time --model '{"d_model": 512, ...}' --warmup 2 --rounds 5
    _hosts_train_rank.py OUT.json --mode loss --model '{...}' --steps 300 --keys b c --simulate-hosts 2

Configurations (each its own copy of the same seeded GPT, AdamW, fp32, FULL_SHARD: reshard_after_forward=True):

  a  torch FSDP2 (torch.distributed.fsdp.fully_shard)    on a gloo group over the same ranks   the anchor
  b  shardkit.fully_shard                                 on the shardkit default group, exact
  c  shardkit.fully_shard(comm=Quantized(int8, int8))     on the shardkit default group         int8 between hosts

``--mode time`` (on the shaped bed): the first round builds and steps each configuration in turn; after it, round r
steps every configuration once, starting at configuration r mod K; each step runs after a barrier and is followed by
one (outside its time), so the bytes counted around it are its own. Per step: this rank's seconds (forward + loss +
backward + optimizer.step + zero_grad), the bytes it sent to other hosts (shardkit.backend.inter_host_bytes of the
configuration's shard group; the anchor's gloo bytes are not counted there), and on each host's first rank the
bytes its link sent (/sys/class/net/$GLOO_SOCKET_IFNAME/statistics/tx_bytes: every rank of the host, with TCP/IP
headers; what gloo sends too). ``--mode loss``: ``--steps`` steps of each configuration, in turn; the loss of each.
``--simulate-hosts H`` gives rank r the host identity ``simulated-host{r * H // world}`` (SHARDKIT_HOST_ID) before
the backend starts: the same hierarchical engine, over loopback on one machine.

Data: every configuration gets the same batches (seeded per rank and step), of tokens that follow a fixed random
sparse chain: each token has ``FANOUT`` possible successors, one picked at random per position. A model can learn
it, down to a loss of ln(FANOUT) (uniform random tokens would leave the loss at ln(vocab), where a drift of the
quantized run could not show).

Rank 0 writes OUT.json: the host layout, the model, and per configuration its losses (mean over ranks, every step)
and, in time mode, per timed round the slowest rank's seconds, every rank's inter-host bytes and every host's link
bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import GPT, ModelConfig, n_params  # noqa: E402
from _harness import rank0_progress, rotated  # noqa: E402  (the benchmarks folder is not a package)

LR = 1e-3
FANOUT = 4  # successors per token in the synthetic chain: the loss can fall to ln(4) = 1.386


@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    label: str
    wrapper: str        # "torch" (torch's fully_shard) | "shardkit" (shardkit.fully_shard)
    backend: str        # "gloo" | "shardkit": the group the mesh spans
    int8: bool = False  # comm=shardkit.Quantized(weights="int8", grads="int8", block=256)


CONFIGS = {c.key: c for c in (
    Config("a", "torch FSDP2 / gloo", "torch", "gloo"),
    Config("b", "shardkit.fully_shard / shardkit, exact", "shardkit", "shardkit"),
    Config("c", "shardkit.fully_shard / shardkit, int8 between hosts", "shardkit", "shardkit", int8=True),
)}


def chain_batches(vocab: int, batch: int, seq: int, rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded batches of the synthetic chain (see the docstring): the same (rank, step) gives the same batch in every
    configuration and process; the chain itself is the same on every rank."""
    successors = torch.randint(0, vocab, (vocab, FANOUT), generator=torch.Generator().manual_seed(4321))
    batches = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1234 + 1000 * rank + step)
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        picks = torch.randint(0, FANOUT, (batch, seq), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = successors[tokens[:, t], picks[:, t]]
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


@dataclasses.dataclass
class Built:
    config: Config
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    group: Any  # the shard group (whose inter-host bytes are counted)


def build(config: Config, cfg: ModelConfig, meshes: dict[str, Any]) -> Built:
    """The same seeded GPT, fully_shard per block and at the root (reshard_after_forward: FULL_SHARD)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    torch.manual_seed(0)
    module = GPT(cfg)
    if config.wrapper == "torch":
        shard = torch_fully_shard
    else:
        comm = shardkit.Quantized(weights="int8", grads="int8", block=256) if config.int8 else None
        shard = functools.partial(shardkit.fully_shard, comm=comm)
    mesh = meshes[config.backend]
    for block in module.blocks:
        shard(block, mesh=mesh, reshard_after_forward=True)
    model = shard(module, mesh=mesh, reshard_after_forward=True)
    return Built(config, model, torch.optim.AdamW(model.parameters(), lr=LR), mesh.get_group())


def train_step(built: Built, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """forward + loss, backward, optimizer.step + zero_grad: (seconds, loss)."""
    tokens, targets = batch
    start = time.perf_counter()
    loss = F.cross_entropy(built.model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    built.optimizer.step()
    built.optimizer.zero_grad()
    return time.perf_counter() - start, loss.item()


def link_tx_bytes() -> int | None:
    """Bytes this host's link has sent (its interface is the one gloo binds to), or None where unknown."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        return int(Path(f"/sys/class/net/{name}/statistics/tx_bytes").read_text()) if name else None
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("time", "loss"), required=True)
    parser.add_argument("--model", type=json.loads, required=True, help="ModelConfig fields, JSON")
    parser.add_argument("--keys", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    parser.add_argument("--warmup", type=int, default=2, help="time mode: warm-up rounds (the first builds)")
    parser.add_argument("--rounds", type=int, default=5, help="time mode: timed rounds")
    parser.add_argument("--steps", type=int, default=300, help="loss mode: steps of each configuration")
    parser.add_argument("--simulate-hosts", type=int, default=0, help="H: ranks split into H simulated hosts")
    args = parser.parse_args()
    if args.simulate_hosts:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ["SHARDKIT_HOST_ID"] = f"simulated-host{rank * args.simulate_hosts // world}"

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import shardkit  # noqa: F401  (registers the backend)
    from shardkit.backend import host_topology, inter_host_bytes

    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("shardkit", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    meshes = {"shardkit": init_device_mesh("cpu", (world,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    cfg = ModelConfig(**args.model)
    configs = [CONFIGS[k] for k in args.keys]
    progress = rank0_progress(rank, prefix=f"[{args.mode}] ")
    first_of_host = host_topology(dist.group.WORLD).local_of[rank] == 0

    steps = args.warmup + args.rounds if args.mode == "time" else args.steps
    batches = chain_batches(cfg.vocab, cfg.batch, cfg.seq, rank, steps)
    built: dict[str, Built] = {}
    losses: dict[str, list[float]] = {c.key: [] for c in configs}
    seconds: dict[str, list[float]] = {c.key: [] for c in configs}       # this rank, per timed round
    sent: dict[str, list[int]] = {c.key: [] for c in configs}            # this rank's inter-host bytes, per round
    link: dict[str, list[int]] = {c.key: [] for c in configs}            # this host's link tx bytes (first rank)
    for r in range(steps):
        # Time mode rotates the order per round; loss mode keeps it (the losses do not depend on it).
        for config in rotated(configs, r) if args.mode == "time" else configs:
            if config.key not in built:
                built[config.key] = build(config, cfg, meshes)
            b = built[config.key]
            dist.barrier()
            counted_before = inter_host_bytes(b.group) if config.backend == "shardkit" else 0
            link_before = link_tx_bytes() if first_of_host else None
            step_s, loss = train_step(b, batches[r])
            dist.barrier()  # every rank's bytes of this step have left before the counters are read
            losses[config.key].append(loss)
            if args.mode == "time" and r >= args.warmup:
                seconds[config.key].append(step_s)
                sent[config.key].append(inter_host_bytes(b.group) - counted_before
                                        if config.backend == "shardkit" else -1)
                link_after = link_tx_bytes() if first_of_host else None
                link[config.key].append(-1 if link_before is None or link_after is None else link_after - link_before)
        if args.mode == "time" or (r + 1) % 25 == 0 or r + 1 == steps:
            progress(f"step {r + 1}/{steps}" + (" (warm-up)" if args.mode == "time" and r < args.warmup else "")
                     + "  " + "  ".join(f"{k} {losses[k][-1]:.4f}" for k in losses))

    # Everything per rank to rank 0 (small: a few numbers per step).
    mine = {"losses": losses, "seconds": seconds, "sent": sent, "link": link, "first_of_host": first_of_host}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=gloo)
    if rank == 0:
        host_of = list(host_topology(dist.group.WORLD).host_of)
        result: dict[str, Any] = {
            "mode": args.mode, "world": world, "host_of": host_of, "model": dataclasses.asdict(cfg),
            "n_params": n_params(cfg), "lr": LR, "fanout": FANOUT, "warmup": args.warmup, "rounds": args.rounds,
            "steps": steps, "configs": {c.key: dataclasses.asdict(c) for c in configs}}
        for c in configs:
            k = c.key
            rows = {"loss": [sum(e["losses"][k][i] for e in everyone) / world for i in range(steps)]}
            if args.mode == "time":
                rows["step_s"] = [max(e["seconds"][k][i] for e in everyone) for i in range(args.rounds)]
                rows["inter_host_bytes_by_rank"] = [[e["sent"][k][i] for e in everyone] for i in range(args.rounds)]
                rows["link_tx_bytes_by_host"] = [[e["link"][k][i] for e in everyone if e["first_of_host"]]
                                                 for i in range(args.rounds)]
            result[k] = rows
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

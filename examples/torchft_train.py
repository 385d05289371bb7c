"""Train a small GPT through a death: one replica group of a torchft job, shardkit inside it (issue 40).

torchft (``pip install torchft``) keeps a job training when a replica group dies: a Lighthouse forms a quorum of the
groups alive at each step, the survivors finish the step without the dead group (its gradient missing from the
average), and a restarted group recovers the model and optimizer live from a healthy peer before it trains again.
This script is one replica group: run one per group, each under its own ``torchrun``, all pointed at one lighthouse::

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --heartbeat_timeout_ms 1000 &
    export TORCHFT_LIGHTHOUSE=http://$(hostname):29510
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/torchft_train.py --replica-id 0 --steps 200 &
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/torchft_train.py --replica-id 1 --steps 200

Fronts (``--front``): ``torchft_ddp`` is torchft's own DistributedDataParallel (torch's DDP whose comm hook is the
Manager's allreduce; replica groups of one rank); ``ddp`` is ``shardkit.DistributedDataParallel`` with a comm hook
that averages each bucket inside the replica group on its shardkit group (when it has several ranks) and then
across the groups through the Manager; ``fully_shard`` is HSDP: ``shardkit.fully_shard`` on each block and the
root over the group's ranks, each unit's reduce-scatter output then averaged across the groups through the Manager
(FSDP2's all-reduce hook). The cross-group process group (``--ft-pg``):
``shardkit.integrations.torchft.ProcessGroupShardkit`` (the default: shared memory between the groups on one host),
or torchft's ``ProcessGroupGloo``. Inside a group the ranks use ``dist.init_process_group("shardkit")``. A healing
group receives the model and optimizer through shardkit's ChecksummedTransport (``--transport checksummed``, the
default: over the cross-group process group, every tensor's CRC32C checked on receipt, nothing unpickled) or
torchft's default HTTPTransport (``--transport http``; it reads what the peer sends with ``weights_only=False``).

What the Manager decides, per step: ``optimizer.zero_grad()`` (torchft's Optimizer wrapper) asks the lighthouse for
the quorum; each bucket's gradient is summed over the participating groups and divided by their number (a group
that is healing contributes zeros and is not counted); ``optimizer.step()`` steps only when the whole group agrees
the step went through (``should_commit``). A step that failed (a peer died in its allreduce) is not committed and is
tried again, on the same batch: the batch of step ``s`` is drawn from its own seed, ``1000 * s`` plus the rank's
index among all ranks of the job, so a retried step, and a reference run, see the same tokens.

``--records DIR`` writes, per rank, one JSON line per step attempt (``DIR/replica<R>.rank<G>.jsonl``, appended to
by a restarted process): the step, the loss, whether it was committed, how many groups took part and whether this
one did, its start, quorum and end times, the seconds it waited on the allreduce across the groups
(``cross_group_s``); and at the end ``DIR/replica<R>.rank<G>.final.pt``: the step reached, a SHA-256 of the
parameters, the parameters.
``--kill-at-step K --kill-marker FILE`` (for tests) makes the process SIGKILL itself in the backward of step K, once
(FILE records when; a restart finds it and trains on; ``--kill-rank``: which rank of the group).
``--ready-dir DIR --replicas N`` makes the first start wait until N groups are up, so the first quorum holds them
all; ``--finish-together`` then trains past ``--steps`` until a step that all N groups took part in (so every
group ends on the same step, with the same weights).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardkit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import GPT, ModelConfig  # noqa: E402

FRONTS = ("torchft_ddp", "ddp", "fully_shard")
FT_PGS = ("gloo", "shardkit")
FT_COMMS = ("exact", "int8", "int4")
TRANSPORTS = ("http", "checksummed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--front", choices=FRONTS, default="ddp")
    p.add_argument("--ft-pg", choices=FT_PGS, default="shardkit", help="the process group across replica groups")
    p.add_argument("--ft-comm", choices=FT_COMMS, default="exact",
                   help="with --ft-pg shardkit: the bytes between hosts of the cross-group allreduce (int8, int4: "
                        "shardkit.Quantized; the groups' own collectives stay exact)")
    p.add_argument("--advertise-host", default=None,
                   help="the address the other replica groups reach this group's Manager at (default: this host's "
                        "name; give an address where host names do not resolve across hosts)")
    p.add_argument("--transport", choices=TRANSPORTS, default="checksummed",
                   help="how a healing group receives the state: torchft's HTTPTransport (it unpickles what the "
                        "peer sends), or shardkit's ChecksummedTransport over the cross-group process group")
    p.add_argument("--replica-id", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", "0")),
                   help="this replica group's number (default: $REPLICA_GROUP_ID, else 0)")
    p.add_argument("--lighthouse", default=None, help="the lighthouse's address (default: $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="torchft's min_replica_size: a step commits only with at least this many groups")
    p.add_argument("--steps", type=int, default=100, help="train until the committed step count reaches this")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds: the cross-group process group's and the Manager's timeout")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds to wait for a quorum")
    p.add_argument("--records", type=Path, default=None, help="write per-step records and the final weights here")
    p.add_argument("--kill-at-step", type=int, default=None, help="(tests) SIGKILL this process in step K's backward")
    p.add_argument("--kill-marker", type=Path, default=None,
                   help="(tests) with --kill-at-step: written just before the kill; when it exists, no kill")
    p.add_argument("--kill-rank", type=int, default=0, help="(tests) with --kill-at-step: which rank of the group")
    p.add_argument("--ready-dir", type=Path, default=None,
                   help="(tests) at the first start, wait until --replicas groups have written their file here")
    p.add_argument("--replicas", type=int, default=None, help="the number of replica groups in the job")
    p.add_argument("--min-step-seconds", type=float, default=0.0,
                   help="(tests) make each step last at least this long, as a real model's would (the survivors of a "
                        "tiny model otherwise spin through steps and starve a restarting group of CPU)")
    p.add_argument("--finish-together", action="store_true",
                   help="after --steps, train on until a step that all --replicas groups took part in")
    args = p.parse_args(argv)
    if (args.kill_at_step is None) != (args.kill_marker is None):
        p.error("--kill-at-step and --kill-marker go together")
    if args.ft_comm != "exact" and args.ft_pg != "shardkit":
        p.error(f"--ft-comm {args.ft_comm} needs --ft-pg shardkit (torchft's gloo group sends exact bytes)")
    if (args.ready_dir is not None or args.finish_together) and not args.replicas:
        p.error("--ready-dir and --finish-together need --replicas (the number of replica groups)")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq,
                       batch=args.batch)


def batch_for(cfg: ModelConfig, step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next tokens) of ``step`` for the job's rank ``shard`` (replica id * group size + group rank):
    counting sequences, a random start and stride per sequence, from the seed 1000 * step + shard."""
    g = torch.Generator().manual_seed(1000 * step + shard)
    start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=g)
    stride = torch.randint(1, 8, (cfg.batch, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return tokens[:, :-1], tokens[:, 1:]


def initial_model(cfg: ModelConfig) -> GPT:
    torch.manual_seed(0)  # the same initial model in every group, every start, and in a reference run
    return GPT(cfg)


def parameters_hash(params: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, p in params.items():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def join_replica_group(advertise_host: str) -> tuple[int, int, dist.TCPStore | None, str, int]:
    """Starts this group's own shardkit process group and a TCPStore for its Manager (hosted by group rank 0 on a
    free port, so a restarted group never reads a dead attempt's Manager address from torchrun's Store; the other
    groups reach it at ``advertise_host``). Returns (group rank, group size, the store on rank 0 (keep it alive) or
    None, the store's host, its port)."""
    if "MASTER_PORT" in os.environ:  # under torchrun
        dist.init_process_group("shardkit")
    else:  # a group of one rank started by hand (or by a test acting as its supervisor)
        dist.init_process_group("shardkit", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    store = None
    if rank == 0:
        store = dist.TCPStore(advertise_host, 0, is_master=True, wait_for_workers=False)
    # Rank 0's host name and port to every rank of the group, as tensors (no pickle).
    name = torch.zeros(256, dtype=torch.uint8)
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        encoded = advertise_host.encode()[:256]
        name[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        port[0] = store.port
    if world > 1:
        dist.broadcast(name, 0)
        dist.broadcast(port, 0)
    return rank, world, store, bytes(name[name != 0].tolist()).decode(), int(port[0])


def make_ft_pg(kind: str, comm: str, timeout: timedelta) -> Any:
    """The process group across replica groups: torchft's gloo one or shardkit's (shardkit.integrations.torchft),
    exact or with ``comm`` ("int8", "int4") bytes between hosts."""
    if kind == "gloo":
        from torchft.process_group import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)
    from shardkit.integrations.torchft import ProcessGroupShardkit

    quantized = None if comm == "exact" else shardkit.Quantized(weights=comm, grads=comm)
    return ProcessGroupShardkit(timeout=timeout, comm=quantized)


def make_transport(kind: str, pg: Any, timeout: timedelta) -> Any:
    """The Manager's checkpoint transport: shardkit's checksummed one over the cross-group process group, or None
    (torchft's default, HTTPTransport)."""
    if kind == "http":
        return None
    from shardkit.integrations.torchft import ChecksummedTransport

    return ChecksummedTransport(pg, timeout=timeout)


class CrossGroupClock:
    """The seconds a step spends waiting on the Manager's allreduce across the groups (the records'
    ``cross_group_s``): what the cross-group process group costs the step, since every front here waits for it in
    the backward before going on."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def allreduce(self, manager: Any, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        manager.allreduce(tensor).wait()
        self.seconds += time.perf_counter() - started

    def take(self) -> float:
        """The seconds since the last take, and start again from zero."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


CROSS_GROUP = CrossGroupClock()


def manager_allreduce_hook(manager, bucket):  # no annotations: torch DDP compares them as objects, these are strings
    """``(manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]``, the DDP comm hook under
    torchft: the bucket averaged inside the replica group (its shardkit group, when it has several ranks), then
    across the participating groups by the Manager (sum / participants; a healing group contributes zeros). A failed
    cross-group allreduce is swallowed by the Manager, which then refuses to commit the step, so the bucket's value
    does not matter then."""
    buffer = bucket.buffer()
    if dist.get_world_size() > 1:
        dist.all_reduce(buffer, op=dist.ReduceOp.AVG)
    CROSS_GROUP.allreduce(manager, buffer)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def fully_shard_across_groups(module: GPT, manager: Any) -> GPT:
    """HSDP with torchft as the replicate dimension: each block, then the root, sharded over the group's ranks by
    shardkit.fully_shard (its reduce-scatter averages inside the group), and every unit's reduce-scatter output
    averaged across the participating groups by the Manager (FSDP2's all-reduce hook)."""
    from torch.distributed.fsdp import FSDPModule

    for block in module.blocks:
        shardkit.fully_shard(block)
    shardkit.fully_shard(module)

    def across_groups(output: torch.Tensor) -> None:
        CROSS_GROUP.allreduce(manager, output)

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_all_reduce_hook(across_groups)
    return module


def local_shards(value: Any) -> Any:
    """``value`` (a state dict, nested) with each DTensor replaced by this rank's shard of it: what a peer group's rank
    of the same group rank holds too, sent as plain tensors (a transport need not know DTensors)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return type(value)((k, local_shards(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(local_shards(v) for v in value)
    return value


def load_local_shards(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The inverse of local_shards for fully_shard's model and AdamW: shards copied into the parameters' own, and
    the optimizer's per-parameter tensors (exp_avg, exp_avg_sq: the parameter's shape) made DTensors like their
    parameter before the optimizer loads them."""
    for name, param in module.state_dict().items():
        (param.to_local() if isinstance(param, DTensor) else param).copy_(state["model"][name])
    optim = state["optim"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in optim["state"].items():
        p = params[index]
        if isinstance(p, DTensor):
            for key, v in entries.items():
                if isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() > 0:
                    entries[key] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    optimizer.load_state_dict(optim)


def torchft_ddp(manager: Any, module: torch.nn.Module) -> torch.nn.Module:
    """torchft's DistributedDataParallel with its comm hook replaced by manager_allreduce_hook.

    Why: torchft 0.2.0's own hook (``torchft/ddp.py`` ``_comm_hook``) waits for the Manager's allreduce and then
    asserts that the work's future was set up (``assert fut._fut``); when the allreduce fails, as it does at once
    when a peer group dies in it (gloo: "Connection closed by peer"), ``_ManagedWork.wait`` reports the error to the
    Manager and returns before it sets the future up, so the assertion fails and takes the survivor down with it
    (seen here: the surviving group exited with ``AssertionError`` in ``_comm_hook``). The replacement waits the same
    way and returns a completed future of the bucket; a failed step is then refused by ``should_commit`` as torchft
    intends. Everything else is torchft's wrapper (a dummy process group for torch DDP's construction, buckets
    never rebuilt)."""
    from torchft.ddp import DistributedDataParallel

    class _DistributedDataParallel(DistributedDataParallel):
        _comm_hook = staticmethod(manager_allreduce_hook)

    return _DistributedDataParallel(manager, module)


def build(args: argparse.Namespace, cfg: ModelConfig, manager: Any, group_world: int):
    """(the wrapped model, its plain module)."""
    module = initial_model(cfg)
    if args.front == "fully_shard":
        model = fully_shard_across_groups(module, manager)
        return model, model
    if args.front == "torchft_ddp":
        if group_world > 1:
            raise NotImplementedError(f"--front torchft_ddp: torchft's DistributedDataParallel reduces across replica "
                                      f"groups only, so the {group_world} ranks of this group would drift apart; "
                                      "use --front ddp (shardkit's DDP averages inside the group first)")
        return torchft_ddp(manager, module), module
    model = shardkit.DistributedDataParallel(module)
    # The buckets stay as first laid out (no rebuild on the second iteration): a group that restarts is on its
    # first iteration while its peers are past their second, and every group must reduce the same buckets.
    model.load_bucket_layout(model.bucket_layout())
    model.register_comm_hook(manager, manager_allreduce_hook)
    return model, module


def wait_until_ready(ready_dir: Path, replica: int, replicas: int, deadline_s: float) -> None:
    ready_dir.mkdir(parents=True, exist_ok=True)
    (ready_dir / f"replica{replica}").touch()
    deadline = time.monotonic() + deadline_s
    while len(list(ready_dir.glob("replica*"))) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica group {replica}: only {sorted(p.name for p in ready_dir.glob('replica*'))} "
                               f"of {replicas} groups were ready in {ready_dir} after {deadline_s:.0f} s")
        time.sleep(0.05)


def arm_kill(output: torch.Tensor, marker: Path) -> None:
    """SIGKILLs this process when the backward starts (at the model's output: any front), mid-step, before this
    group's gradients reach the cross-group allreduce; ``marker`` records when."""

    def kill(grad: torch.Tensor) -> torch.Tensor:
        marker.write_text(json.dumps({"pid": os.getpid(), "t": time.time()}))
        with open(marker) as f:
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
        return grad

    output.register_hook(kill)


def process_start_time() -> float:
    """When this process started (wall clock, from /proc: before Python imported anything); now where /proc has
    no answer."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])  # field 22: since boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = process_start_time()
    from torchft import Manager, Optimizer

    group_rank, group_world, _store, store_host, store_port = join_replica_group(
        args.advertise_host or socket.gethostname())
    cfg = model_config(args)
    timeout = timedelta(seconds=args.timeout)
    model = module = optimizer = None

    def load_state_dict(state: dict[str, Any]) -> None:
        if args.front == "fully_shard":
            load_local_shards(module, optimizer.optim, state)
            return
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        return local_shards(state) if args.front == "fully_shard" else state

    ft_pg = make_ft_pg(args.ft_pg, args.ft_comm, timeout)
    manager = Manager(pg=ft_pg, checkpoint_transport=make_transport(args.transport, ft_pg, timeout),
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas, replica_id=f"replica_{args.replica_id}",
                      lighthouse_addr=args.lighthouse, store_addr=store_host, store_port=store_port,
                      hostname=store_host,
                      rank=group_rank, world_size=group_world, timeout=timeout,
                      quorum_timeout=timedelta(seconds=args.quorum_timeout), connect_timeout=timeout,
                      # Every group builds the same initial model (seed 0), so step 0 needs no copy from a peer; a
                      # group that starts later than step 0 still heals from one.
                      init_sync=False)
    model, module = build(args, cfg, manager, group_world)
    optimizer = Optimizer(manager, torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.1))
    shard = args.replica_id * group_world + group_rank
    records = None
    if args.records is not None:
        args.records.mkdir(parents=True, exist_ok=True)
        records = open(args.records / f"replica{args.replica_id}.rank{group_rank}.jsonl", "a")
        records.write(json.dumps({"event": "start", "pid": os.getpid(), "t": started}) + "\n")
        records.flush()
    if args.ready_dir is not None:
        wait_until_ready(args.ready_dir, args.replica_id, args.replicas, args.quorum_timeout)
    if group_rank == 0:
        print(f"replica group {args.replica_id}: {group_world} rank(s), front {args.front}, cross-group pg "
              f"{args.ft_pg}, GPT of {sum(p.numel() for p in module.parameters()):,} parameters", flush=True)
    while True:
        t0 = time.time()
        CROSS_GROUP.take()
        optimizer.zero_grad()  # starts this step's quorum (torchft: it may heal this group from a peer)
        # The step this attempt trains: a healing group learns it from the quorum (its peers' step), so wait for it
        # here rather than at the first allreduce.
        manager.wait_quorum()
        t_quorum = time.time()
        step = manager.current_step()
        tokens, targets = batch_for(cfg, step, shard)
        logits = model(tokens)
        if args.kill_at_step == step and group_rank == args.kill_rank and not args.kill_marker.exists():
            arm_kill(logits, args.kill_marker)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()  # steps only if the step is committed
        time.sleep(max(0.0, t0 + args.min_step_seconds - time.time()))
        committed = manager.current_step() == step + 1
        participants, participating = manager.num_participants(), manager.is_participating()
        if records is not None:
            records.write(json.dumps({"step": step, "loss": loss.item(), "committed": committed,
                                      "participants": participants, "participating": participating,
                                      "t_start": t0, "t_quorum": t_quorum, "t_end": time.time(),
                                      "cross_group_s": CROSS_GROUP.take(),
                                      "pid": os.getpid()}) + "\n")
            records.flush()
        if committed and manager.current_step() >= args.steps and \
                (not args.finish_together or participants == args.replicas):
            break
    if records is not None:
        records.close()
        # fully_shard: every rank's shard, whole (a collective inside the group); the hash is then the model's.
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.named_parameters()}
        torch.save({"step": manager.current_step(), "hash": parameters_hash(full), "params": full},
                   args.records / f"replica{args.replica_id}.rank{group_rank}.final.pt")
    if group_rank == 0:
        print(f"replica group {args.replica_id}: trained to step {manager.current_step()}, loss {loss.item():.4f}",
              flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

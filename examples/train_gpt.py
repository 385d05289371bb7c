"""Train a small GPT with shardkit and let the memory math choose how to shard it.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --strategy auto --steps 100
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --strategy fully_shard --checkpoint ckpt
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --strategy zero2 --resume ckpt
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py --strategy ddp --steps 300 \
        --checkpoint-dir ckpts --checkpoint-every 50

Strategies: ``auto`` (shardkit.auto: the first of DDP, ZeRO-2, ZeRO-3 that fits the memory budget, ZeRO-3
being fully_shard), ``ddp``, ``zero1``, ``zero2`` (shardkit.DistributedDataParallel with zero_stage and
ZeroRedundancyOptimizer), ``fully_shard`` (shardkit.fully_shard on each block, then the model: torch FSDP2's
API, the recommended sharded front), ``fsdp`` (the FSDP1 front, FullyShardedDataParallel FULL_SHARD, one unit
per block), ``hsdp`` (its HYBRID_SHARD: sharded inside a host, replicated across hosts). ``--hook
powersgd|bf16`` compresses DDP's gradient allreduce. ``--precision bf16`` computes in bf16 (fully_shard's
MixedPrecisionPolicy, the FSDP1 front's MixedPrecision; autocast under DDP/ZeRO and auto).

Data: synthetic counting sequences (a random start and stride per sequence, seeded per rank and step: after a
few tokens the next one is predictable, so the loss falls), or ``--data FILE``: a local text file read as bytes
(vocabulary 256), each rank reading its own windows. Checkpoints (``--checkpoint DIR``, ``--resume DIR``) go through
shardkit.checkpoint (torch.distributed.checkpoint directories, committed whole and checksummed; verified when
resuming) and load at any world size and with any strategy. ``--checkpoint-dir DIR --checkpoint-every N``
(shardkit.checkpoint.Checkpointer): the run resumes from DIR's newest whole checkpoint when there is one, saves
every N steps and at the end (DIR/step-00000050, ...; the newest ``--checkpoint-keep`` kept; in the background
with ``--checkpoint-async``) with every rank's RNG states, and ``--steps`` is then the step the run ends at, so
the same command run again (by torchrun after a failure, or by hand) continues where the last checkpoint left
off: at the same world size, with the weights bit for bit those of the run never interrupted and the same loss at
every step (each step's batch is drawn from its own seed, 1000 * step + rank: the data position is the step).

Rank 0 shows its progress (``--progress``): with tqdm installed and stderr a terminal, a bar on stderr whose
postfix holds the loss, tokens/s and each rank's peak RSS; otherwise (or with ``--progress lines``) a line on
stdout every ``--log-every`` steps with the same. Every rank gathers the RSS on those steps, bar or not. With
``--json`` it prints one JSON line per step (``{"step", "loss", "tokens_per_s", "seconds"}``: what ``python -m
shardkit scale`` reads) instead of the lines. At the end it prints the memory table: per rank, the model-state
bytes actually held (parameters, gradients and optimizer state, each storage once) beside what
shardkit.estimate predicts for this strategy and for DDP, and the peak RSS; with ``--json`` also a final JSON
line ``{"summary": ...}`` (with ``losses``, rank 0's loss per step). ``--plot loss.png`` draws that loss per step (needs
matplotlib; without it the plot is skipped, with a line saying so). Needs torch and shardkit only; tqdm and
matplotlib are used when installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import shardkit
from shardkit import estimate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import GPT, Block, ModelConfig  # noqa: E402

STRATEGIES = ("auto", "ddp", "zero1", "zero2", "fully_shard", "fsdp", "hsdp")
# Which row of shardkit.estimate each strategy is (auto: the one it chose).
ESTIMATE_ROW = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fully_shard": "zero3", "fsdp": "zero3",
                "hsdp": "zero3", "zero3": "zero3"}
# The strategies whose wrapper is given a bf16 mixed-precision policy under --precision bf16 (the others autocast).
MIXED_PRECISION_WRAPPERS = ("fully_shard", "fsdp", "hsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--strategy", choices=STRATEGIES, default="auto")
    p.add_argument("--hook", choices=("none", "powersgd", "bf16"), default="none",
                   help="DDP gradient compression (ddp only)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512, help="synthetic data only (--data uses 256)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", type=Path, default=None, help="a local text file, read as bytes")
    p.add_argument("--memory-budget-gb", type=float, default=None, help="auto: the per-rank budget to fit")
    p.add_argument("--checkpoint", type=Path, default=None, help="save a DCP checkpoint here at the end")
    p.add_argument("--resume", type=Path, default=None, help="resume from a DCP checkpoint (any world size)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="resume from this directory's newest checkpoint, if any, and save into it (--steps is then "
                        "the step the run ends at)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="with --checkpoint-dir: save every N steps")
    p.add_argument("--checkpoint-keep", type=int, default=2, help="with --checkpoint-dir: keep the newest K")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="with --checkpoint-dir: save in the background (the next step runs while it writes)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", action="store_true", help="one JSON line per step on rank 0")
    p.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="rank 0's progress: a tqdm bar on stderr, a line every --log-every steps, or auto (default): "
                        "the bar when tqdm is installed and stderr is a terminal, else the lines")
    p.add_argument("--plot", type=Path, default=None,
                   help="write rank 0's loss per step to this PNG (needs matplotlib; skipped with a note without it)")
    args = p.parse_args(argv)
    has_tqdm = importlib.util.find_spec("tqdm") is not None
    if args.progress == "bar" and not has_tqdm:
        p.error("--progress bar needs tqdm, which is not installed (pip install tqdm); "
                "--progress lines prints a line every --log-every steps instead")
    if args.progress == "auto":
        args.progress = "bar" if has_tqdm and stderr_is_a_terminal() else "lines"
    if args.hook != "none" and args.strategy != "ddp":
        p.error(f"--hook {args.hook} compresses DDP's allreduce; it does not apply to --strategy {args.strategy}")
    if args.checkpoint_dir and args.resume:
        p.error("--checkpoint-dir resumes from its own newest checkpoint; --resume names another: give one")
    if (args.checkpoint_every is not None or args.checkpoint_async) and not args.checkpoint_dir:
        p.error("--checkpoint-every/--checkpoint-async save into --checkpoint-dir, which is missing")
    if (args.checkpoint or args.resume or args.checkpoint_dir) and importlib.util.find_spec("numpy") is None:
        p.error("--checkpoint/--resume/--checkpoint-dir need numpy: torch.distributed.checkpoint exchanges its plans "
                "with torch.distributed.gather_object, which converts through numpy (pip install numpy)")
    return args


def stderr_is_a_terminal() -> bool:
    """A terminal with a size: on one of width or height 0 (a pty nobody sized, as `script` makes) tqdm draws
    nothing."""
    try:
        return sys.stderr.isatty() and min(os.get_terminal_size(sys.stderr.fileno())) > 0
    except (OSError, ValueError, AttributeError):  # no fileno (a replaced sys.stderr), or not a terminal
        return False


def setup() -> torch.device:
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:shardkit,cuda:shardkit")
    else:
        device = torch.device("cpu")
        dist.init_process_group("shardkit")
    return device


def build(args: argparse.Namespace, cfg: ModelConfig, device: torch.device):
    """(model, optimizer, the estimate row it is) for ``args.strategy``."""
    torch.manual_seed(0)  # the same initial model on every rank and every run
    module = GPT(cfg).to(device)
    adamw = {"lr": args.lr, "weight_decay": 0.1}
    bf16 = args.precision == "bf16"
    mp = shardkit.fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    if args.strategy == "auto":
        model, optimizer = shardkit.auto(module, torch.optim.AdamW, memory_budget_gb=args.memory_budget_gb,
                                         auto_wrap_policy={Block}, **adamw)
        return model, optimizer, model.shardkit_plan.strategy
    if args.strategy == "fully_shard":  # each block a unit, then the root: the README's recipe
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
            else MixedPrecisionPolicy()
        for block in module.blocks:
            shardkit.fully_shard(block, mp_policy=policy)
        model = shardkit.fully_shard(module, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), **adamw), args.strategy
    if args.strategy in ("fsdp", "hsdp"):
        strategy = shardkit.fsdp.ShardingStrategy.FULL_SHARD if args.strategy == "fsdp" else \
            shardkit.fsdp.ShardingStrategy.HYBRID_SHARD
        model = shardkit.FullyShardedDataParallel(module, auto_wrap_policy={Block}, sharding_strategy=strategy,
                                                  mixed_precision=mp)
        return model, torch.optim.AdamW(model.parameters(), **adamw), args.strategy
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}[args.strategy]
    model = shardkit.DistributedDataParallel(module, zero_stage=stage)
    if args.hook == "powersgd":
        state = shardkit.hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        model.register_comm_hook(state, shardkit.hooks.powerSGD_hook)
    elif args.hook == "bf16":
        model.register_comm_hook(None, shardkit.hooks.bf16_compress_hook)
    if stage == 0:
        return model, torch.optim.AdamW(model.parameters(), **adamw), args.strategy
    return model, shardkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw), args.strategy


def batches(args: argparse.Namespace, cfg: ModelConfig, rank: int, world: int, device: torch.device):
    """(tokens, next tokens) for step s: seeded synthetic tokens, or windows of the --data file's bytes."""
    text = None
    if args.data is not None:
        text = torch.frombuffer(bytearray(args.data.read_bytes()), dtype=torch.uint8).long()
        if text.numel() <= cfg.seq + 1:
            raise SystemExit(f"--data {args.data}: {text.numel()} bytes, need more than {cfg.seq + 1}")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        if text is None:  # counting sequences: a random start and stride per sequence, so there is a rule to learn
            start = torch.randint(0, cfg.vocab, (args.batch, 1), generator=g)
            stride = torch.randint(1, 8, (args.batch, 1), generator=g)
            tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
        else:
            starts = torch.randint(0, text.numel() - cfg.seq - 1, (args.batch,), generator=g)
            tokens = torch.stack([text[s:s + cfg.seq + 1] for s in starts.tolist()])
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]

    return batch


def state_bytes(model, optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds, each storage counted once
    (a view of a flat buffer counts the buffer)."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += getattr(model, "gradient_shards", [])  # ZeRO-2 keeps gradients here, not in .grad
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):  # fully_shard's parameters, gradients and optimizer state: this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def gather_ints(values: list[int], world: int) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), by rank. A collective: all ranks call it together.

    A tensor all-gather, not all_gather_object: torch's object collectives convert through numpy. (torch 2.13
    renamed all_gather_into_tensor to all_gather_single.)"""
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = torch.empty(len(values) * world, dtype=torch.int64)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, mine)
    return gathered.view(world, len(values)).tolist()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Progress:
    """What rank 0 shows while training: a tqdm bar on stderr (``--progress bar``), its postfix the loss,
    tokens/s and each rank's peak RSS; or (``lines``) a line on stdout with the same on the steps that carry
    the RSS; with ``--json`` a JSON line per step on stdout instead of those lines (beside the bar, if any)."""

    def __init__(self, args: argparse.Namespace, desc: str) -> None:
        self.json = args.json
        self.bar = None
        if args.progress == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=args.steps, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
        self.rss = "?"

    def step(self, step: int, loss: float, tokens_per_s: float, seconds: float, rss: list[int] | None) -> None:
        """``rss``: each rank's peak RSS in bytes on the steps where the ranks gathered it, else None."""
        if rss is not None:  # "312 MiB", or per rank "312/310 MiB (ranks 0/1)"
            self.rss = "/".join(f"{b / (1 << 20):.0f}" for b in rss) + " MiB" + \
                (f" (ranks {'/'.join(map(str, range(len(rss))))})" if len(rss) > 1 else "")
        if self.json:
            self._print(json.dumps({"step": step, "loss": round(loss, 5), "seconds": round(seconds, 6),
                                    "tokens_per_s": round(tokens_per_s, 1)}))
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s, rss {self.rss}", refresh=False)
            self.bar.update(1)
        elif rss is not None and not self.json:
            self._print(f"step {step:5d}  loss {loss:.4f}  {tokens_per_s:9.0f} tokens/s  rss {self.rss}")

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)  # above the bar, not through it
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(path: Path, losses: list[float], first: int, title: str) -> str:
    """Rank 0's loss per step as a PNG (matplotlib, Agg backend); returns the line to print."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: skipped, matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(first, first + len(losses)), losses, linewidth=1)
    ax.set(xlabel="step", ylabel="loss (rank 0's batches)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return f"wrote {path} (loss per step)"


def save(path: Path, model, optimizer, step: int) -> None:
    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd, "step": step}, path)


def resume(path: Path, model, optimizer) -> int:
    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    checkpoint.load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(vocab=256 if args.data else args.vocab, d_model=args.d_model, heads=args.heads,
                      layers=args.layers, seq=args.seq, batch=args.batch)
    model, optimizer, row = build(args, cfg, device)
    psi = sum(p.numel() for p in GPT(cfg).parameters())
    checkpointer, state = None, {"model": model, "optim": optimizer}
    if args.checkpoint_dir:
        from shardkit.checkpoint import Checkpointer

        checkpointer = Checkpointer(args.checkpoint_dir, every=args.checkpoint_every, keep=args.checkpoint_keep,
                                    async_save=args.checkpoint_async)
        first = checkpointer.load_latest(state) or 0
        args.steps = max(0, args.steps - first)  # --steps is where the run ends
        if not args.steps:
            if rank == 0:
                print(f"{args.checkpoint_dir}: its newest checkpoint is of step {first}: nothing left to train",
                      flush=True)
            dist.destroy_process_group()
            return 0
    else:
        first = resume(args.resume, model, optimizer) if args.resume else 0
    batch = batches(args, cfg, rank, world, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" and \
        args.strategy not in MIXED_PRECISION_WRAPPERS else contextlib.nullcontext()
    if rank == 0:
        chosen = f" -> {row} ({model.shardkit_plan.front})" if args.strategy == "auto" else ""
        print(f"shardkit {shardkit.__version__}: GPT of {psi:,} parameters, {world} ranks on {device.type}, "
              f"strategy {args.strategy}{chosen}, {args.precision}"
              f"{f', hook {args.hook}' if args.hook != 'none' else ''}"
              f"{f', resumed at step {first}' if first else ''}", flush=True)
    losses, held, tokens_per_step = [], 0, args.batch * cfg.seq * world
    progress = Progress(args, desc=row) if rank == 0 else None
    last = first + args.steps - 1
    start = time.perf_counter()
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        tokens, targets = batch(step)
        with autocast:
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        if step == first:  # after the first step every state exists, and the sizes do not change after it
            held = state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if checkpointer is not None:
            checkpointer.save_if_due(step + 1, state)  # the checkpoint of step s resumes at step s
        loss_value = loss.item()
        losses.append(loss_value)
        seconds = time.perf_counter() - t0
        # A collective, so on the same steps on every rank whatever rank 0 shows (bar, lines or JSON).
        rss = [r for r, in gather_ints([peak_rss_bytes()], world)] \
            if step % args.log_every == 0 or step == last else None
        if progress is not None:
            progress.step(step, loss_value, tokens_per_step / seconds, seconds, rss)
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    if args.checkpoint:
        save(args.checkpoint, model, optimizer, first + args.steps)
    if checkpointer is not None:
        if checkpointer.last_step != first + args.steps:  # the end, unless the loop just saved it
            checkpointer.save(first + args.steps, state)
        checkpointer.close()
    if rank == 0 and args.plot:
        strategy = f"{args.strategy} -> {row}" if args.strategy == "auto" else args.strategy
        print(plot_losses(args.plot, losses, first, f"train_gpt.py: {strategy}, {world} rank{'s' * (world > 1)}, "
                                                    f"GPT of {psi / 1e6:.2f}M parameters"), flush=True)
    report(rank, world, psi, row, args, held, losses, elapsed, tokens_per_step, first)
    dist.destroy_process_group()
    return 0


def report(rank: int, world: int, psi: int, row: str, args: argparse.Namespace, held: int, losses: list[float],
           elapsed: float, tokens_per_step: int, first: int) -> None:
    """Rank 0 prints each rank's measured model-state bytes and peak RSS beside the estimate's."""
    everyone = [tuple(pair) for pair in gather_ints([held, peak_rss_bytes()], world)]
    if rank != 0:
        return
    # The parameters, gradients and AdamW state stay fp32 in every mode here (bf16 is compute only: FSDP's
    # MixedPrecision, autocast): 16 bytes per parameter unsharded.
    rows = estimate.model_states(psi, world, "fp32", "adam", master_weights=False)
    chosen = rows[ESTIMATE_ROW.get(row, row)]
    predicted = chosen.weights_bytes + chosen.grads_bytes + chosen.optimizer_bytes
    ddp = rows["ddp"].weights_bytes + rows["ddp"].grads_bytes + rows["ddp"].optimizer_bytes
    mib = 1 << 20
    print(f"\nmodel states per rank ({chosen.name}; estimate = shardkit.estimate, fp32 AdamW, 16 bytes/param "
          f"unsharded):")
    print(f"{'rank':>4}  {'held MiB':>9}  {'estimate MiB':>12}  {'held/estimate':>13}  {'DDP MiB':>8}  "
          f"{'peak RSS MiB':>12}")
    for r, (h, rss) in enumerate(everyone):
        print(f"{r:>4}  {h / mib:9.2f}  {predicted / mib:12.2f}  {h / predicted:13.3f}  {ddp / mib:8.2f}  "
              f"{rss / mib:12.0f}")
    steps = len(losses)
    print(f"{steps} steps in {elapsed:.1f} s: {steps * tokens_per_step / elapsed:,.0f} tokens/s; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if not args.json:
        return
    print(json.dumps({"summary": {"strategy": args.strategy, "row": row, "world": world, "params": psi,
                                  "held_bytes": [h for h, _ in everyone], "estimate_bytes": predicted,
                                  "ddp_bytes": ddp, "peak_rss_bytes": [rss for _, rss in everyone],
                                  "tokens_per_s": steps * tokens_per_step / elapsed,
                                  "threads": torch.get_num_threads(),
                                  "first_loss": losses[0], "last_loss": losses[-1],
                                  "first_step": first, "losses": [round(x, 5) for x in losses]}}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

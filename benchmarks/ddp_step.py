"""DDP training step: shardkit DDP vs torch DDP, on the shardkit backend and on gloo, plus ZeRO — one job.

    python benchmarks/ddp_step.py                 # world 2, ~21M-parameter transformer, 2–3 minutes
    python benchmarks/ddp_step.py --rounds 20     # more timed steps per configuration
    python benchmarks/ddp_step.py --no-rss        # skip the fresh-process RSS probes

One job of spawned ranks whose default group is shardkit and which also holds a gloo group over the same
ranks. Every configuration below wraps its own copy of the same model (same seed, same per-rank synthetic
token batches) and trains it with AdamW:

  a  torch DDP     on gloo       the anchor of the "≤ 0.7×" target
  b  torch DDP     on shardkit   the anchor of the "≤ 1.0×" target (same backend)
  c  shardkit DDP  on shardkit   what shardkit offers
  d  shardkit DDP  on gloo       shardkit's reducer alone, on torch's transport
  e  shardkit DDP  zero_stage=1  (+ shardkit.ZeroRedundancyOptimizer when it exists, else AdamW)
  f  shardkit DDP  zero_stage=2  (same)
  g  shardkit DDP  + shardkit.ZeroRedundancyOptimizer(optimizer_class=AdamW)
  h  torch DDP     + torch's ZeroRedundancyOptimizer on shardkit — a working ZeRO-1 as reference
  z  no DDP: the local step alone (each rank its own gradients) — the compute floor, no communication

A configuration whose constructor raises NotImplementedError (or whose class does not exist yet) is
recorded as "not implemented"; nothing else changes, so those rows fill in when the features land.

Timing. All configurations live side by side and are stepped in interleaved rounds — round r runs one
step of every configuration, starting at configuration r mod K (rotated so no configuration always
follows the same one) — so drift and noise on this shared machine hit all of them alike. Warm-up rounds
first (they include both DDPs' bucket rebuild on the second step), then the timed rounds. A step is
forward + loss + backward + optimizer.step + zero_grad, after a barrier; its time is the slowest rank's,
and the reported step time is the median over the timed rounds.

Memory, per rank, primary figure: bytes of the real tensors after one more (untimed) step, sampled after
backward and after optimizer.step, each storage counted once —
  parameters;
  gradients: the .grad tensors, and a ZeRO-2 optimizer's gradient shards (``gradient_shards``);
  DDP buckets: shardkit's reducer's flat buffers that exist after the step (``reducer.bucket_buffers()``;
    under zero_stage=2 they exist only during backward); torch DDP keeps its buckets
    internal: by its documented behaviour they hold a copy of every gradient unless
    gradient_as_bucket_view=True (not used here; torch's logger reports their sizes, checked against that);
  optimizer state: every tensor in optimizer.state, and in the inner optimizer of a ZeRO wrapper;
  optimizer's parameter copies: parameters the optimizers step that are not the model's (a ZeRO slice).
Secondary: RSS. RSS is process-wide and ru_maxrss only ever grows, so with all configurations in one
process it would measure the first one's model plus everything after; each configuration therefore also
runs alone in fresh ranks (glibc's mmap threshold fixed at 128 KiB, so freed tensors leave the RSS; a
miniature model stepped once first, so kernel code and one-off caches are resident) and reports the
growth over the process after backend setup: live (private + shared-memory RSS after backward) and peak
(ru_maxrss, which includes activations and transient buffers).

Correctness: after the same steps every DDP configuration must hold the same parameters as (a) (allclose)
and every rank the same as rank 0; a benchmark of wrong results is worthless.

Communication floor. For (c) and (i), after the timed rounds, the parts of DDP's communication are timed
alone on each configuration's own buckets, both ranks at once: copying every gradient into its bucket,
the buckets' allreduces, and (c) the copy back into .grad (see FLOOR_PARTS). With one compute thread per rank
and as many ranks as cores, no core idles during backward, so none of this hides behind it: the sum is the
least overhead over (z) this machine allows the configuration, printed beside its measured overhead.

Results: ``benchmarks/results/ddp_step.{json,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import (  # noqa: E402
    MiB,
    format_table,
    live_rss_bytes,
    mib,
    peak_rss_bytes,
    plot_bar_panels,
    return_large_frees_to_os,
    synthetic_token_batches,
    unique_storage_bytes,
)
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    RunConfig,
    agree_max,
    agree_max_rows,
    agree_outcome,
    announce,
    describe_paired,
    init_groups,
    interleaved_rounds,
    launch_ranks,
    load_note,
    machine_info,
    quartiles,
    rank0_progress,
    round_ratios,
    row_ratio,
    utc_now,
    write_json,
    wrote,
)

MEMORY_FIELDS = ("params", "grads", "ddp_buffers", "opt_state", "opt_params")


# --- the model and its data --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 8192
    d_model: int = 512
    heads: int = 8
    ffn: int = 2048
    layers: int = 4
    seq: int = 64
    batch: int = 4          # sequences per rank per step


class TinyLM(nn.Module):
    """Token + position embeddings, post-norm TransformerEncoder, final LayerNorm, untied LM head (~21M)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, cfg.ffn, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.encoder(self.tok(tokens) + self.pos(positions))))


def make_batches(cfg: ModelConfig, rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return synthetic_token_batches(cfg.vocab, cfg.batch, cfg.seq, rank, steps)


# --- configurations ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    ddp: str                 # "torch" | "shardkit" | "none"
    backend: str             # process group the DDP reduces on: "shardkit" | "gloo" | "-"
    zero_stage: int = 0      # shardkit DDP's zero_stage
    optimizer: str = "adamw"  # "adamw" | "shardkit_zero" | "shardkit_zero_or_adamw" | "torch_zero"
    reference: bool = False  # shown for context; no target, and (z) no parity
    bucket_view: bool = False  # gradient_as_bucket_view=True (shardkit's DDP on shardkit: zero-copy buckets)


VARIANTS: tuple[Variant, ...] = (
    Variant("a", "torch DDP / gloo", "torch", "gloo"),
    Variant("b", "torch DDP / shardkit", "torch", "shardkit"),
    Variant("c", "shardkit DDP / shardkit", "shardkit", "shardkit"),
    Variant("d", "shardkit DDP / gloo", "shardkit", "gloo"),
    Variant("e", "shardkit DDP zero_stage=1 / shardkit", "shardkit", "shardkit", 1, "shardkit_zero_or_adamw"),
    Variant("f", "shardkit DDP zero_stage=2 / shardkit", "shardkit", "shardkit", 2, "shardkit_zero_or_adamw"),
    Variant("g", "shardkit DDP + shardkit ZeRO optim / shardkit", "shardkit", "shardkit", 0, "shardkit_zero"),
    Variant("h", "torch DDP + torch ZeRO optim / shardkit", "torch", "shardkit", 0, "torch_zero", reference=True),
    Variant("i", "shardkit DDP zero-copy buckets / shardkit", "shardkit", "shardkit", bucket_view=True),
    Variant("z", "no DDP: local step only", "none", "-", reference=True),
)
LR = 1e-3


def variant(key: str) -> Variant:
    return next(v for v in VARIANTS if v.key == key)


def make_optimizer(variant: Variant, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, or a ZeRO optimizer sharding AdamW; raises NotImplementedError for a missing shardkit class."""
    import shardkit

    kind = variant.optimizer
    zero_cls = getattr(shardkit, "ZeroRedundancyOptimizer", None)
    if kind == "shardkit_zero_or_adamw":
        kind = "shardkit_zero" if zero_cls is not None else "adamw"
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR)
    if kind == "shardkit_zero":
        if zero_cls is None:
            raise NotImplementedError("shardkit.ZeroRedundancyOptimizer does not exist yet")
        return zero_cls(params, optimizer_class=torch.optim.AdamW, lr=LR)
    if kind == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
    raise ValueError(f"unknown optimizer kind {variant.optimizer!r}")


@dataclasses.dataclass
class Built:
    variant: Variant
    module: TinyLM
    model: nn.Module          # the DDP wrapper, or the module itself for (z)
    optimizer: torch.optim.Optimizer
    optimizer_name: str


def build(variant: Variant, cfg: ModelConfig, groups: dict[str, Any]) -> Built:
    """The same seeded model wrapped as ``variant`` says. Raises NotImplementedError for missing features."""
    import shardkit

    torch.manual_seed(0)
    module = TinyLM(cfg)
    group = groups.get(variant.backend)
    if variant.optimizer == "shardkit_zero" and not hasattr(shardkit, "ZeroRedundancyOptimizer"):
        raise NotImplementedError("shardkit.ZeroRedundancyOptimizer does not exist yet")
    if variant.ddp == "torch":
        model: nn.Module = TorchDDP(module, process_group=group)
    elif variant.ddp == "shardkit":
        model = shardkit.DistributedDataParallel(module, process_group=group, zero_stage=variant.zero_stage,
                                                 gradient_as_bucket_view=variant.bucket_view)
        if variant.bucket_view and not model.reducer.zero_copy():
            raise RuntimeError("gradient_as_bucket_view on a one-host shardkit group did not give zero-copy buckets")
    else:
        model = module
    optimizer = make_optimizer(variant, list(model.parameters()))
    inner = getattr(optimizer, "optim", None)
    name = type(optimizer).__module__.split(".")[0] + "." + type(optimizer).__name__
    if isinstance(inner, torch.optim.Optimizer):
        name += f"({type(inner).__name__})"
    return Built(variant, module, model, optimizer, name)


# --- one step, and what it holds ------------------------------------------------------------------------------

def train_step(built: Built, batch: tuple[torch.Tensor, torch.Tensor],
               after_backward: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """forward + loss, backward (DDP's reduction included), optimizer.step + zero_grad: seconds of each."""
    tokens, targets = batch
    t0 = time.perf_counter()
    logits = built.model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if after_backward is not None:
        after_backward()
    built.optimizer.step()
    if after_backward is not None:
        after_backward()
    built.optimizer.zero_grad()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def ddp_buffer_bytes(built: Built) -> tuple[int, str]:
    """Bytes of the DDP's gradient buckets that are not the .grad tensors themselves, and how they were found."""
    params = [p for p in built.module.parameters() if p.requires_grad]
    if built.variant.ddp == "none":
        return 0, "no DDP"
    if getattr(built.model, "gradient_as_bucket_view", False):
        return 0, "gradient_as_bucket_view: buckets are the .grad storages"
    if built.variant.ddp == "torch":
        documented = sum(p.numel() * p.element_size() for p in params)
        sizes = built.model._get_ddp_logging_data().get("bucket_sizes")
        if isinstance(sizes, str):  # the logger stores "a, b, c"
            sizes = [int(s) for s in sizes.split(",") if s.strip()]
        if sizes:
            logged = sum(int(s) for s in sizes)
            return logged, (f"torch DDP: its logger's bucket_sizes sum to {logged} B"
                            f"{' = ' if logged == documented else ' — DIFFERS from '}one copy of every gradient "
                            f"(documented behaviour)")
        return documented, "torch DDP documented: buckets hold a copy of every gradient"
    reducer = built.model.reducer
    buffers = getattr(reducer, "bucket_buffers", None)  # counted directly if the reducer ever exposes them
    if callable(buffers):
        return unique_storage_bytes(buffers()), "reducer.bucket_buffers()"
    by_index = [p for p in built.model.module.parameters() if p.requires_grad]
    layout = reducer.bucket_indices()
    total = sum(by_index[i].numel() * by_index[i].element_size() for bucket in layout for i in bucket)
    return total, f"reducer.bucket_indices(): {len(layout)} flat buckets sized by their members"


def _optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer and the one it wraps, if any (ZeRO wrappers hold theirs as ``.optim``)."""
    return [opt for opt in (optimizer, getattr(optimizer, "optim", None)) if isinstance(opt, torch.optim.Optimizer)]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the state of the optimizer and of the one it wraps."""
    return [v for opt in _optimizers(optimizer) for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def optimizer_param_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the optimizers step; those that are not the model's are the optimizer's own copies
    (e.g. a ZeRO optimizer stepping views of a buffer holding this rank's slice)."""
    return [p for opt in _optimizers(optimizer) for group in opt.param_groups for p in group["params"]]


def measure_memory(built: Built, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """One untimed step; tensor bytes sampled after backward and after optimizer.step (max of the two)."""
    params = [p for p in built.module.parameters()]
    seen = {"grads": 0, "opt_state": 0, "opt_params": 0}

    def sample() -> None:
        shards = list(getattr(built.optimizer, "gradient_shards", []))  # ZeRO-2 keeps gradients there
        now = {"grads": unique_storage_bytes([p.grad for p in params] + shards),
               "opt_state": unique_storage_bytes(optimizer_state_tensors(built.optimizer), exclude=params),
               "opt_params": unique_storage_bytes(optimizer_param_tensors(built.optimizer), exclude=params)}
        for field, value in now.items():
            seen[field] = max(seen[field], value)

    train_step(built, batch, after_backward=sample)
    buffers, how = ddp_buffer_bytes(built)
    out = {"params": unique_storage_bytes(params), "grads": seen["grads"], "ddp_buffers": buffers,
           "opt_state": seen["opt_state"], "opt_params": seen["opt_params"], "ddp_buffers_method": how}
    out["total"] = sum(out[f] for f in MEMORY_FIELDS)
    return out


# --- the ranks -------------------------------------------------------------------------------------------------

def setup_groups(rank: int, world: int, store: str, timeout_s: float) -> dict[str, Any]:
    return {"shardkit": None, "gloo": init_groups(rank, world, store, timeout_s)}


def try_build(variant: Variant, cfg: ModelConfig, groups: dict[str, Any]) -> Built | str:
    """The built configuration, or why not ("not implemented: ..."); all ranks must agree."""
    try:
        result: Built | str = build(variant, cfg, groups)
    except NotImplementedError as error:
        result = f"not implemented: {error}"
    return agree_outcome(result, variant.label, groups["gloo"])


def rank_main(rank: int, world: int, store: str, run: RunConfig) -> dict[str, Any]:
    groups = setup_groups(rank, world, store, run.pg_timeout_s)
    gloo = groups["gloo"]

    progress = rank0_progress(rank)

    variants = [v for v in VARIANTS if v.key in run.keys]
    built: dict[str, Built] = {}
    status: dict[str, str] = {}
    for v in variants:
        result = try_build(v, run.model, groups)
        if isinstance(result, str):
            status[v.key] = result
        else:
            built[v.key], status[v.key] = result, "ok"
    active = [v.key for v in variants if v.key in built]
    n_params = sum(p.numel() for p in TinyLM(run.model).parameters())
    progress(f"built {len(active)} of {len(variants)} configurations ({n_params:,} parameters each); "
             f"{run.warmup} warm-up + {run.rounds} timed rounds")

    batches = make_batches(run.model, rank, run.warmup + run.rounds + 1)
    # samples[key] = per timed round [forward, backward, optimizer, total seconds, minor page faults] on this rank
    samples: dict[str, list[list[float]]] = {k: [] for k in active}
    for r, order, timed in interleaved_rounds(active, run.warmup, run.rounds, progress):
        for key in order:
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            fwd, bwd, opt = train_step(built[key], batches[r])
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if timed:
                samples[key].append([fwd, bwd, opt, fwd + bwd + opt, float(faults)])

    memory = {key: measure_memory(built[key], batches[-1]) for key in active}

    # Parity: every DDP configuration against (a) here, and every rank against rank 0.
    flat = {k: torch.cat([p.detach().reshape(-1) for p in built[k].module.parameters()]) for k in active}
    # (a) is the anchor; without it (--only), the first DDP configuration that ran.
    anchor = next((v.key for v in sorted(variants, key=lambda v: v.key != "a") if v.key in flat and v.ddp != "none"),
                  None)
    parity: dict[str, dict[str, Any]] = {}
    for v in variants:
        if v.key not in flat or v.ddp == "none":
            continue
        mine = flat[v.key]
        rank0 = mine.clone()
        dist.broadcast(rank0, src=0, group=gloo)
        vs_ranks = (mine - rank0).abs().max().item()
        vs_anchor = (mine - flat[anchor]).abs().max().item() if anchor else float("nan")
        close = bool(torch.allclose(mine, flat[anchor], rtol=1e-5, atol=1e-6)) if anchor else False
        diffs = agree_max([vs_ranks, vs_anchor, 0.0 if close else 1.0], gloo)
        parity[v.key] = {"anchor": anchor, "max_abs_diff_vs_rank0": diffs[0], "max_abs_diff_vs_anchor": diffs[1],
                         "allclose_vs_anchor": diffs[2] == 0.0 and diffs[0] <= 1e-6,
                         "bitwise_vs_anchor": diffs[1] == 0.0 and diffs[0] == 0.0}

    # After the parity check: the profiled steps train (c), (i) and (z) further than the others.
    phases = profile_phases(built, batches, [k for k in PHASE_KEYS if k in built], gloo)
    floors = communication_floor(built, [k for k in FLOOR_KEYS if k in built], gloo)

    timing = agree_max_rows(samples, gloo)  # slowest rank per round and phase
    return {"status": status, "timing": timing if rank == 0 else None, "memory": memory, "parity": parity,
            "phases": phases, "floors": floors,
            "optimizer": {k: built[k].optimizer_name for k in active}, "n_params": n_params}


# Where DDP's time goes: a few steps of these configurations under torch.profiler, its CPU time per step summed by
# what shardkit's profiler labels (docs/profiling.md) and the aten ops DDP adds name.
PHASE_KEYS = ("c", "i", "z")
PHASES = {
    "aten::copy_": "copies (gradients into buckets, …)",
    "aten::div_": "divisions in place",
    "shardkit::allreduce": "allreduce, issue → done (worker)",
    "shardkit::ddp.finalize": "end of backward: waits + copy-back",
}
PHASE_STEPS = 3


def profile_phases(built: dict[str, Built], batches: list, keys: list[str], gloo: Any) -> dict[str, dict[str, float]]:
    """Milliseconds per step of each PHASES label (CPU time of its events, any thread) and the step's wall
    time, per configuration; the slowest rank's."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, dict[str, float]] = {}
    for key in keys:
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for step in range(PHASE_STEPS):
                dist.barrier()
                train_step(built[key], batches[step])
            wall = time.perf_counter() - t0
        totals = dict.fromkeys(PHASES, 0.0)
        for event in prof.events():
            if event.name in totals:
                totals[event.name] += event.cpu_time_total / 1e3 / PHASE_STEPS
        out[key] = {"step": wall * 1e3 / PHASE_STEPS, **totals}
    flat = agree_max([v for key in keys for v in out[key].values()], gloo)
    names = ["step", *PHASES]
    return {key: dict(zip(names, flat[i * len(names):(i + 1) * len(names)])) for i, key in enumerate(keys)}


# The CPU time a rank spends on (c)'s and (i)'s communication, each part alone. With as many ranks as cores
# and one compute thread per rank, no core is idle during backward, so nothing of it can hide behind the
# backward: the step's overhead over (z) cannot fall below the sum. Parts, in ms per step (best of FLOOR_REPS,
# slowest rank, both ranks at it at once, as in a step):
#   copy in    every gradient into its bucket. Both DDPs do it every step: optimizer.zero_grad() sets .grad to
#              None, so autograd hands over fresh gradients, which DDP copies into its buckets (for (i) the
#              buckets are in the group's shared memory; torch DDP with gradient_as_bucket_view does the same);
#   allreduce  the buckets, one allreduce each, as DDP issues them: for (i) in the shared buffer (zero-copy),
#              for (c) through the slots;
#   copy back  (c) only: the reduced buckets into .grad.
FLOOR_KEYS = ("c", "i")
FLOOR_PARTS = ("copy in", "allreduce", "copy back")
FLOOR_REPS = 7


def communication_floor(built: dict[str, Built], keys: list[str], gloo: Any) -> dict[str, dict[str, float]]:
    """ms per step of each FLOOR_PARTS part for the DDP configurations ``keys``, on their own bucket buffers."""
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        buckets = built[key].model.reducer.bucket_buffers()
        grads = [torch.ones_like(b) for b in buckets]  # stand-ins for autograd's gradients, pages touched
        parts: dict[str, list[float]] = {part: [] for part in FLOOR_PARTS}
        for _ in range(FLOOR_REPS):
            for part in FLOOR_PARTS:
                if part == "copy back" and key == "i":
                    parts[part].append(0.0)  # the gradients are views of the buckets: nothing to copy back
                    continue
                dist.barrier()
                start = time.perf_counter()
                for grad, bucket in zip(grads, buckets):
                    if part == "copy in":
                        bucket.copy_(grad)
                    elif part == "allreduce":
                        dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
                    else:
                        grad.copy_(bucket)
                parts[part].append(time.perf_counter() - start)
        out[key] = {part: min(times) * 1e3 for part, times in parts.items()}
        out[key]["bytes"] = float(sum(b.numel() * b.element_size() for b in buckets))
    names = [*FLOOR_PARTS, "bytes"]
    flat = agree_max([out[key][name] for key in keys for name in names], gloo)
    return {key: dict(zip(names, flat[i * len(names):(i + 1) * len(names)])) for i, key in enumerate(keys)}


def floor_ms(floor: dict[str, float]) -> float:
    return sum(floor[part] for part in FLOOR_PARTS)


def print_floors(floors: dict[str, dict[str, float]], rows: dict[str, dict[str, Any]]) -> None:
    if not floors:
        return
    table = []
    for key, floor in floors.items():
        excess = paired_excess(rows, key)
        table.append([f"({key}) {rows[key]['label']}", f"{floor['bytes'] / 2**20:.1f}",
                      *(f"{floor[part]:.1f}" for part in FLOOR_PARTS), f"{floor_ms(floor):.1f}",
                      "-" if excess is None else f"{excess * 1e3:+.1f}"])
    print(f"\n=== communication floor (ms per step of CPU time per rank, each part alone, best of {FLOOR_REPS}, "
          f"slowest rank): with one compute thread per rank and no idle core, none of it can hide behind the "
          f"backward, so the overhead over (z) cannot fall below the sum ===")
    print(format_table(["configuration", "MiB", *FLOOR_PARTS, "sum", "overhead over (z)"], table, left=1))


def print_phases(phases: dict[str, dict[str, float]]) -> None:
    if not phases:
        return
    keys = list(phases)
    rows = [["step (wall, under the profiler)", *(f"{phases[k]['step']:.0f}" for k in keys)]]
    rows += [[label, *(f"{phases[k][name]:.1f}" for k in keys)] for name, label in PHASES.items()]
    print(f"\n=== where the time goes (ms per step, {PHASE_STEPS} profiled steps, slowest rank; CPU time of the "
          f"events on any thread, so overlapping work counts in full) ===")
    print(format_table(["phase", *(f"({k})" for k in keys)], rows, left=1))


def rss_probe(rank: int, world: int, store: str, run: RunConfig, key: str) -> dict[str, Any]:
    """One configuration alone in fresh ranks: RSS growth over the process after backend setup.

    Before the baseline, a miniature of the model takes one AdamW step, so the kernels' code and their
    one-off caches are already resident. The live figure is private (anonymous) plus shared-memory RSS;
    file-backed pages (library code) are recorded apart. The peak (ru_maxrss) counts all kinds.
    """
    fixed_threshold = return_large_frees_to_os()  # allocations ≥ 128 KiB freed go back: RSS tracks live tensors
    groups = setup_groups(rank, world, store, run.pg_timeout_s)
    dist.barrier()
    dist.barrier(group=groups["gloo"])
    mini = ModelConfig(vocab=64, d_model=32, heads=8, ffn=64, layers=1, seq=8, batch=2)
    tiny = TinyLM(mini)
    train_step(Built(variant("z"), tiny, tiny, torch.optim.AdamW(tiny.parameters(), lr=LR), "AdamW"),
               make_batches(mini, rank, 1)[0])
    del tiny

    base, base_peak = live_rss_bytes(), peak_rss_bytes()
    built = build(variant(key), run.model, groups)
    batches = make_batches(run.model, rank, run.warmup + 1)
    for batch in batches[:-1]:
        train_step(built, batch)
    samples: list[dict[str, int]] = []
    train_step(built, batches[-1], after_backward=lambda: samples.append(live_rss_bytes()))
    grow = [{k: s[k] - base.get(k, 0) for k in s} for s in samples]
    return {"live_after_backward": grow[0]["live"], "live_after_step": grow[1]["live"],
            "file_after_step": grow[1].get("file"), "shmem_after_step": grow[1].get("shmem"),
            "peak": peak_rss_bytes() - base_peak, "baseline": base, "baseline_peak": base_peak,
            "mmap_threshold_fixed": fixed_threshold}


# --- reporting -------------------------------------------------------------------------------------------------

def per_rank(values: Sequence[float]) -> str:
    """One number when the ranks agree, else all of them."""
    return mib(values[0]) if len(set(values)) == 1 else " / ".join(mib(v) for v in values)


def summarize(results: list[dict[str, Any]], run: RunConfig) -> dict[str, dict[str, Any]]:
    """Per configuration: status, step time statistics and the memory of every rank."""
    head = results[0]
    rows: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        if v.key not in run.keys:
            continue
        row: dict[str, Any] = {"key": v.key, "label": v.label, "ddp": v.ddp, "backend": v.backend,
                               "zero_stage": v.zero_stage, "reference": v.reference, "status": head["status"][v.key]}
        if row["status"] == "ok":
            t = head["timing"][v.key]
            totals = [s[3] for s in t]
            p25, median, p75 = quartiles(totals)
            row.update({
                "optimizer": head["optimizer"][v.key],
                "step_s": median, "step_s_p25": p25, "step_s_p75": p75,
                "forward_s": statistics.median(s[0] for s in t), "backward_s": statistics.median(s[1] for s in t),
                "optimizer_s": statistics.median(s[2] for s in t), "step_s_samples": totals,
                "page_faults_per_step": statistics.median(s[4] for s in t),
                "memory_by_rank": [r["memory"][v.key] for r in results],
                "parity": head["parity"].get(v.key),
            })
        rows[v.key] = row
    return rows


def paired_ratios(rows: dict[str, dict[str, Any]], num: str, den: str) -> list[float] | None:
    """num/den of each round (the interleaving makes a round's steps comparable)."""
    if rows.get(num, {}).get("status") != "ok" or rows.get(den, {}).get("status") != "ok":
        return None
    return round_ratios(rows[num]["step_s_samples"], rows[den]["step_s_samples"])


def paired_excess(rows: dict[str, dict[str, Any]], key: str, base: str = "z") -> float | None:
    """Median over rounds of (key's step − base's step in the same round): what DDP adds to the local step."""
    if rows.get(key, {}).get("status") != "ok" or rows.get(base, {}).get("status") != "ok" or key == base:
        return None
    return statistics.median(x - y for x, y in zip(rows[key]["step_s_samples"], rows[base]["step_s_samples"]))


def print_tables(rows: dict[str, dict[str, Any]], rss: dict[str, list[dict[str, Any]]], run: RunConfig) -> None:
    timing_rows, memory_rows = [], []
    for key, row in rows.items():
        name = f"({key}) {row['label']}"
        if row["status"] != "ok":
            timing_rows.append([name, row["status"].split(":")[0]] + [""] * 9)
            memory_rows.append([name, row["status"].split(":")[0]] + [""] * 8)
            continue
        rb, ra, over = row_ratio(rows, key, "b"), row_ratio(rows, key, "a"), paired_excess(rows, key)
        parity = row["parity"]
        check = ("n/a" if parity is None else "bitwise" if parity["bitwise_vs_anchor"] else
                 "allclose" if parity["allclose_vs_anchor"] else "DIFFERS")
        timing_rows.append([name, "ok", f"{row['step_s'] * 1e3:.0f}", f"{row['step_s_p25'] * 1e3:.0f}–"
                            f"{row['step_s_p75'] * 1e3:.0f}", f"{row['forward_s'] * 1e3:.0f}",
                            f"{row['backward_s'] * 1e3:.0f}", f"{row['optimizer_s'] * 1e3:.0f}",
                            "-" if rb is None else f"{rb:.3f}×", "-" if ra is None else f"{ra:.3f}×",
                            "-" if over is None else f"{over * 1e3:+.0f}",
                            f"{row['page_faults_per_step'] * 4096 / MiB:.0f}"])
        mem = row["memory_by_rank"]
        probe = rss.get(key)
        memory_rows.append([name, check] + [per_rank([m[f] for m in mem]) for f in
                                            MEMORY_FIELDS + ("total",)]
                           + ([per_rank([p["live_after_backward"] for p in probe]),
                               per_rank([p["peak"] for p in probe])] if probe else ["-", "-"]))
    print(f"\n=== step time (ms): median of {run.rounds} interleaved rounds, slowest rank; phases are each "
          f"phase's median of the slowest rank ===")
    print(format_table(["configuration", "status", "step", "p25–p75", "fwd", "bwd+reduce", "opt+zero", "÷ (b)",
                        "÷ (a)", "− (z)", "faults MiB"], timing_rows, left=2))
    print("÷: ratio of medians; − (z): median over rounds of the step minus the local step (z) of the same round, "
          "i.e. what data parallelism adds to the compute; faults MiB: minor page faults per step × 4 KiB "
          "(memory freshly mapped and first touched each step; median, fuller rank)")
    print("\n=== memory per rank (MiB; tensors after one more step, each storage once; RSS from a fresh process "
          "per configuration) ===")
    print(format_table(["configuration", "parity vs anchor", "params", "grads", "DDP buckets", "opt state",
                        "opt param copy", "tensors total", "RSS live Δ", "RSS peak Δ"], memory_rows, left=2))
    print("opt param copy: parameter storage the optimizer steps that is not the model's (a ZeRO slice buffer); "
          "RSS live Δ: private + shared-memory RSS after backward minus the fresh process's after backend setup; "
          "RSS peak Δ: ru_maxrss growth (includes activations and transient buffers); per rank where they differ")


def check_targets(rows: dict[str, dict[str, Any]], world: int,
                  floors: dict[str, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, why_skip: str = "not measured", extra: str = "") -> None:
        status = "SKIP" if value is None else ("PASS" if value <= limit else "MISS")
        shown = why_skip if value is None else f"{value:.3f}× (limit {limit:.3g}×){extra}"
        checks.append({"target": name, "status": status, "value": value, "limit": limit})
        print(f"[{status}] {name}: {shown}")

    def status_of(key: str) -> str:
        return rows.get(key, {}).get("status", "not run")

    add("shardkit DDP / shardkit ≤ 1.0× torch DDP on the same backend (c ÷ b)", row_ratio(rows, "c", "b"), 1.0,
        extra=describe_paired(paired_ratios(rows, "c", "b"), "per-round ratio median"))
    add("shardkit DDP on shardkit ≤ 0.7× torch DDP + gloo (c ÷ a)", row_ratio(rows, "c", "a"), 0.7,
        extra=describe_paired(paired_ratios(rows, "c", "a"), "per-round ratio median"))
    for key in ("c", "i"):
        excess = paired_excess(rows, key)
        over_z = None if excess is None or rows["z"]["step_s"] <= 0 else 1 + excess / rows["z"]["step_s"]
        comm_floor = (floors or {}).get(key)
        print(f"[{'SKIP' if excess is None else 'PASS' if excess <= 0.015 else 'MISS'}] ({key}) DDP overhead "
              f"(step − local step (z), median of paired rounds) ≤ 15 ms: "
              + ("not measured" if excess is None else f"{excess * 1e3:+.1f} ms ({over_z:.3f}× of (z))")
              + ("" if comm_floor is None else f"; its communication floor here: {floor_ms(comm_floor):.1f} ms"))
        checks.append({"target": f"({key}) overhead over (z) <= 15 ms", "value": excess, "limit": 0.015,
                       "status": "SKIP" if excess is None else "PASS" if excess <= 0.015 else "MISS",
                       "communication_floor_s": None if comm_floor is None else floor_ms(comm_floor) / 1e3})
    floor = row_ratio(rows, "z", "a")
    if floor is not None:
        print(f"       floor: the local step alone (z, no communication at all) is {floor:.3f}× of (a), so no DDP "
              f"can beat that ratio on this model and machine")

    # ZeRO: against the unsharded amount, one gradient copy + (c)'s AdamW state (estimate.py's (g + o)·Ψ).
    def unsharded(rank: int) -> float | None:
        if status_of("c") != "ok":
            return None
        m = rows["c"]["memory_by_rank"][rank]
        return m["params"] + m["opt_state"]  # fp32 gradients are as large as the parameters

    def sharded_ratio(key: str, fields: tuple[str, ...], reference: Callable[[int], float | None]) -> float | None:
        if status_of(key) != "ok":
            return None
        values = []
        for rank, m in enumerate(rows[key]["memory_by_rank"]):
            ref = reference(rank)
            if ref is None:
                return None
            values.append(sum(m[f] for f in fields) / ref)
        return max(values)  # the fullest rank decides

    approx = 1.1 / world  # "≈ 1/N": within 10 %
    add(f"zero_stage 2: gradient (+ buckets) + optimizer (state + own param copies) bytes ≈ 1/N = {1 / world:.3g} of "
        f"one gradient copy + AdamW state (fullest rank)",
        sharded_ratio("f", ("grads", "ddp_buffers", "opt_state", "opt_params"), unsharded),
        approx, why_skip=status_of("f"))
    opt_c = ((lambda rank: rows["c"]["memory_by_rank"][rank]["opt_state"]) if status_of("c") == "ok"
             else (lambda r: None))
    add("(extra) zero_stage 1: optimizer-state bytes ≈ 1/N of (c)'s", sharded_ratio("e", ("opt_state",), opt_c),
        approx, why_skip=status_of("e"))
    add("(extra) shardkit.ZeroRedundancyOptimizer: optimizer-state bytes ≈ 1/N of (c)'s",
        sharded_ratio("g", ("opt_state",), opt_c), approx, why_skip=status_of("g"))
    add("(reference) torch ZeroRedundancyOptimizer: optimizer-state bytes ≈ 1/N of (c)'s",
        sharded_ratio("h", ("opt_state",), opt_c), approx, why_skip=status_of("h"))
    checked = [r for r in rows.values() if r["status"] == "ok" and r["parity"] is not None]
    bad = [f"({r['key']})" for r in checked if not r["parity"]["allclose_vs_anchor"]]
    worst = max((r["parity"]["max_abs_diff_vs_anchor"] for r in checked), default=0.0)
    status = "MISS" if bad else "PASS"
    anchor = checked[0]["parity"]["anchor"] if checked else "a"
    print(f"[{status}] same parameters after every step in all {len(checked)} DDP configurations as ({anchor}), on "
          f"every rank (allclose rtol 1e-5, atol 1e-6): max |Δ| {worst:.3g}"
          + (f"; differ: {' '.join(bad)}" if bad else ""))
    checks.append({"target": f"parity with ({anchor})", "status": status, "value": worst, "limit": None})
    return checks


def plot(rows: dict[str, dict[str, Any]], path: Path) -> Path | None:
    names = [f"({k}) {r['label']}" + ("" if r["status"] == "ok" else " [n/i]") for k, r in rows.items()]

    def field(name: str, scale: float) -> list[float]:
        return [max(m[name] for m in r["memory_by_rank"]) / scale if r["status"] == "ok" else float("nan")
                for r in rows.values()]

    step = [r["step_s"] * 1e3 if r["status"] == "ok" else float("nan") for r in rows.values()]
    return plot_bar_panels(path, {
        "step time": (names, {"median step": step}),
        "memory per rank (tensors, fullest rank)": (names, {
            "parameters": field("params", MiB), "gradients": field("grads", MiB),
            "DDP buckets": field("ddp_buffers", MiB), "optimizer state": field("opt_state", MiB),
            "optimizer's param copies": field("opt_params", MiB)}),
    }, ylabels={"step time": "ms (median, slowest rank)", "memory per rank (tensors, fullest rank)": "MiB"},
        suptitle="DDP step, world 2, ~21M-parameter transformer, AdamW (CPU, 1 thread per rank)")


# --- main ------------------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    configurations = "\n".join(f"  {v.key}  {v.label}" + ("  (reference: no target)" if v.reference else "")
                               for v in VARIANTS)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"configurations (DDP + optimizer / process group), by --only's letters:\n"
                                       f"{configurations}")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds (≥ 3: the bucket rebuild is in step 2)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (one step per configuration each)")
    p.add_argument("--batch", type=int, default=ModelConfig.batch, help="sequences per rank per step")
    p.add_argument("--layers", type=int, default=ModelConfig.layers)
    p.add_argument("--only", nargs="+", choices=[v.key for v in VARIANTS], default=None, metavar="LETTER",
                   help="run only these configurations, listed below (default: all)")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS probes")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for ddp_step.json/png")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warmup < 3 or args.rounds < 1:
        raise SystemExit("--warmup must be ≥ 3 and --rounds ≥ 1")
    started = time.monotonic()
    world = 2
    run = RunConfig(model=ModelConfig(batch=args.batch, layers=args.layers), warmup=args.warmup, rounds=args.rounds,
                    keys=tuple(args.only or [v.key for v in VARIANTS]))
    machine = machine_info()
    m = run.model
    announce("shardkit DDP step benchmark", machine, f"world {world}, 1 thread per rank")

    with ForeignLoad() as load:
        results = launch_ranks(rank_main, world, run, timeout=1200.0)
    train_s = time.monotonic() - started
    rows = summarize(results, run)
    n_params = results[0]["n_params"]
    print(f"model: TinyLM — embedding {m.vocab}×{m.d_model} + positions {m.seq}×{m.d_model} + {m.layers} × "
          f"TransformerEncoderLayer(d_model={m.d_model}, nhead={m.heads}, dim_feedforward={m.ffn}, dropout=0, "
          f"batch_first) + LayerNorm + untied LM head {m.d_model}→{m.vocab}: {n_params:,} parameters "
          f"({n_params * 4 / MiB:.1f} MiB fp32)")
    print(f"data: synthetic tokens, batch {m.batch} × seq {m.seq} per rank, seeded per rank and step; AdamW lr {LR}; "
          f"{run.warmup} warm-up + {run.rounds} timed rounds, each round one step of every configuration in "
          f"rotated order")
    if (note := load_note(load.cores, machine, "the timed job")):
        print(note)

    rss: dict[str, list[dict[str, Any]]] = {}
    if not args.no_rss:
        for key, row in rows.items():
            if row["status"] == "ok":
                print(f"RSS probe ({key}) …", file=sys.stderr, flush=True)
                rss[key] = launch_ranks(rss_probe, world, run, key, timeout=600.0)
                row["rss_by_rank"] = rss[key]

    print_tables(rows, rss, run)
    print_phases(results[0]["phases"])
    print_floors(results[0]["floors"], rows)
    first_ok = next((r for r in rows.values() if r["status"] == "ok" and r["ddp"] != "none"), None)
    if first_ok:
        print("DDP buckets: " + "; ".join(
            f"({r['key']}) {r['memory_by_rank'][0]['ddp_buffers_method']}" for r in rows.values()
            if r["status"] == "ok" and r["ddp"] != "none" and r["key"] in ("a", "c")))
    for row in rows.values():
        if row["status"] != "ok":
            print(f"({row['key']}) {row['status']}")

    print("\n=== targets ===")
    checks = check_targets(rows, world, results[0]["floors"])
    elapsed = time.monotonic() - started

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = write_json(args.out / "ddp_step.json", {
        "benchmark": "ddp_step",
        "machine": machine,
        "config": {"world": world, "model": dataclasses.asdict(run.model), "n_params": n_params, "lr": LR,
                   "optimizer": "AdamW", "warmup_rounds": run.warmup, "timed_rounds": run.rounds,
                   "order": "interleaved rounds, rotated start", "threads_per_rank": 1,
                   "timing": "barrier, then forward+loss+backward+optimizer.step+zero_grad; slowest rank per "
                             "step; median over rounds",
                   "memory": "tensor bytes per rank after one untimed step (storages once; torch DDP buckets from "
                             "its logger / documented copy of all grads); RSS deltas from fresh ranks per config"},
        "configurations": list(rows.values()),
        "phases_ms_per_step": results[0]["phases"],
        "communication_floor_ms_per_step": results[0]["floors"],
        "targets": checks,
        "foreign_load_cores": load.cores,
        "seconds": {"total": elapsed, "timed_job": train_s},
        "finished": utc_now(),
    })
    png_path = plot(rows, args.out / "ddp_step.png")
    print("\n" + wrote(json_path, png_path))
    print(f"total {elapsed:.0f} s (timed job {train_s:.0f} s, RSS probes {elapsed - train_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FSDP training step: shardkit FSDP vs torch FSDP2 and torch FSDP1, on gloo and on the shardkit backend.

    python benchmarks/fsdp_step.py               # world 2, ~30M-parameter GPT, fp32 then bf16
    python benchmarks/fsdp_step.py --quick       # tiny model, 2 steps: a smoke test (< 2 minutes)
    python benchmarks/fsdp_step.py --precision bf16 --only a b e --rounds 20
    python benchmarks/fsdp_step.py --world 4 --only a b e k   # writes fsdp_step_w4.*

One job of spawned ranks per precision; their default group is shardkit and they also hold a gloo group
over the same ranks. Every configuration wraps its own copy of the same seeded GPT (tied embedding / LM
head, pre-norm blocks of causal attention + MLP) and trains it with AdamW on the same synthetic tokens:

  a  torch FSDP2 (fully_shard per block + root, reshard_after_forward)  on gloo      anchor of "≤ 0.7×"
  b  torch FSDP2                                                        on shardkit  anchor of "≤ 0.9×"
  c  torch FSDP1 FULL_SHARD (use_orig_params, per-block wrap)           on gloo
  d  torch FSDP1 FULL_SHARD                                             on shardkit
  e  shardkit FSDP FULL_SHARD                                           on shardkit  what shardkit offers
  f  shardkit FSDP SHARD_GRAD_OP                                        on shardkit
  g  shardkit FSDP NO_SHARD                                             on shardkit
  h  shardkit FSDP HYBRID_SHARD (shard over both ranks, replicate 1)    on shardkit
  i  shardkit FSDP FULL_SHARD                                           on gloo      its wrapper alone
  j  shardkit FSDP FULL_SHARD, flat gradients in ordinary memory        on shardkit  what zero-copy buys (e vs j)
  k  shardkit.fully_shard (FSDP2's front, per block + root)             on shardkit  the recommended front

(e) makes each flat gradient in the shard group's shared memory, from which the reduce-scatter reads the
peers' gradients where they lie; (j) takes that memory away (a private switch, for this comparison only), so
its flat gradients are new tensors copied through the group's slots, as on any other backend.

FSDP2 meshes: ``init_device_mesh("cpu", (2,))`` over the default (shardkit) group, and
``DeviceMesh.from_group(gloo_group, "cpu")`` for gloo. bf16 is ``MixedPrecision(param_dtype=bf16,
reduce_dtype=bf16)`` (FSDP1, shardkit) or ``MixedPrecisionPolicy`` with the same dtypes (FSDP2): fp32
sharded parameters and optimizer, bf16 compute and gradient reduction. A configuration that cannot be
built (shardkit.FullyShardedDataParallel missing, NotImplementedError, a refused argument) is recorded
with the reason, on every rank alike, and so is one whose first step raises on every rank; the others run.
So the shardkit rows switch on by themselves once the wrapper exists. A row that breaks the job (one rank
failing while the other waits) costs a rerun: with (e) as the only shardkit row, then with none.

Timing: the first warm-up round builds and steps each configuration in turn; after it, round r steps every
configuration once, starting at configuration r mod K, after a barrier, so drift on this shared machine
hits all of them alike. Warm-up rounds, then timed rounds; a step is forward +
loss + backward + optimizer.step + zero_grad; its time is the slowest rank's; best and median over rounds.

Memory per rank: (1) model state — bytes of the tensors actually held after optimizer.step (the moment all
of it exists): the wrapper's parameters (a DTensor's local shard; a view counts its whole storage, so an
FSDP1 flat shard counts once, padding included), their gradients, and the optimizer's state and own
parameter copies; next to the ideal 16·Ψ/N (fp32 parameter + gradient + AdamW's two moments, sharded N
ways). (2) Peak RSS: each configuration alone in fresh ranks (as ddp_step.py does), its growth over the
process after backend setup and a tiny warm-up step (ru_maxrss; activations and all-gathered buffers
included), and the absolute peak; beside it the same probe's peak PSS growth (proportional set size, sampled
every 2 ms), which counts a shared page once across the ranks mapping it where RSS counts it in each.

Correctness guard: the loss of every step, averaged over ranks; the final one of every configuration must
match the anchor (a) of the same precision (rel. 1e-4 in fp32, 3e-2 in bf16).

Results: ``benchmarks/results/fsdp_step.{json,png}`` (``--quick`` writes ``fsdp_step_quick.*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import (  # noqa: E402
    MiB,
    PeakPss,
    format_table,
    live_rss_bytes,
    mib,
    peak_rss_bytes,
    plot_bar_panels,
    pss_bytes,
    return_large_frees_to_os,
    synthetic_token_batches,
    unique_storage_bytes,
)
from _gpt import GPT, QUICK_MODEL, Block, ModelConfig, n_params  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    RunConfig,
    agree_max_rows,
    agree_outcome,
    describe_paired,
    header,
    init_groups,
    interleaved_rounds,
    launch_attempts,
    load_note,
    machine_info,
    probe,
    rank0_progress,
    round_ratios,
    row_ratio,
    save_results,
    utc_now,
    warn_if_busy,
    wrote,
)

LR = 1e-3
PRECISIONS = ("fp32", "bf16")
LOSS_RTOL = {"fp32": 1e-4, "bf16": 3e-2}
STATE_FIELDS = ("params", "grads", "opt_state", "opt_params")


# --- configurations ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    wrapper: str             # "fsdp2" | "fully_shard" (shardkit's) | "fsdp1" | "shardkit" (its FSDP1 front)
    backend: str             # "gloo" | "shardkit"
    strategy: str = "FULL_SHARD"
    zero_copy: bool = True   # shardkit FSDP: flat gradients in the shard group's shared memory where it can


VARIANTS: tuple[Variant, ...] = (
    Variant("a", "torch FSDP2 / gloo", "fsdp2", "gloo"),
    Variant("b", "torch FSDP2 / shardkit", "fsdp2", "shardkit"),
    Variant("c", "torch FSDP1 FULL_SHARD / gloo", "fsdp1", "gloo"),
    Variant("d", "torch FSDP1 FULL_SHARD / shardkit", "fsdp1", "shardkit"),
    Variant("e", "shardkit FSDP FULL_SHARD / shardkit", "shardkit", "shardkit"),
    Variant("f", "shardkit FSDP SHARD_GRAD_OP / shardkit", "shardkit", "shardkit", "SHARD_GRAD_OP"),
    Variant("g", "shardkit FSDP NO_SHARD / shardkit", "shardkit", "shardkit", "NO_SHARD"),
    Variant("h", "shardkit FSDP HYBRID_SHARD / shardkit", "shardkit", "shardkit", "HYBRID_SHARD"),
    Variant("i", "shardkit FSDP FULL_SHARD / gloo", "shardkit", "gloo"),
    Variant("j", "shardkit FSDP FULL_SHARD / shardkit, copying", "shardkit", "shardkit", zero_copy=False),
    Variant("k", "shardkit.fully_shard / shardkit", "fully_shard", "shardkit"),
)


def variant(key: str) -> Variant:
    return next(v for v in VARIANTS if v.key == key)


@dataclasses.dataclass
class Built:
    variant: Variant
    model: nn.Module
    optimizer: torch.optim.Optimizer


def build(v: Variant, cfg: ModelConfig, precision: str, groups: dict[str, Any]) -> Built:
    """The same seeded GPT wrapped as ``v`` says; raises (NotImplementedError, ...) when it cannot be built."""
    torch.manual_seed(0)
    module = GPT(cfg)
    bf16 = precision == "bf16"
    group = groups[v.backend]
    if v.wrapper in ("fsdp2", "fully_shard"):  # the same recipe; shardkit's function or torch's
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if v.wrapper == "fully_shard":
            import shardkit

            fully_shard = shardkit.fully_shard  # noqa: F811

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
            MixedPrecisionPolicy()
        for block in module.blocks:
            fully_shard(block, mesh=groups["mesh:" + v.backend], mp_policy=policy)
        model: nn.Module = fully_shard(module, mesh=groups["mesh:" + v.backend], mp_policy=policy)
    else:  # FSDP1's constructor: torch's, or shardkit's, which takes the same arguments
        if v.wrapper == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as wrapper
            from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            # CPU ranks: torch FSDP1 would otherwise look for an accelerator; original parameters, as FSDP2 has
            extra: dict[str, Any] = {"device_id": torch.device("cpu"), "use_orig_params": True}
        else:
            import shardkit

            wrapper = getattr(shardkit, "FullyShardedDataParallel", None)
            if wrapper is None:
                raise NotImplementedError("shardkit.FullyShardedDataParallel does not exist yet")
            from shardkit.fsdp import MixedPrecision, ShardingStrategy
            from shardkit.wrap import transformer_auto_wrap_policy

            extra = {}
        if v.strategy == "HYBRID_SHARD":  # FSDP1's form: (shard group, replicate group), both real groups
            group = (group or dist.group.WORLD, groups["replicate:" + v.backend])
        model = wrapper(
            module, process_group=group, sharding_strategy=getattr(ShardingStrategy, v.strategy),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16
            else None, **extra)
        if not v.zero_copy:
            model._reduce_memory = None  # shardkit FSDP's ordinary flat gradients (see the docstring)
    return Built(v, model, torch.optim.AdamW(model.parameters(), lr=LR))


def train_step(built: Built, batch: tuple[torch.Tensor, torch.Tensor], after_step=None) -> tuple[float, ...]:
    """forward + loss, backward, optimizer.step + zero_grad: (seconds of each, loss)."""
    tokens, targets = batch
    t0 = time.perf_counter()
    logits = built.model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # fp32 loss in both precisions
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    built.optimizer.step()
    if after_step is not None:
        after_step()
    built.optimizer.zero_grad()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, loss.item()


# --- model-state bytes -----------------------------------------------------------------------------------------

def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (FSDP2 parameters, gradients and AdamW state are DTensors); others unchanged."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def model_state_bytes(built: Built, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
    """One untimed step; bytes of the tensors held after optimizer.step, each storage once."""
    out: dict[str, int] = {}

    def sample() -> None:
        params = [local(p) for p in built.model.parameters()]
        opt = built.optimizer
        state = [local(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        stepped = [local(p) for g in opt.param_groups for p in g["params"]]
        out.update(params=unique_storage_bytes(params),
                   grads=unique_storage_bytes([local(p.grad) for p in built.model.parameters()]),
                   opt_state=unique_storage_bytes(state, exclude=params),
                   opt_params=unique_storage_bytes(stepped, exclude=params))

    train_step(built, batch, after_step=sample)
    out["total"] = sum(out[f] for f in STATE_FIELDS)
    return out


# --- the ranks -------------------------------------------------------------------------------------------------

def setup_groups(rank: int, world: int, store: str, timeout_s: float, keys: Sequence[str]) -> dict[str, Any]:
    """Default group shardkit, a gloo group over the same ranks, and what the configurations need of them."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch FSDP1's deprecation notice, per wrap
    groups: dict[str, Any] = {"shardkit": None, "gloo": init_groups(rank, world, store, timeout_s)}
    if any(variant(k).wrapper in ("fsdp2", "fully_shard") for k in keys):
        groups["mesh:shardkit"] = init_device_mesh("cpu", (world,))
        groups["mesh:gloo"] = DeviceMesh.from_group(groups["gloo"], "cpu")
    if any(variant(k).strategy == "HYBRID_SHARD" for k in keys):
        # Replicate groups of one rank each (one host: the shard group is the whole world); every rank
        # creates every group, as new_group requires.
        singles = [dist.new_group([r]) for r in range(world)]
        groups["replicate:shardkit"] = singles[rank]
    return groups


def try_build(v: Variant, cfg: ModelConfig, precision: str, groups: dict[str, Any],
              batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Built, float] | str:
    """The configuration built and stepped once on ``batch`` (the first warm-up step) with its loss, or why
    not. A new wrapper's first bugs usually raise on every rank alike, at build or in the first step; caught
    here, they cost that row only. All ranks must agree on the outcome."""
    try:
        built = build(v, cfg, precision, groups)
        result: tuple[Built, float] | str = (built, train_step(built, batch)[3])
    except Exception as error:  # noqa: BLE001 - a row that cannot run is reported, the others run
        kind = "not implemented" if isinstance(error, NotImplementedError) else "failed"
        result = f"{kind}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return agree_outcome(result, v.label, groups["gloo"])


def rank_main(rank: int, world: int, store: str, run: RunConfig, precision: str) -> dict[str, Any]:
    groups = setup_groups(rank, world, store, run.pg_timeout_s, run.keys)
    gloo = groups["gloo"]

    progress = rank0_progress(rank, prefix=f"[{precision}] ")

    batches = synthetic_token_batches(run.model.vocab, run.model.batch, run.model.seq, rank,
                                      run.warmup + run.rounds + 1)
    status: dict[str, str] = {}
    built: dict[str, Built] = {}
    losses: dict[str, list[float]] = {}  # every step, this rank
    for key in run.keys:  # warm-up round 1: each configuration built and stepped in turn
        result = try_build(variant(key), run.model, precision, groups, batches[0])
        if isinstance(result, str):
            status[key] = result
        else:
            (built[key], first), status[key] = result, "ok"
            losses[key] = [first]
    active = [k for k in run.keys if k in built]
    progress(f"built and stepped {len(active)} of {len(run.keys)} configurations; {run.warmup} warm-up + "
             f"{run.rounds} timed rounds")

    samples: dict[str, list[list[float]]] = {k: [] for k in active}   # per timed round: fwd, bwd, opt, total
    for r, order, timed in interleaved_rounds(active, run.warmup, run.rounds, progress, first=1):
        for key in order:
            dist.barrier()
            fwd, bwd, opt, loss = train_step(built[key], batches[r])
            losses[key].append(loss)
            if timed:
                samples[key].append([fwd, bwd, opt, fwd + bwd + opt])

    memory = {key: model_state_bytes(built[key], batches[-1]) for key in active}

    # Slowest rank per round and phase, mean loss over ranks; the flattened order is the same on every rank.
    timing = agree_max_rows(samples, gloo)
    loss_t = torch.tensor([x for k in active for x in losses[k]], dtype=torch.float64)
    dist.all_reduce(loss_t, group=gloo)
    loss_t /= world
    mean_loss, j = {}, 0
    for k in active:
        mean_loss[k] = loss_t[j: j + len(losses[k])].tolist()
        j += len(losses[k])
    return {"status": status, "timing": timing, "memory": memory, "loss": mean_loss}


def rss_probe(rank: int, world: int, store: str, run: RunConfig, precision: str, key: str) -> dict[str, Any]:
    """One configuration alone in fresh ranks: its peak RSS growth over the process after backend setup.

    Before the baseline, a miniature GPT takes one local AdamW step (same precision), so kernel code and
    one-off caches are resident and not charged to the configuration.
    """
    fixed = return_large_frees_to_os()
    groups = setup_groups(rank, world, store, run.pg_timeout_s, (key,))
    dist.barrier()
    dist.barrier(group=groups["gloo"])
    mini = GPT(QUICK_MODEL)
    opt = torch.optim.AdamW(mini.parameters(), lr=LR)
    tokens, targets = synthetic_token_batches(QUICK_MODEL.vocab, 2, QUICK_MODEL.seq, rank, 1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = mini(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    opt.step()
    del mini, opt, logits
    base, base_peak, base_pss = live_rss_bytes(), peak_rss_bytes(), pss_bytes()
    with PeakPss() as pss:
        built = build(variant(key), run.model, precision, groups)
        batches = synthetic_token_batches(run.model.vocab, run.model.batch, run.model.seq, rank, run.warmup + 1)
        live_after_step: list[int] = []
        for n, batch in enumerate(batches):
            last = n == len(batches) - 1
            train_step(built, batch, after_step=(lambda: live_after_step.append(live_rss_bytes()["live"])) if last
                       else None)
    return {"peak_growth": peak_rss_bytes() - base_peak, "peak": peak_rss_bytes(),
            "pss_peak_growth": pss.peak - base_pss,
            "live_after_step_growth": live_after_step[0] - base["live"], "baseline_live": base["live"],
            "baseline_peak": base_peak, "mmap_threshold_fixed": fixed}


# --- reporting -------------------------------------------------------------------------------------------------

def summarize(result: list[dict[str, Any]], run: RunConfig, ideal: float) -> dict[str, dict[str, Any]]:
    """Per configuration: status, step-time statistics, memory of every rank, losses."""
    head = result[0]
    rows: dict[str, dict[str, Any]] = {}
    for key in run.keys:
        v = variant(key)
        row: dict[str, Any] = {"key": key, "label": v.label, "wrapper": v.wrapper, "backend": v.backend,
                               "strategy": v.strategy, "status": head["status"][key]}
        if row["status"] == "ok":
            t = head["timing"][key]
            totals = [s[3] for s in t]
            mem = [r["memory"][key] for r in result]
            row.update({
                "step_s": statistics.median(totals), "step_s_best": min(totals), "step_s_samples": totals,
                "forward_s": statistics.median(s[0] for s in t), "backward_s": statistics.median(s[1] for s in t),
                "optimizer_s": statistics.median(s[2] for s in t),
                "model_state_by_rank": mem, "model_state_vs_ideal": max(m["total"] for m in mem) / ideal,
                "loss": head["loss"][key], "final_loss": head["loss"][key][-1]})
        rows[key] = row
    return rows


def paired(rows: dict[str, dict[str, Any]], num: str, den: str) -> str:
    """Per-round ratios (the interleaving makes a round's steps comparable): whether a ratio near a limit is
    noise."""
    if row_ratio(rows, num, den) is None:
        return ""
    return describe_paired(round_ratios(rows[num]["step_s_samples"], rows[den]["step_s_samples"]))


def peak_growth(row: dict[str, Any]) -> float | None:
    probes = row.get("rss_by_rank")
    return max(p["peak_growth"] for p in probes) if probes else None


def print_tables(precision: str, rows: dict[str, dict[str, Any]], run: RunConfig, ideal: float) -> None:
    table = []
    for key, row in rows.items():
        name = f"({key}) {row['label']}"
        if row["status"] != "ok":
            table.append([name, row["status"].split(":")[0]] + [""] * 12)
            continue
        ra, rb = row_ratio(rows, key, "a"), row_ratio(rows, key, "b")
        probes = row.get("rss_by_rank")
        loss_a = rows["a"]["final_loss"] if rows.get("a", {}).get("status") == "ok" else None
        table.append([
            name, "ok", f"{row['step_s_best'] * 1e3:.0f}", f"{row['step_s'] * 1e3:.0f}",
            f"{row['forward_s'] * 1e3:.0f}", f"{row['backward_s'] * 1e3:.0f}", f"{row['optimizer_s'] * 1e3:.0f}",
            "-" if ra is None else f"{ra:.3f}×", "-" if rb is None else f"{rb:.3f}×",
            " / ".join(mib(m["total"]) for m in row["model_state_by_rank"]), f"{row['model_state_vs_ideal']:.4f}",
            " / ".join(mib(p["peak_growth"]) for p in probes) + f" ({mib(max(p['peak'] for p in probes))})"
            if probes else "-",
            " / ".join(mib(p.get("pss_peak_growth")) for p in probes) if probes else "-",
            f"{row['final_loss']:.5f}" + ("" if loss_a is None or key == "a" else
                                          f" ({(row['final_loss'] - loss_a) / abs(loss_a):+.1e})")])
    print(f"\n=== {precision}: step time (ms; slowest rank; best and median of {run.rounds} interleaved rounds; "
          f"phases are medians), memory per rank (MiB), final loss ===")
    print(format_table(["configuration", "status", "best", "median", "fwd", "bwd", "opt", "÷ (a)", "÷ (b)",
                        "model state r0 / r1", "÷ 16Ψ/N", "peak RSS Δ r0 / r1 (abs.)", "peak PSS Δ r0 / r1",
                        "final loss (rel. vs a)"],
                       table, left=2))
    print(f"÷: ratio of medians; 16Ψ/N = {mib(ideal)} MiB; model state: parameters + gradients + AdamW state held "
          f"after optimizer.step; peak RSS Δ: ru_maxrss growth of fresh ranks running that configuration alone "
          f"(abs.: the fuller rank's ru_maxrss itself); peak PSS Δ: the same probe's growth of proportional set size "
          f"(sampled every 2 ms), which counts shared memory read from a peer once across the ranks, not in each")
    for key, row in rows.items():
        if row["status"] != "ok":
            print(f"({key}) {row['status']}")


def check_targets(precision: str, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, ok: bool | None = None, shown: str = "",
            skip: str = "not measured") -> None:
        status = "SKIP" if value is None else ("PASS" if (value <= limit if ok is None else ok) else "MISS")
        checks.append({"precision": precision, "target": name, "status": status, "value": value, "limit": limit})
        print(f"[{status}] {precision}: {name}: {skip if value is None else shown or f'{value:.3f}×'}")

    why = rows.get("e", {}).get("status", "not run")
    add("shardkit FULL_SHARD / shardkit ≤ 0.9× torch FSDP2 / shardkit (e ÷ b, medians)", row_ratio(rows, "e", "b"), 0.9,
        shown=f"{row_ratio(rows, 'e', 'b') or 0:.3f}×{paired(rows, 'e', 'b')}", skip=why)
    add("shardkit FULL_SHARD / shardkit ≤ 0.7× torch FSDP2 / gloo (e ÷ a, medians)", row_ratio(rows, "e", "a"), 0.7,
        shown=f"{row_ratio(rows, 'e', 'a') or 0:.3f}×{paired(rows, 'e', 'a')}", skip=why)
    pe, pb = peak_growth(rows.get("e", {})), peak_growth(rows.get("b", {}))
    add("shardkit FULL_SHARD peak RSS growth ≤ torch FSDP2's on shardkit (e ÷ b, fuller rank)",
        None if pe is None or pb is None else pe / pb, 1.0,
        shown=f"{mib(pe)} vs {mib(pb)} MiB" if pe is not None and pb is not None else "", skip=why)
    state = rows["e"]["model_state_vs_ideal"] if rows.get("e", {}).get("status") == "ok" else None
    add("shardkit FULL_SHARD model-state bytes within 1% of 16Ψ/N (fuller rank)", state, 1.01,
        ok=state is not None and abs(state - 1) <= 0.01, shown=f"{state or 0:.4f}× of 16Ψ/N", skip=why)
    why_k = rows.get("k", {}).get("status", "not run")
    add("shardkit.fully_shard / shardkit ≤ 0.75× torch FSDP2 / shardkit (k ÷ b, medians)", row_ratio(rows, "k", "b"),
        0.75, shown=f"{row_ratio(rows, 'k', 'b') or 0:.3f}×{paired(rows, 'k', 'b')}", skip=why_k)
    add("shardkit.fully_shard / shardkit ≤ 0.5× torch FSDP2 / gloo (k ÷ a, medians)", row_ratio(rows, "k", "a"), 0.5,
        shown=f"{row_ratio(rows, 'k', 'a') or 0:.3f}×{paired(rows, 'k', 'a')}", skip=why_k)
    pk = peak_growth(rows.get("k", {}))
    add("shardkit.fully_shard peak RSS growth ≤ torch FSDP2's on shardkit (k ÷ b, fuller rank)",
        None if pk is None or pb is None else pk / pb, 1.0,
        shown=f"{mib(pk)} vs {mib(pb)} MiB" if pk is not None and pb is not None else "", skip=why_k)
    # Correctness guard: every row's final loss against (a)'s.
    anchor = rows.get("a", {})
    if anchor.get("status") == "ok":
        ok_rows = [r for r in rows.values() if r["status"] == "ok"]
        rel = {r["key"]: abs(r["final_loss"] - anchor["final_loss"]) / abs(anchor["final_loss"]) for r in ok_rows}
        worst = max(rel.values())
        bad = [f"({k})" for k, x in rel.items() if not x <= LOSS_RTOL[precision]]  # NaN counts as bad
        add(f"final loss of all {len(ok_rows)} configurations agrees with (a) (rel. ≤ {LOSS_RTOL[precision]:g})",
            worst, LOSS_RTOL[precision], ok=not bad,
            shown=f"max rel. diff {worst:.2e}" + (f"; differ: {' '.join(bad)}" if bad else ""))
    return checks


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path, cfg: ModelConfig, psi: int) -> Path | None:
    keys = [v.key for v in VARIANTS if any(v.key in rows for rows in results.values())]
    names = [f"({k}) {variant(k).label}" for k in keys]

    def per_precision(value) -> dict[str, list[float]]:
        return {p: [value(rows[k]) if rows.get(k, {}).get("status") == "ok" else float("nan") for k in keys]
                for p, rows in results.items()}

    def state(field: str):
        return lambda row: max(m[field] for m in row["model_state_by_rank"]) / MiB

    first = next(iter(results))
    growth = per_precision(lambda row: (peak_growth(row) or float("nan")) / MiB)
    return plot_bar_panels(path, {
        "step time": (names, per_precision(lambda row: row["step_s"] * 1e3)),
        "peak RSS growth per rank (fuller rank)": (names, growth),
        f"model state per rank ({first}, fuller rank)": (names, {
            "parameters": per_precision(state("params"))[first], "gradients": per_precision(state("grads"))[first],
            "optimizer state": per_precision(state("opt_state"))[first],
            "optimizer's param copies": per_precision(state("opt_params"))[first]}),
    }, ylabels={"step time": "ms (median, slowest rank)", "peak RSS growth per rank (fuller rank)": "MiB",
                f"model state per rank ({first}, fuller rank)": "MiB"},
        grouped=("step time", "peak RSS growth per rank (fuller rank)"),
        suptitle=f"FSDP step, world 2, {psi / 1e6:.1f}M-parameter GPT ({cfg.layers} blocks, d {cfg.d_model}), "
                 f"AdamW (CPU, 1 thread per rank)")


# --- main ------------------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (one host)")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 warm-up + 1 timed step: a smoke test")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (one step per configuration each)")
    p.add_argument("--layers", type=int, default=ModelConfig.layers)
    p.add_argument("--batch", type=int, default=ModelConfig.batch, help="sequences per rank per step")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--only", nargs="+", choices=[v.key for v in VARIANTS], default=None,
                   help="run only these configurations (default: all)")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak-RSS probes")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for fsdp_step.json/png")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    world = args.world
    if args.quick:
        cfg, warmup, rounds = QUICK_MODEL, 1, 1
    else:
        cfg, warmup, rounds = dataclasses.replace(ModelConfig(), layers=args.layers, batch=args.batch), \
            args.warmup, args.rounds
    if warmup < 1 or rounds < 1:
        raise SystemExit("--warmup and --rounds must be ≥ 1")
    run = RunConfig(model=cfg, warmup=warmup, rounds=rounds, keys=tuple(args.only or [v.key for v in VARIANTS]))
    psi = n_params(cfg)
    ideal = 16 * psi / world
    machine = machine_info()
    print(header("shardkit FSDP step benchmark", machine,
                 f"world {world}, 1 thread per rank{' (--quick)' if args.quick else ''}"))
    print(f"model: GPT, vocab {cfg.vocab}, d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} blocks (MLP 4×), "
          f"positions {cfg.seq}, tied LM head: Ψ = {psi:,} parameters; 16Ψ/N = {mib(ideal)} MiB")
    print(f"data: synthetic tokens, batch {cfg.batch} × seq {cfg.seq} per rank; AdamW lr {LR}; {warmup} warm-up + "
          f"{rounds} timed rounds per precision")
    warn_if_busy(machine)

    results: dict[str, dict[str, dict[str, Any]]] = {}
    loads: dict[str, float | None] = {}
    checks: list[dict[str, Any]] = []
    for precision in args.precision:
        # A shardkit row that fails on one rank only leaves the other waiting in a collective and the job dies.
        # Then run again with the target row (e) as the only shardkit row, then with none, to keep what works.
        ours = [k for k in run.keys if variant(k).wrapper == "shardkit"]
        attempts = [run.keys]
        for keep in (("e",), ()):
            keys = tuple(k for k in run.keys if k not in ours or k in keep)
            if keys and keys not in attempts:
                attempts.append(keys)
        with ForeignLoad() as load:
            raw, keys, job_error = launch_attempts(
                rank_main, world, attempts, lambda keys: (dataclasses.replace(run, keys=keys), precision),
                timeout=2400.0,
                retry_note=lambda keys: f"[{precision}] the job failed; again with rows {' '.join(keys)}")
            if job_error is not None:
                raw_error = job_error.splitlines()[-1][:200]
                raw[0]["status"].update({k: f"failed: the job died with this row in it ({raw_error})"
                                         for k in run.keys if k not in keys})
        loads[precision] = load.cores
        rows = summarize(raw, run, ideal)
        results[precision] = rows
        if not args.no_rss:
            for key, row in rows.items():
                # --quick probes only the rows the targets read: each probe is a fresh launch (~7 s)
                if row["status"] != "ok" or (args.quick and key not in ("a", "b", "e", "k")):
                    continue
                probe(row, key, rss_probe, world, run, precision, key, timeout=900.0, prefix=f"[{precision}] ")
        if (note := load_note(load.cores, machine, "the timed job")):
            print(f"\n[{precision}] {note}")
        print_tables(precision, rows, run, ideal)
        print(f"\n=== {precision}: targets ===")
        checks += check_targets(precision, rows)

    elapsed = time.monotonic() - started
    stem = ("fsdp_step_quick" if args.quick else "fsdp_step") + ("" if world == 2 else f"_w{world}")
    config = {"world": world, "model": dataclasses.asdict(cfg), "n_params": psi, "ideal_model_state_bytes": ideal,
              "lr": LR, "optimizer": "AdamW", "threads_per_rank": 1, "order": "interleaved rounds, rotated start",
              "timing": "barrier, then forward+loss+backward+optimizer.step+zero_grad; slowest rank per step; "
                        "best and median over rounds",
              "model_state": "bytes of parameters (local shards), gradients, optimizer state and optimizer param "
                             "copies after optimizer.step, storages once",
              "rss": "ru_maxrss growth over fresh ranks after backend setup and a tiny warm-up step"}
    payload = {
        "benchmark": "fsdp_step", "quick": args.quick, "machine": machine, "config": config,
        "results": {p: list(rows.values()) for p, rows in results.items()},
        "runs": {p: {"warmup_rounds": warmup, "timed_rounds": rounds, "foreign_load_cores": loads[p],
                     "machine_load_avg_1m": machine["load_avg_1m"], "git_commit": machine["git_commit"],
                     "finished": utc_now()}
                 for p in results},
        "targets": checks, "seconds": elapsed}
    json_path = args.out / f"{stem}.json"
    # A run of one precision keeps the other's results, if they are of the same model.
    payload = save_results(json_path, payload, {"targets": lambda t: (t["precision"], t["target"])}, same_if="config")
    png_path = plot({p: {r["key"]: r for r in rows} for p, rows in payload["results"].items()},
                    args.out / f"{stem}.png", cfg, psi)
    print("\n" + wrote(json_path, png_path) + f"; total {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

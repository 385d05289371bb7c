"""shardkit on one GPU against its anchors, measured in the same run (issue #13's benchmark; needs the CUDA build).

    python benchmarks/gpu_kernels.py                       # every section
    python benchmarks/gpu_kernels.py --sections kernels    # only the kernel rows (no process group)
    python benchmarks/gpu_kernels.py --sections powersgd fsdp --precision bf16

Sections:
  kernels   each timed with CUDA events (median of --rounds after warm-up), inputs rotated among several buffer
            sets so that a buffer never sits in L2 between runs:
    - pack / unpack of 256 tensors (mixed sizes, --mb in all) into / out of one flat buffer, and cast+scale
      fp32 -> bf16 and bf16 -> fp32 (x 1/8): bandwidth (bytes read + written) beside a device-to-device copy of
      the same bytes (torch's copy_), the anchor. Target: >= 80% of the copy's bandwidth.
    - Gram-Schmidt of PowerSGD's P matrices (1024 matrices of 1024 x 4, fp32) beside torch's own
      _orthogonalize_gram_schmidt from its PowerSGD hook. Target: >= 2x faster.
  powersgd  PowerSGD on CUDA, world 1, rank 4 (PSGD_LAYERS: 4096x1024, three 4096x4096, 1024x4096 Linear layers
            with biases, 58.7M parameters, batch 64), each configuration torch's DDP over its own copy of the
            model, all fed the same batches. torch's hooks run on a torch group "cpu:gloo,cuda:nccl" (NCCL),
            shardkit's on the default group, backend "shardkit" (its CUDA ops go through its NCCL engine). Per
            round every configuration, in a rotated order, takes two steps (forward + backward + SGD step):
      hook step  each Python hook call wrapped (the same wrapper for torch's and shardkit's hooks): device
                 synchronize, host clock, hook, future.wait(), device synchronize, host clock; summed over the
                 buckets of the step. This is the hook's latency alone (host work + device work, nothing else
                 on the GPU), the number the target reads.
      step step  the wrapper passes straight through; CUDA events around forward, backward and optimizer step
                 after a device synchronize: what the hook costs inside a real step, where its host work overlaps
                 the GPU (the native row, with no Python per bucket, has this number only).
            start_powerSGD_iter = 2, so every timed step is compressed (warm-up rounds take 2 steps each).
            Targets: shardkit's powerSGD_hook <= 0.5x torch's (both on NCCL's transport), per step and per call
            (same buckets); the same for batched_powerSGD_hook. Gradients of each shardkit configuration are
            compared with its torch anchor's after every step (max |diff| / max |ref|; torch orthogonalises by
            QR at rank 4, shardkit by Gram-Schmidt, so they agree to rounding, not bit for bit).
  fsdp      a training step of the benchmarks' GPT (benchmarks/_gpt.py; GPT-2-small-like shape by default, see
            --layers/--d-model/...), AdamW, world 1: torch FSDP2 (fully_shard per Block + root, default
            reshard_after_forward) on a DeviceMesh over the NCCL group, against shardkit.FullyShardedDataParallel
            FULL_SHARD (Block auto-wrap) on the shardkit group; fp32, and bf16 mixed precision
            (param_dtype = reduce_dtype = bf16, fp32 shards and optimizer). Interleaved rounds (rotated start),
            each step after a device synchronize, CUDA events around forward + loss, backward, optimizer step +
            zero_grad; best and median over rounds. Target: shardkit / FSDP2 <= 1.0x (medians). Guard: the final
            losses agree (rel. 1e-3 fp32, 3e-2 bf16).
The powersgd and fsdp sections each run in a fresh spawned process (world 1, file:// store, no ports), so a
failure in one is reported and the others still run; the script then exits 1. Without a GPU, or without
shardkit's CUDA build, it exits 2 at once.

Results: benchmarks/results/gpu_kernels.json (--out); a run of some sections keeps the others' results there.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import format_table, synthetic_token_batches  # noqa: E402  (the benchmarks folder is not a package)
from _gpt import GPT, Block, ModelConfig, n_params  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    RanksFailed,
    add_target,
    launch_ranks,
    machine_info,
    paired_summary,
    rotated,
    save_results,
    wrote,
)

SETS = 4  # buffer sets rotated between runs (together well beyond H100's 50 MB L2)


def median_ms(fn, rounds: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rotating(calls):
    """One callable that runs calls[0], calls[1], ... in turn, so consecutive runs touch different buffers."""
    state = {"next": 0}

    def run():
        calls[state["next"] % len(calls)]()
        state["next"] += 1
    return run


def bandwidth_rows(mb: int, rounds: int) -> list[dict]:
    from shardkit import _C

    g = torch.Generator(device="cuda").manual_seed(0)
    numel = mb * (1 << 20) // 4
    sizes = [(numel // 256) + ((i * 37) % 101) - 50 for i in range(256)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    sets = []
    for _ in range(SETS):
        flat = torch.randn(total, device="cuda", generator=g)
        pieces = [torch.randn(n, device="cuda", generator=g) for n in sizes]
        sets.append((flat, pieces, torch.empty_like(flat), torch.empty(total, device="cuda", dtype=torch.bfloat16)))
    moved = 2 * total * 4  # f32 read + written
    cases = {
        "device copy (anchor)": (rotating([lambda s=s: s[2].copy_(s[0]) for s in sets]), moved),
        "pack": (rotating([lambda s=s: _C.cuda_pack_(s[0], s[1], offsets) for s in sets]), moved),
        "unpack": (rotating([lambda s=s: _C.cuda_unpack_(s[0], s[1], offsets) for s in sets]), moved),
        "unpack x 1/8": (rotating([lambda s=s: _C.cuda_unpack_(s[0], s[1], offsets, 0.125) for s in sets]), moved),
        "cast+scale f32->bf16": (rotating([lambda s=s: _C.cuda_cast_scale_(s[3], s[0], 0.125) for s in sets]),
                                 total * 6),
        "cast+scale bf16->f32": (rotating([lambda s=s: _C.cuda_cast_scale_(s[2], s[3], 0.125) for s in sets]),
                                 total * 6),
        "torch .to(bf16) then mul_": (rotating([lambda s=s: s[3].copy_(s[0]).mul_(0.125) for s in sets]),
                                      total * 6),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        ms = median_ms(fn, rounds)
        rows.append({"kernel": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6})
    anchor = rows[0]["gb_per_s"]
    for row in rows:
        row["of_copy"] = row["gb_per_s"] / anchor
    return rows


def orthogonalize_rows(rounds: int) -> list[dict]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt

    from shardkit import _C

    g = torch.Generator(device="cuda").manual_seed(1)
    sets = [torch.randn(1024, 1024, 4, device="cuda", generator=g) for _ in range(SETS)]
    torch_ms = median_ms(rotating([lambda m=m: _orthogonalize_gram_schmidt(m, 1e-8) for m in sets]), rounds)
    ours_ms = median_ms(rotating([lambda m=m: _C.cuda_orthogonalize_(m, 1e-8) for m in sets]), rounds)
    return [{"kernel": "torch _orthogonalize_gram_schmidt (anchor)", "ms": torch_ms, "speedup": 1.0},
            {"kernel": "shardkit cuda_orthogonalize_", "ms": ours_ms, "speedup": torch_ms / ours_ms}]


# --- shared by the sections that train: process groups, timing, summaries --------------------------------------

TORCH_BACKEND = "cpu:gloo,cuda:nccl"  # the group torch's hooks and FSDP2 run on: NCCL for CUDA tensors


@dataclasses.dataclass(frozen=True)
class Section:
    """What a spawned section process needs. ``device``/``torch_backend`` are "cuda"/TORCH_BACKEND here; the
    same code runs on "cpu"/"gloo" only to check its code paths on a machine without a GPU."""

    device: str = "cuda"
    torch_backend: str = TORCH_BACKEND
    warmup: int = 3
    rounds: int = 20
    precisions: tuple[str, ...] = ("fp32", "bf16")
    model: ModelConfig = ModelConfig()
    psgd_layers: tuple[tuple[int, int], ...] = ()  # () means PSGD_LAYERS
    pg_timeout_s: float = 300.0


def init_groups(store: str, sec: Section) -> tuple[torch.device, dist.ProcessGroup]:
    """World 1: the default group on shardkit's backend, and a group over the same rank for torch's side."""
    import shardkit  # noqa: F401  (registers the "shardkit" backend)

    if sec.device == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(sec.device)
    dist.init_process_group("shardkit", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=sec.pg_timeout_s))
    return device, dist.new_group(backend=sec.torch_backend, timeout=timedelta(seconds=sec.pg_timeout_s))


def shardkit_cuda_route(device: torch.device) -> str | None:
    """What carried the shardkit group's CUDA collectives ('nccl', or host staging and why)."""
    if device.type != "cuda":
        return None
    try:
        return dist.group.WORLD._get_backend(device).cuda_route()
    except Exception as error:  # noqa: BLE001 - informational only
        return f"unknown ({type(error).__name__}: {error})"


def sync(device: torch.device) -> None:
    """Every stream of the device idle (the NCCL and shardkit communication streams included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Marks:
    """Points on the device's timeline, recorded on the current stream: CUDA events on a GPU (host clock on the
    CPU). ``intervals_ms()`` waits for the last one and returns the times between consecutive points."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            self.points[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.points, self.points[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.points, self.points[1:])]


def short_error(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


# --- PowerSGD hook on CUDA ---------------------------------------------------------------------------------------

PSGD_RANK = 4
PSGD_START = 2  # the smallest start_powerSGD_iter torch allows with error feedback: warm-up covers the switch
PSGD_BATCH = 64
PSGD_LAYERS = ((1024, 4096), (4096, 4096), (4096, 4096), (4096, 4096), (4096, 1024))  # (in, out) features
PSGD_LR = 1e-3


@dataclasses.dataclass(frozen=True)
class PsgdConfig:
    key: str
    label: str
    group: str               # "torch" (the NCCL group) | "shardkit" (the default group)
    hook: str | None         # which hook; None: DDP's own allreduce
    anchor: str | None = None  # the torch configuration it is compared with (hook time, gradients)
    target: bool = False     # its hook time ÷ the anchor's is a target (<= 0.5)


PSGD_CONFIGS: tuple[PsgdConfig, ...] = (
    PsgdConfig("plain", "torch DDP, no hook (allreduce) / NCCL", "torch", None),
    PsgdConfig("torch", "torch powerSGD_hook / NCCL", "torch", "torch"),
    PsgdConfig("torch_sk", "torch powerSGD_hook / shardkit", "shardkit", "torch", anchor="torch"),
    PsgdConfig("shardkit", "shardkit powerSGD_hook / shardkit", "shardkit", "shardkit", anchor="torch", target=True),
    PsgdConfig("native", "shardkit hooks.register(powersgd) / shardkit", "shardkit", "native", anchor="torch"),
    PsgdConfig("torch_b", "torch batched_powerSGD_hook / NCCL", "torch", "torch_b"),
    PsgdConfig("shardkit_b", "shardkit batched_powerSGD_hook / shardkit", "shardkit", "shardkit_b",
               anchor="torch_b", target=True),
)


def psgd_model(shape: Sequence[tuple[int, int]]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(shape):
        layers += [nn.Linear(fan_in, fan_out)] + ([nn.ReLU()] if i + 1 < len(shape) else [])
    return nn.Sequential(*layers)


class HookClock:
    """Wraps a Python comm hook; while ``on``, each call is timed alone (device idle before, the hook's future
    waited for and the device idle after) and its seconds appended to ``times``."""

    def __init__(self) -> None:
        self.on = False
        self.times: list[float] = []
        self.device = torch.device("cpu")

    def wrap(self, hook):
        def timed(state, bucket):  # no annotations: torch checks them as objects, and this module defers them
            if not self.on:
                return hook(state, bucket)
            sync(self.device)
            t0 = time.perf_counter()
            future = hook(state, bucket)
            future.wait()
            sync(self.device)
            self.times.append(time.perf_counter() - t0)
            return future

        timed.__name__ = timed.__qualname__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed


@dataclasses.dataclass
class PsgdBuilt:
    config: PsgdConfig
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    clock: HookClock
    state: Any


def build_psgd(c: PsgdConfig, base: nn.Module, device: torch.device, torch_group: dist.ProcessGroup) -> PsgdBuilt:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import shardkit.hooks as H

    group = torch_group if c.group == "torch" else None  # None: the default (shardkit) group
    ddp = TorchDDP(copy.deepcopy(base).to(device), device_ids=[device.index] if device.type == "cuda" else None,
                   process_group=group)
    options = dict(matrix_approximation_rank=PSGD_RANK, start_powerSGD_iter=PSGD_START)
    clock = HookClock()
    clock.device = device
    state: Any = None
    if c.hook in ("torch", "torch_b"):
        state = torch_psgd.PowerSGDState(group, **options)
        hook = torch_psgd.powerSGD_hook if c.hook == "torch" else torch_psgd.batched_powerSGD_hook
        ddp.register_comm_hook(state, clock.wrap(hook))
    elif c.hook in ("shardkit", "shardkit_b"):
        state = H.PowerSGDState(group, **options)
        ddp.register_comm_hook(state, clock.wrap(H.powerSGD_hook if c.hook == "shardkit" else H.batched_powerSGD_hook))
    elif c.hook == "native":
        state = H.PowerSGDState(group, **options)
        H.register(ddp, state, "powersgd")
    return PsgdBuilt(c, ddp, torch.optim.SGD(ddp.parameters(), lr=PSGD_LR), clock, state)


def psgd_step(b: PsgdBuilt, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> list[float]:
    """One step after the device is idle: [forward + loss, backward, optimizer step] in ms (device timeline)."""
    sync(device)
    marks = Marks(device)
    marks.mark()
    b.optimizer.zero_grad()
    loss = F.mse_loss(b.ddp(x), y)
    marks.mark()
    loss.backward()
    marks.mark()
    b.optimizer.step()
    marks.mark()
    phases = marks.intervals_ms()
    sync(device)
    return phases


def psgd_section(rank: int, world: int, store: str, sec: Section) -> dict[str, Any]:
    """The spawned process of the powersgd section: build every configuration, then interleaved rounds."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    device, torch_group = init_groups(store, sec)
    # torch's batched hook hands _orthogonalize a 2-D matrix, which its 3-D assertion refuses (torch 2.13; see
    # tests/python/test_hooks.py); a 3-D batch (the per-matrix hook's) passes through unchanged.
    original = torch_psgd._orthogonalize
    torch_psgd._orthogonalize = lambda m, epsilon=0: original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    try:
        shape = sec.psgd_layers or PSGD_LAYERS
        base = psgd_model(shape)
        steps = 2 * (sec.warmup + sec.rounds)
        gen = torch.Generator().manual_seed(1234)
        batches = [(torch.randn(PSGD_BATCH, shape[0][0], generator=gen).to(device),
                    torch.randn(PSGD_BATCH, shape[-1][1], generator=gen).to(device)) for _ in range(steps)]
        status: dict[str, str] = {}
        built: dict[str, PsgdBuilt] = {}
        for c in PSGD_CONFIGS:
            try:
                built[c.key] = build_psgd(c, base, device, torch_group)
                status[c.key] = "ok"
            except Exception as error:  # noqa: BLE001 - a row that cannot be built is reported, the others run
                status[c.key] = f"failed to build: {short_error(error)}"
                traceback.print_exc()
        samples: dict[str, dict[str, list]] = {k: {"hook_ms": [], "hook_calls": [], "step_ms": [], "phases_ms": []}
                                               for k in built}
        worst_diff: dict[str, float] = {c.key: 0.0 for c in PSGD_CONFIGS if c.anchor}
        for r in range(sec.warmup + sec.rounds):
            timed = r >= sec.warmup
            grads: dict[str, list[torch.Tensor]] = {}
            for key in rotated([k for k in built if status[k] == "ok"], r):
                b = built[key]
                try:
                    for phase, (x, y) in zip(("hook", "step"), batches[2 * r: 2 * r + 2]):
                        b.clock.on, b.clock.times = phase == "hook", []
                        phases = psgd_step(b, x, y, device)
                        if timed and phase == "hook":
                            samples[key]["hook_ms"].append(sum(b.clock.times) * 1e3)
                            samples[key]["hook_calls"].append(len(b.clock.times))
                        elif timed:
                            samples[key]["step_ms"].append(sum(phases))
                            samples[key]["phases_ms"].append(phases)
                    b.clock.on = False
                    if key in worst_diff or key in {c.anchor for c in PSGD_CONFIGS}:
                        grads[key] = [p.grad.detach().clone() for p in b.ddp.parameters()]
                except Exception as error:  # noqa: BLE001 - this row stops, the others go on
                    status[key] = f"failed in round {r + 1}: {short_error(error)}"
                    traceback.print_exc()
            for key, diff in worst_diff.items():
                anchor = next(c.anchor for c in PSGD_CONFIGS if c.key == key)
                if key in grads and anchor in grads:
                    scale = max(g.abs().max().item() for g in grads[anchor]) or 1.0
                    err = max((a - g).abs().max().item() for a, g in zip(grads[key], grads[anchor]))
                    worst_diff[key] = max(diff, err / scale)
            print(f"[powersgd] round {r + 1}/{sec.warmup + sec.rounds}{'' if timed else ' (warm-up)'}",
                  file=sys.stderr, flush=True)
        compression = None
        if "shardkit" in built:
            _, before, after = built["shardkit"].state.compression_stats()
            compression = {"numel_before": before, "numel_after": after}
        return {"status": status, "samples": samples, "worst_rel_grad_diff": worst_diff,
                "compression": compression, "shardkit_cuda_route": shardkit_cuda_route(device),
                "n_params": sum(p.numel() for p in base.parameters()), "layers_in_out": shape}
    finally:
        torch_psgd._orthogonalize = original


def summarize_psgd(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for c in PSGD_CONFIGS:
        s = raw["samples"].get(c.key)
        row: dict[str, Any] = {"key": c.key, "label": c.label, "status": raw["status"].get(c.key, "not run")}
        if row["status"] == "ok" and s and s["step_ms"]:
            row.update(step_ms=statistics.median(s["step_ms"]), step_ms_best=min(s["step_ms"]),
                       forward_ms=statistics.median(p[0] for p in s["phases_ms"]),
                       backward_ms=statistics.median(p[1] for p in s["phases_ms"]),
                       optimizer_ms=statistics.median(p[2] for p in s["phases_ms"]),
                       step_ms_samples=s["step_ms"])
            if c.hook not in (None, "native"):
                calls = max(s["hook_calls"]) if s["hook_calls"] else 0
                row.update(hook_ms=statistics.median(s["hook_ms"]), hook_ms_best=min(s["hook_ms"]),
                           hook_calls=calls, hook_ms_per_call=statistics.median(s["hook_ms"]) / max(1, calls),
                           hook_ms_samples=s["hook_ms"])
        elif row["status"] == "ok":
            row["status"] = "no timed rounds"
        if c.anchor:
            row["worst_rel_grad_diff"] = raw["worst_rel_grad_diff"].get(c.key)
        rows[c.key] = row
    for c in PSGD_CONFIGS:
        row = rows[c.key]
        anchor = rows.get(c.anchor or "", {})
        if "hook_ms" in row and "hook_ms" in anchor:
            row["hook_vs_anchor"] = row["hook_ms"] / anchor["hook_ms"]
            row["hook_vs_anchor_paired"] = paired_summary(row["hook_ms_samples"], anchor["hook_ms_samples"])
        if "step_ms" in row and "step_ms" in anchor:
            row["step_vs_anchor"] = row["step_ms"] / anchor["step_ms"]
    return rows


def psgd_target_name(c: PsgdConfig) -> str:
    anchor = next(a for a in PSGD_CONFIGS if a.key == c.anchor)
    return f"{c.label} hook time ÷ {anchor.label}'s (per step; per call too: same buckets)"


def report_psgd(raw: dict[str, Any], rows: dict[str, dict[str, Any]], checks: list[dict]) -> None:
    table = []
    for c in PSGD_CONFIGS:
        row = rows[c.key]
        if row["status"] != "ok":
            table.append([row["label"], row["status"][:60]] + [""] * 9)
            continue
        target = f"<= 0.5x ({c.anchor})" if c.target else "anchor" if c.key in ("torch", "torch_b") else ""
        table.append([row["label"], "ok", fmt_ms(row.get("hook_ms")), str(row.get("hook_calls", "")),
                      fmt_ms(row.get("hook_ms_per_call")), fmt_ratio(row.get("hook_vs_anchor")),
                      fmt_ms(row["step_ms"]), fmt_ms(row["step_ms_best"]), fmt_ratio(row.get("step_vs_anchor")),
                      "" if row.get("worst_rel_grad_diff") is None else f"{row['worst_rel_grad_diff']:.1e}", target])
    print(format_table(["PowerSGD rank 4, world 1, CUDA", "status", "hook ms/step", "calls", "ms/call", "÷ anchor",
                        "step ms", "best", "÷ anchor", "max rel Δgrad", "target"], table, left=2))
    comp = raw.get("compression")
    print(f"hook ms: each hook call alone (device idle before and after), summed over a step's buckets, median of "
          f"rounds; step ms: forward + backward + SGD step on CUDA events, median; anchor: the torch row named in "
          f"the target column (torch powerSGD_hook / NCCL for the rows without one); shardkit's CUDA route: "
          f"{raw.get('shardkit_cuda_route')}"
          + (f"; shardkit's hook compressed {comp['numel_before']:,} gradient elements to {comp['numel_after']:,} "
             f"over the run" if comp else ""))
    for c in PSGD_CONFIGS:
        if not c.target:
            continue
        row = rows[c.key]
        paired = row.get("hook_vs_anchor_paired")
        add_target(checks, psgd_target_name(c), row.get("hook_vs_anchor"), 0.5, higher_is_better=False, unit="x")
        if paired:
            print(f"       per-round median {paired['median']:.3f}x, "
                  f"middle half {paired['q1']:.3f}-{paired['q3']:.3f}x")


# --- FSDP step against torch FSDP2 --------------------------------------------------------------------------------

FSDP_LR = 1e-3
FSDP_CONFIGS = (("fsdp2", "torch FSDP2 fully_shard / NCCL"), ("shardkit", "shardkit FSDP FULL_SHARD / shardkit"))
LOSS_RTOL = {"fp32": 1e-3, "bf16": 3e-2}
# GPT-2-small's shape (12 blocks of d 768, 12 heads), 512 positions, batch 8: ~110M parameters, 4096 tokens a step.
GPU_GPT = ModelConfig(vocab=32768, d_model=768, heads=12, layers=12, seq=512, batch=8)


@dataclasses.dataclass
class FsdpBuilt:
    model: nn.Module
    optimizer: torch.optim.Optimizer


def build_fsdp(key: str, cfg: ModelConfig, precision: str, device: torch.device,
               torch_group: dist.ProcessGroup) -> FsdpBuilt:
    """The same seeded GPT, wrapped by torch FSDP2 on the torch group or by shardkit FSDP on the default group."""
    torch.manual_seed(0)
    module = GPT(cfg).to(device)
    bf16 = precision == "bf16"
    if key == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(torch_group, device.type)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
            MixedPrecisionPolicy()
        for block in module.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        model: nn.Module = fully_shard(module, mesh=mesh, mp_policy=policy)
    else:
        import shardkit
        from shardkit.fsdp import MixedPrecision, ShardingStrategy
        from shardkit.wrap import transformer_auto_wrap_policy

        model = shardkit.FullyShardedDataParallel(
            module, sharding_strategy=ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None,
            device_id=device.index if device.type == "cuda" else None)
    return FsdpBuilt(model, torch.optim.AdamW(model.parameters(), lr=FSDP_LR))


def fsdp_step(b: FsdpBuilt, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
              ) -> tuple[list[float], float, torch.Tensor]:
    """One step after the device is idle: ([forward + loss, backward, optimizer step + zero_grad] in ms on the
    device timeline, host wall ms until every stream is idle again, the loss)."""
    tokens, targets = batch
    sync(device)
    wall0 = time.perf_counter()
    marks = Marks(device)
    marks.mark()
    logits = b.model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # fp32 loss in both precisions
    marks.mark()
    loss.backward()
    marks.mark()
    b.optimizer.step()
    b.optimizer.zero_grad()
    marks.mark()
    phases = marks.intervals_ms()
    sync(device)
    return phases, (time.perf_counter() - wall0) * 1e3, loss.detach()


def fsdp_section(rank: int, world: int, store: str, sec: Section) -> dict[str, Any]:
    """The spawned process of the fsdp section: per precision, both configurations built, interleaved rounds."""
    import warnings

    device, torch_group = init_groups(store, sec)
    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = sec.model
    batches = [(t.to(device), y.to(device)) for t, y in
               synthetic_token_batches(cfg.vocab, cfg.batch, cfg.seq, rank, sec.warmup + sec.rounds)]
    out: dict[str, Any] = {}
    for precision in sec.precisions:
        status: dict[str, str] = {}
        built: dict[str, FsdpBuilt] = {}
        for key, _ in FSDP_CONFIGS:
            try:
                built[key] = build_fsdp(key, cfg, precision, device, torch_group)
                status[key] = "ok"
            except Exception as error:  # noqa: BLE001 - reported, the other row runs
                status[key] = f"failed to build: {short_error(error)}"
                traceback.print_exc()
        samples: dict[str, dict[str, list]] = {k: {"step_ms": [], "phases_ms": [], "wall_ms": []} for k in built}
        losses: dict[str, list[torch.Tensor]] = {k: [] for k in built}
        for r in range(sec.warmup + sec.rounds):
            for key in rotated([k for k in built if status[k] == "ok"], r):
                try:
                    phases, wall, loss = fsdp_step(built[key], batches[r], device)
                except Exception as error:  # noqa: BLE001 - this row stops, the other goes on
                    status[key] = f"failed in round {r + 1}: {short_error(error)}"
                    traceback.print_exc()
                    continue
                losses[key].append(loss)
                if r >= sec.warmup:
                    samples[key]["step_ms"].append(sum(phases))
                    samples[key]["phases_ms"].append(phases)
                    samples[key]["wall_ms"].append(wall)
            print(f"[fsdp {precision}] round {r + 1}/{sec.warmup + sec.rounds}"
                  f"{'' if r >= sec.warmup else ' (warm-up)'}", file=sys.stderr, flush=True)
        out[precision] = {"status": status, "samples": samples,
                          "losses": {k: [float(v) for v in vs] for k, vs in losses.items()},
                          "peak_memory_allocated": torch.cuda.max_memory_allocated(device)
                          if device.type == "cuda" else None}
        del built
        gc.collect()  # wrapped modules hold reference cycles (hooks, states): free both models before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    out["shardkit_cuda_route"] = shardkit_cuda_route(device)
    return out


def summarize_fsdp(raw: dict[str, Any], sec: Section) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for key, label in FSDP_CONFIGS:
        s = raw["samples"].get(key)
        row: dict[str, Any] = {"key": key, "label": label, "status": raw["status"].get(key, "not run")}
        losses = raw["losses"].get(key, [])
        if row["status"] == "ok" and s and s["step_ms"] and len(losses) == sec.warmup + sec.rounds:
            row.update(step_ms=statistics.median(s["step_ms"]), step_ms_best=min(s["step_ms"]),
                       forward_ms=statistics.median(p[0] for p in s["phases_ms"]),
                       backward_ms=statistics.median(p[1] for p in s["phases_ms"]),
                       optimizer_ms=statistics.median(p[2] for p in s["phases_ms"]),
                       wall_ms=statistics.median(s["wall_ms"]), step_ms_samples=s["step_ms"],
                       final_loss=losses[-1])
        elif row["status"] == "ok":
            row["status"] = "incomplete"
        rows[key] = row
    ours, anchor = rows["shardkit"], rows["fsdp2"]
    if "step_ms" in ours and "step_ms" in anchor:
        ours["vs_fsdp2"] = ours["step_ms"] / anchor["step_ms"]
        ours["vs_fsdp2_best"] = ours["step_ms_best"] / anchor["step_ms_best"]
        ours["vs_fsdp2_paired"] = paired_summary(ours["step_ms_samples"], anchor["step_ms_samples"])
        ours["final_loss_rel_diff"] = abs(ours["final_loss"] - anchor["final_loss"]) / abs(anchor["final_loss"])
    return rows


def report_fsdp(precision: str, raw: dict[str, Any], rows: dict[str, dict[str, Any]], sec: Section, psi: int,
                checks: list[dict]) -> None:
    table = []
    for key, _ in FSDP_CONFIGS:
        row = rows[key]
        if row["status"] != "ok":
            table.append([row["label"], row["status"][:60]] + [""] * 9)
            continue
        table.append([row["label"], "ok", fmt_ms(row["step_ms_best"]), fmt_ms(row["step_ms"]),
                      fmt_ms(row["forward_ms"]), fmt_ms(row["backward_ms"]), fmt_ms(row["optimizer_ms"]),
                      fmt_ms(row["wall_ms"]), fmt_ratio(row.get("vs_fsdp2")), f"{row['final_loss']:.5f}",
                      "anchor" if key == "fsdp2" else "<= 1.0x (fsdp2)"])
    cfg = sec.model
    peak = raw.get("peak_memory_allocated")
    print(format_table([f"FSDP step {precision}, world 1, CUDA", "status", "best ms", "median ms", "fwd", "bwd", "opt",
                        "wall", "÷ FSDP2", "final loss", "target"], table, left=2))
    print(f"GPT {psi / 1e6:.1f}M parameters ({cfg.layers} blocks, d {cfg.d_model}, {cfg.heads} heads, "
          f"vocab {cfg.vocab}), "
          f"batch {cfg.batch} x seq {cfg.seq}, AdamW; {sec.warmup} warm-up + {sec.rounds} interleaved rounds; ms on "
          f"CUDA events (fwd = forward + loss, opt = step + zero_grad), wall = host clock until every stream is idle"
          + (f"; peak allocated {peak / (1 << 30):.1f} GiB (both models)" if peak else "")
          + f"; shardkit's CUDA route: {raw.get('shardkit_cuda_route')}")
    fsdp_targets(checks, precision, rows["shardkit"])


def fsdp_targets(checks: list[dict], precision: str, ours: dict[str, Any]) -> None:
    """The step-time target and the final-loss guard of one precision (SKIP where not measured)."""
    add_target(checks, f"{precision}: shardkit FSDP FULL_SHARD step ÷ torch FSDP2 on NCCL (medians)",
               ours.get("vs_fsdp2"), 1.0, higher_is_better=False, unit="x")
    paired = ours.get("vs_fsdp2_paired")
    if paired:
        print(f"       per-round median {paired['median']:.3f}x, middle half {paired['q1']:.3f}-{paired['q3']:.3f}x; "
              f"best ÷ best {ours['vs_fsdp2_best']:.3f}x")
    rel = ours.get("final_loss_rel_diff")
    status = "SKIP" if rel is None else "PASS" if rel <= LOSS_RTOL[precision] else "MISS"  # NaN counts as MISS
    checks.append({"target": f"{precision}: FSDP final loss agrees with FSDP2's (rel. <= {LOSS_RTOL[precision]:g})",
                   "status": status, "value": rel, "limit": LOSS_RTOL[precision]})
    print(f"[{status}] {checks[-1]['target']}: {'not measured' if rel is None else f'{rel:.2e}'}")


# --- main ---------------------------------------------------------------------------------------------------------

SECTIONS = ("kernels", "powersgd", "fsdp")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--mb", type=int, default=256, help="MiB of f32 moved by the bandwidth rows")
    parser.add_argument("--rounds", type=int, default=50, help="timed runs of each kernel row")
    parser.add_argument("--psgd-warmup", type=int, default=3, help="powersgd warm-up rounds (2 steps each)")
    parser.add_argument("--psgd-rounds", type=int, default=20, help="powersgd timed rounds")
    parser.add_argument("--fsdp-warmup", type=int, default=5, help="fsdp warm-up rounds")
    parser.add_argument("--fsdp-rounds", type=int, default=30, help="fsdp timed rounds")
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                        help="fsdp precisions")
    for name in ("vocab", "d_model", "heads", "layers", "seq", "batch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(GPU_GPT, name),
                            help=f"fsdp GPT {name} (default {getattr(GPU_GPT, name)})")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_kernels.json")
    args = parser.parse_args(argv)
    if args.psgd_warmup < 2 or min(args.psgd_rounds, args.fsdp_warmup, args.fsdp_rounds, args.rounds) < 1:
        parser.error(f"--psgd-warmup must be >= 2 (4 steps: PowerSGD compresses from iteration {PSGD_START}, and "
                     "its first compressed step allocates); every --*rounds and --fsdp-warmup >= 1")
    return args


def run_section(name: str, fn, sec: Section) -> tuple[dict[str, Any] | None, str | None]:
    """``fn`` in one fresh spawned process (world 1); its result, or why there is none."""
    print(f"\n=== {name} ===", flush=True)
    try:
        return launch_ranks(fn, 1, sec, timeout=1800.0, env={"OMP_NUM_THREADS": "4"})[0], None
    except RanksFailed as error:
        print(f"{name}: the section failed:\n{error}", file=sys.stderr, flush=True)
        return None, str(error).strip().splitlines()[-1][:300]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shardkit import _C

    if not (_C.with_cuda and torch.cuda.is_available()):
        print("gpu_kernels: needs a CUDA GPU and shardkit's CUDA build (SHARDKIT_CUDA=1)", file=sys.stderr)
        return 2
    print(f"shardkit GPU benchmark — {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, sections {' '.join(args.sections)}", flush=True)
    payload: dict[str, Any] = {"machine": machine_info(), "gpu": torch.cuda.get_device_name()}
    checks: list[dict] = []
    failed: list[str] = []
    if "kernels" in args.sections:
        bandwidth = bandwidth_rows(args.mb, args.rounds)
        orthogonalize = orthogonalize_rows(args.rounds)
        print(format_table(["kernel", "ms", "GB/s", "÷ copy"],
                           [[r["kernel"], f"{r['ms']:.3f}", f"{r['gb_per_s']:.0f}", f"{r['of_copy']:.2f}"]
                            for r in bandwidth]))
        print(format_table(["orthogonalize 1024 x (1024 x 4) f32", "ms", "speed-up"],
                           [[r["kernel"], f"{r['ms']:.3f}", f"{r['speedup']:.2f}x"] for r in orthogonalize]))
        for row in bandwidth[1:6]:
            add_target(checks, f"{row['kernel']} bandwidth ÷ device copy", row["of_copy"], 0.8,
                       higher_is_better=True, unit="x")
        add_target(checks, "orthogonalize speed-up over torch", orthogonalize[1]["speedup"], 2.0,
                   higher_is_better=True, unit="x")
        payload.update(bandwidth=bandwidth, orthogonalize=orthogonalize)
        torch.cuda.empty_cache()  # the sections below run in their own processes, on the same GPU
    if "powersgd" in args.sections:
        sec = Section(warmup=args.psgd_warmup, rounds=args.psgd_rounds)
        raw, error = run_section("powersgd", psgd_section, sec)
        if raw is None:
            failed.append("powersgd")
            payload["powersgd"] = {"error": error, "rows": []}
            for c in PSGD_CONFIGS:
                if c.target:
                    add_target(checks, psgd_target_name(c), None, 0.5, higher_is_better=False, unit="x")
        else:
            rows = summarize_psgd(raw)
            report_psgd(raw, rows, checks)
            payload["powersgd"] = {
                "config": {"layers_in_out": raw["layers_in_out"], "n_params": raw["n_params"], "batch": PSGD_BATCH,
                           "matrix_approximation_rank": PSGD_RANK, "start_powerSGD_iter": PSGD_START,
                           "optimizer": f"SGD lr {PSGD_LR}", "warmup_rounds": sec.warmup, "timed_rounds": sec.rounds,
                           "torch_group": TORCH_BACKEND, "shardkit_cuda_route": raw["shardkit_cuda_route"],
                           "compression": raw["compression"]},
                "rows": list(rows.values()), "error": None}
    if "fsdp" in args.sections:
        model = ModelConfig(**{name: getattr(args, name) for name in ("vocab", "d_model", "heads", "layers", "seq",
                                                                      "batch")})
        sec = Section(warmup=args.fsdp_warmup, rounds=args.fsdp_rounds, precisions=tuple(args.precision),
                      model=model)
        psi = n_params(model)
        raw, error = run_section("fsdp", fsdp_section, sec)
        fsdp: dict[str, Any] = {"config": {"model": dataclasses.asdict(model), "n_params": psi, "lr": FSDP_LR,
                                           "optimizer": "AdamW", "warmup_rounds": sec.warmup,
                                           "timed_rounds": sec.rounds, "torch_group": TORCH_BACKEND}}
        if raw is None:
            failed.append("fsdp")
            fsdp["error"], fsdp["results"] = error, {}
            for precision in sec.precisions:
                fsdp_targets(checks, precision, {})
        else:
            fsdp["config"]["shardkit_cuda_route"] = raw["shardkit_cuda_route"]
            fsdp["results"], fsdp["error"] = {}, None
            for precision in sec.precisions:
                rows = summarize_fsdp(raw[precision], sec)
                report_fsdp(precision, {**raw[precision], "shardkit_cuda_route": raw["shardkit_cuda_route"]}, rows,
                            sec, psi, checks)
                fsdp["results"][precision] = {"rows": list(rows.values()),
                                              "peak_memory_allocated": raw[precision]["peak_memory_allocated"]}
        payload["fsdp"] = fsdp
    payload["targets"] = checks
    # A run of some sections keeps the other sections' results (and their targets) in the file.
    save_results(args.out, payload, {"targets": lambda t: t["target"]})
    print(wrote(args.out))
    if failed:
        print(f"gpu_kernels: section(s) failed: {', '.join(failed)} (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

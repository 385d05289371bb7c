"""PowerSGD comm hook: shardkit's C++ hook vs torch's Python hook — hook time, bytes, end-to-end step.

    python benchmarks/powersgd.py                # worlds 1, 2, 4; rank 2 (~3 minutes on 2 cores)
    python benchmarks/powersgd.py --worlds 2 --rounds 20
    python benchmarks/powersgd.py --worlds 1 2 --rounds 1 --out /tmp/psgd   # smoke test, ~30 s

One job of spawned ranks per world size, default group "shardkit". Every configuration wraps its own copy
of one model (Linear 1024x1024, 1024x1024, 1024x4096, 4096x1024 with biases: 10.5M parameters) in torch's
DDP, all fed the same per-rank batches, stepped in interleaved rounds (round r starts at configuration
r mod K), after warm-up rounds (PowerSGD starts at iteration 2, so warm-up covers the switch):

  plain    torch DDP, no hook (allreduce)                        end-to-end anchor
  torch    torch DDP + torch's powerSGD_hook                     the hook-time anchor
  shardkit torch DDP + shardkit.hooks.powerSGD_hook              (Python entry, C++ work)
  native   torch DDP + shardkit.hooks.register(..., "powersgd")  (no Python per bucket)
  torch_b / shardkit_b   the same for batched_powerSGD_hook (torch's needs its 2-D orthogonalisation fixed,
           see tests/python/test_hooks.py; the fix is applied here too)

Hook time: the hook wrapped in a timer that waits for its future (same wrapper for torch's and shardkit's
Python hooks), summed over the buckets of a step, slowest rank, median over rounds. Step time: forward +
backward + SGD step after a barrier, slowest rank, median. "Equal output": the gradients of torch's and
shardkit's configurations are compared after every step (max |diff|). Bytes per step: shardkit's
compression_stats() against the formula sum over compressed matrices of (n + m)*r plus the uncompressed
elements, times 4 bytes.

Results: benchmarks/results/powersgd.{json,png} (``--out DIR`` writes them to DIR instead). Rank 0 reports each
round on stderr as it goes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _common import format_table, plot_bar_panels
from _harness import (
    RESULTS_DIR,
    header,
    init_groups,
    interleaved_rounds,
    launch_ranks,
    machine_info,
    rank0_progress,
    write_json,
    wrote,
)

RANK = 2
START = 2
BATCH = 16


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def expected_elements(module: nn.Module, rank: int) -> tuple[int, int]:
    """Elements per step before and after compression, by the formula (torch's compression rule)."""
    before = after = 0
    for p in module.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        before += n * m
        after += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return before, after


def timed(hook, times: list[float]):
    def wrapper(state, bucket):  # no annotations: torch checks them as objects, and this module defers them
        t0 = time.perf_counter()
        future = hook(state, bucket)
        future.wait()
        times.append(time.perf_counter() - t0)
        return future

    wrapper.__name__ = wrapper.__qualname__ = f"timed_{hook.__name__}"
    return wrapper


def _rank(rank: int, world: int, store: str, rounds: int, warmup: int) -> dict[str, Any]:
    import shardkit.hooks as H

    init_groups(rank, world, store, 300, gloo=False)
    original = torch_psgd._orthogonalize
    torch_psgd._orthogonalize = lambda m, epsilon=0: original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    base = model()
    options = dict(matrix_approximation_rank=RANK, start_powerSGD_iter=START)
    configs: dict[str, Any] = {}
    hook_times: dict[str, list[float]] = {}

    def add(name, hook=None, state=None, native=None):
        ddp = TorchDDP(copy.deepcopy(base))
        if hook is not None:
            hook_times[name] = []
            ddp.register_comm_hook(state, timed(hook, hook_times[name]))
        if native is not None:
            H.register(ddp, native, "powersgd")
        configs[name] = {"ddp": ddp, "opt": torch.optim.SGD(ddp.parameters(), lr=1e-3), "state": state or native,
                         "step_s": [], "hook_s": []}

    add("plain")
    add("torch", torch_psgd.powerSGD_hook, torch_psgd.PowerSGDState(None, **options))
    add("shardkit", H.powerSGD_hook, H.PowerSGDState(None, **options))
    add("native", native=H.PowerSGDState(None, **options))
    add("torch_b", torch_psgd.batched_powerSGD_hook, torch_psgd.PowerSGDState(None, **options))
    add("shardkit_b", H.batched_powerSGD_hook, H.PowerSGDState(None, **options))
    names = list(configs)
    progress = rank0_progress(rank, prefix=f"world {world}: ")
    progress(f"built {len(names)} configurations; {warmup} warm-up + {rounds} timed rounds")
    worst_diff = {"shardkit": 0.0, "native": 0.0, "shardkit_b": 0.0}
    gloo = dist.new_group(backend="gloo")
    for round_index, order, timed_round in interleaved_rounds(names, warmup, rounds, progress, label="round"):
        g = torch.Generator().manual_seed(1000 * rank + round_index)
        x, y = torch.randn(BATCH, 1024, generator=g), torch.randn(BATCH, 1024, generator=g)
        for name in order:
            c = configs[name]
            if name in hook_times:
                hook_times[name].clear()
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            c["opt"].zero_grad()
            nn.functional.mse_loss(c["ddp"](x), y).backward()
            grads = [p.grad.clone() for p in c["ddp"].parameters()] if name in worst_diff or name in (
                "torch", "torch_b") else None
            c["opt"].step()
            elapsed = time.perf_counter() - t0
            if timed_round:
                c["step_s"].append(elapsed)
                c["hook_s"].append(sum(hook_times.get(name, [])))
            c["grads"] = grads
        for ours, ref in (("shardkit", "torch"), ("native", "torch"), ("shardkit_b", "torch_b")):
            diff = max((a - b).abs().max().item() for a, b in zip(configs[ours]["grads"], configs[ref]["grads"]))
            worst_diff[ours] = max(worst_diff[ours], diff)
    stats = configs["shardkit"]["state"].compression_stats()
    steps_compressed = warmup + rounds - START
    out = {"step_s": {n: c["step_s"] for n, c in configs.items()},
           "hook_s": {n: c["hook_s"] for n, c in configs.items() if n in hook_times},
           "worst_grad_diff": worst_diff,
           "elements_per_step": (stats[1] // steps_compressed, stats[2] // steps_compressed),
           "expected_elements": expected_elements(base, RANK)}
    torch_psgd._orthogonalize = original
    return out


def slowest_median(per_rank: list[list[float]]) -> float:
    return statistics.median(max(values) for values in zip(*per_rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4],
                        help="world sizes, one job of spawned ranks each (default: 1 2 4)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (default: 8)")
    parser.add_argument("--warmup", type=int, default=3,
                        help=f"untimed rounds first (≥ {START}: PowerSGD starts at iteration {START})")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for powersgd.json/png")
    args = parser.parse_args()
    if args.warmup < START or args.rounds < 1:
        raise SystemExit(f"--warmup must be ≥ {START} (PowerSGD starts at iteration {START}) and --rounds ≥ 1")
    info = machine_info()
    print(header("PowerSGD hook benchmark", info, f"rank {RANK}, model 10.5M parameters, batch {BATCH}/rank"))
    results: dict[str, Any] = {"machine": info, "matrix_approximation_rank": RANK, "worlds": {}}
    checks = []
    rows = []
    for world in args.worlds:
        per_rank = launch_ranks(_rank, world, args.rounds, args.warmup, timeout=900)
        step = {n: slowest_median([r["step_s"][n] for r in per_rank]) for n in per_rank[0]["step_s"]}
        hook = {n: slowest_median([r["hook_s"][n] for r in per_rank]) for n in per_rank[0]["hook_s"]}
        diff = {k: max(r["worst_grad_diff"][k] for r in per_rank) for k in per_rank[0]["worst_grad_diff"]}
        elements, expected = per_rank[0]["elements_per_step"], per_rank[0]["expected_elements"]
        results["worlds"][world] = {"step_s": step, "hook_s": hook, "worst_grad_diff": diff,
                                    "elements_per_step": elements, "expected_elements": expected}
        for kind, ours, ref in (("plain", "shardkit", "torch"), ("batched", "shardkit_b", "torch_b")):
            ratio = hook[ours] / hook[ref]
            rows.append([str(world), kind, f"{hook[ref] * 1e3:.1f}", f"{hook[ours] * 1e3:.1f}", f"{ratio:.3f}×",
                         f"{diff[ours]:.2g}"])
            checks.append({"world": world, "kind": kind, "ratio": ratio, "pass": ratio <= 0.5})
        print(f"world {world}: step ms — " + ", ".join(f"{n} {s * 1e3:.0f}" for n, s in step.items()) +
              f"; native ÷ torch hook step {step['native'] / step['torch']:.3f}×")
        print(f"world {world}: elements per step {elements[0]:,} → {elements[1]:,} (formula {expected[0]:,} → "
              f"{expected[1]:,}: {'exact' if tuple(elements) == tuple(expected) else 'DIFFERS'}), "
              f"{elements[0] * 4 / 2 ** 20:.1f} MiB → {elements[1] * 4 / 2 ** 20:.2f} MiB")
    print(format_table(["world", "hook", "torch ms", "shardkit ms", "÷ torch", "max |Δgrad|"], rows))
    for c in checks:
        print(f"[{'PASS' if c['pass'] else 'MISS'}] world {c['world']} {c['kind']}: shardkit hook ≤ 0.5× torch's: "
              f"{c['ratio']:.3f}×")
    results["checks"] = checks
    path = write_json(args.out / "powersgd.json", results)
    panels = {f"world {w}": (["plain", "batched"], {"torch": [r["hook_s"]["torch"] * 1e3, r["hook_s"]["torch_b"] * 1e3],
                                                   "shardkit": [r["hook_s"]["shardkit"] * 1e3,
                                                                r["hook_s"]["shardkit_b"] * 1e3]})
              for w, r in results["worlds"].items()}
    plot_bar_panels(args.out / "powersgd.png", panels, ylabels={k: "hook ms / step" for k in panels},
                    suptitle="PowerSGD hook time per step")
    print(wrote(path))


if __name__ == "__main__":
    main()

"""``python -m shardkit scale``: run a training script at several world sizes and strategies, and report how it
scales.

    python -m shardkit scale --worlds 1 2 4 --strategies ddp zero2 fsdp -- examples/train_gpt.py --steps 20

For every (strategy, world size) the script runs under ``torchrun --standalone --nproc_per_node=N`` with
``--strategy S --json`` appended to its arguments (``--strategy`` left out when no strategies are given). It
must print, on rank 0, one JSON line per step with ``tokens_per_s`` (and may print a final ``{"summary": {...}}``
with ``held_bytes`` and ``peak_rss_bytes`` per rank), as examples/train_gpt.py does.

Reported per run: throughput (the median of the steps' tokens/s, the first ``--skip`` steps left out as
warm-up), scaling efficiency E(N) = throughput(N) / (N * throughput(1)) -- the users' guides' acid test
T_1 * N / T_N for a fixed per-rank batch: near 1.0 the ranks add their full speed, well below it the run is
communication-bound -- and per-rank memory (held model-state bytes and peak RSS, the largest rank's). As a
table on stdout, ``scale.json`` and, with matplotlib installed, ``scale.png`` in ``--out``. A run that fails is
reported with the tail of its output, and the others still run.

Every rank of every run gets the same number of threads (``--threads-per-rank``, default: the cores divided by the
largest world size), set as ``OMP_NUM_THREADS``: torchrun leaves a one-rank job torch's default (every core) and
sets one thread per rank for larger ones, and an efficiency against a one-rank run with more threads measures
threads, not scaling. An efficiency outside [0, 1.1] is warned about: a run that scales better than linearly did
different work per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=None,
                        help="world sizes (default: 1, 2 and the number of CPU cores)")
    parser.add_argument("--strategies", nargs="+", default=[],
                        help="values for the script's --strategy (default: run the script as it is)")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the throughput")
    parser.add_argument("--threads-per-rank", type=int, default=None,
                        help="OMP_NUM_THREADS of every rank at every world size (default: cores / largest world)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for scale.json and scale.png")
    parser.add_argument("script", type=Path, help="the training script (after --)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=main)


def default_worlds() -> list[int]:
    cores = os.cpu_count() or 1
    return sorted({1, 2, cores})


def default_threads_per_rank(worlds: list[int]) -> int:
    return max(1, (os.cpu_count() or 1) // max(worlds))


EFFICIENCY_RANGE = (0.0, 1.1)  # outside it the runs did not do the same work per rank


def run_one(script: Path, args: list[str], world: int, strategy: str | None, timeout: float,
            threads_per_rank: int = 1) -> dict[str, Any]:
    """One torchrun job (every rank with ``threads_per_rank`` threads): its per-step records and summary, or its
    failure."""
    extra = ["--strategy", strategy] if strategy else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(script),
           *args, *extra, "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    steps, summary = [], None
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "summary" in record:
            summary = record["summary"]
        elif "tokens_per_s" in record:
            steps.append(record)
    if done.returncode != 0 or not steps:
        why = f"exit code {done.returncode}" if done.returncode else "no JSON step lines on stdout"
        output = done.stderr or done.stdout
        # The script's own complaint (argparse's "error:", an exception line) comes before torchrun's summary.
        first = next((line.strip() for line in output.splitlines()
                      if "error:" in line.lower() or line.startswith(("Traceback", "RuntimeError", "ValueError"))), "")
        return {"error": f"{why}: {first}\n{output[-800:]}"}
    return {"steps": steps, "summary": summary}


def throughput(steps: list[dict[str, Any]], skip: int) -> float:
    timed = steps[skip:] if len(steps) > skip else steps[-1:]
    return statistics.median(step["tokens_per_s"] for step in timed)


def main(args: argparse.Namespace) -> int:
    script_args = [a for a in args.script_args if a != "--"]
    worlds = args.worlds or default_worlds()
    if any(w < 1 for w in worlds):
        print(f"shardkit scale: error: world sizes must be >= 1, got {worlds}", file=sys.stderr)
        return 2
    if not args.script.is_file():
        print(f"shardkit scale: error: no script at {args.script}", file=sys.stderr)
        return 2
    threads = default_threads_per_rank(worlds) if args.threads_per_rank is None else args.threads_per_rank
    if threads < 1:
        print(f"shardkit scale: error: --threads-per-rank must be >= 1, got {threads}", file=sys.stderr)
        return 2
    rows = []
    for strategy in args.strategies or [None]:
        base = None
        for world in sorted(worlds):
            print(f"running {args.script.name} at world {world}{f' with --strategy {strategy}' if strategy else ''} …",
                  file=sys.stderr, flush=True)
            result = run_one(args.script, script_args, world, strategy, args.timeout, threads)
            row: dict[str, Any] = {"strategy": strategy or "-", "world": world}
            if "error" in result:
                row["error"] = result["error"]
            else:
                row["tokens_per_s"] = throughput(result["steps"], args.skip)
                if world == 1:
                    base = row["tokens_per_s"]
                row["efficiency"] = row["tokens_per_s"] / (world * base) if base else None
                low, high = EFFICIENCY_RANGE
                if row["efficiency"] is not None and not low <= row["efficiency"] <= high:
                    row["warning"] = (f"efficiency {row['efficiency']:.2f} at world {world} is outside [{low:g}, "
                                      f"{high:g}]: the runs did not do the same work per rank (threads, batch or "
                                      "steps per rank differ?)")
                    print(f"shardkit scale: warning: {row['warning']}", file=sys.stderr, flush=True)
                summary = result["summary"] or {}
                row["held_bytes"] = max(summary.get("held_bytes") or [0]) or None
                row["peak_rss_bytes"] = max(summary.get("peak_rss_bytes") or [0]) or None
                row["threads"] = summary.get("threads")  # as the script reports torch's, where it does
            rows.append(row)
    print(format_table(rows))
    print(f"threads per rank: {threads} (OMP_NUM_THREADS, the same at every world size)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps({"script": str(args.script), "args": script_args,
                                                     "threads_per_rank": threads, "rows": rows}, indent=1) + "\n")
    png = plot(rows, args.out / "scale.png")
    print(f"wrote {args.out / 'scale.json'}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    return 1 if any("error" in row for row in rows) else 0


def format_table(rows: list[dict[str, Any]]) -> str:
    mib = 1 << 20
    lines = [f"{'strategy':<10} {'world':>5} {'tokens/s':>10} {'efficiency':>10} {'held MiB/rank':>13} "
             f"{'peak RSS MiB':>12}"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['strategy']:<10} {row['world']:>5}  failed: {row['error'].splitlines()[0][:80]}")
            continue
        eff = f"{row['efficiency']:.2f}" if row["efficiency"] is not None else "-"
        eff += "!" if "warning" in row else ""
        held = f"{row['held_bytes'] / mib:.1f}" if row["held_bytes"] else "-"
        rss = f"{row['peak_rss_bytes'] / mib:.0f}" if row["peak_rss_bytes"] else "-"
        lines.append(f"{row['strategy']:<10} {row['world']:>5} {row['tokens_per_s']:>10.0f} {eff:>10} {held:>13} "
                     f"{rss:>12}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (speed, eff) = plt.subplots(1, 2, figsize=(10, 4))
    top_efficiency = 1.2
    for strategy in dict.fromkeys(row["strategy"] for row in rows):
        ok = [row for row in rows if row["strategy"] == strategy and "error" not in row]
        worlds = [row["world"] for row in ok]
        speed.plot(worlds, [row["tokens_per_s"] for row in ok], marker="o", label=strategy)
        efficiencies = [row["efficiency"] or 0 for row in ok]
        eff.plot(worlds, efficiencies, marker="o", label=strategy)
        top_efficiency = max([top_efficiency, *(1.1 * e for e in efficiencies)])
    ranks = sorted({row["world"] for row in rows})
    for axes in (speed, eff):
        axes.set_xticks(ranks)  # whole ranks only
        axes.set_xlim(0, max(ranks) + 0.5)
    speed.set(xlabel="ranks", ylabel="tokens/s", title="throughput")
    speed.set_ylim(bottom=0)
    eff.set(xlabel="ranks", ylabel="throughput / (N x one rank's)", title="scaling efficiency",
            ylim=(0, top_efficiency))  # a value out of range stays visible (and was warned about)
    eff.axhline(1.0, color="grey", linewidth=0.5)
    speed.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

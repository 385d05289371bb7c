"""FSDP training across real (namespace) hosts over shaped links: torch FSDP2 on gloo, shardkit.fully_shard exact, and
shardkit.fully_shard with int8 bytes between hosts (shardkit.Quantized); then exact against int8 over a longer run.

    python benchmarks/hosts_train.py                      # 2 hosts x 2 ranks at 1 Gbit/s, ~30M GPT; loss run, 300 steps
    python benchmarks/hosts_train.py --skip-loss --rounds 3
    python benchmarks/hosts_train.py --skip-bed --loss-steps 100

Needs root for the bed (tests/python/support/hostbed.py): ``--hosts`` namespace hosts on one bridge, each link shaped
to ``--rate`` Mbit/s both ways; on every host torchrun starts ``--ranks-per-host`` ranks of
benchmarks/_hosts_train_rank.py (gloo bound to the host's link, rendezvous on host 0, OMP_NUM_THREADS=1). Each rank
trains its own copy of the same seeded GPT (benchmarks/_gpt.py), fully_shard per block + root, reshard_after_forward
(FULL_SHARD), fp32, AdamW lr 1e-3, on the same synthetic tokens, in three configurations:

  a  torch FSDP2 (torch.distributed.fsdp.fully_shard)        mesh DeviceMesh.from_group(gloo group)   the anchor
  b  shardkit.fully_shard                                     mesh over the shardkit default group     exact
  c  shardkit.fully_shard(comm=shardkit.Quantized(weights="int8", grads="int8", block=256))          int8 between hosts

Step time: warm-up rounds (the first builds each configuration), then ``--rounds`` timed rounds; round r steps every
configuration once, starting at configuration r mod 3, each after a barrier, so drift on this shared machine hits all
alike. A step is forward + loss + backward + optimizer.step + zero_grad; its time is the slowest rank's; medians over
rounds, and the median of the per-round ratios. Bytes per step: what each rank sent to other hosts
(shardkit.backend.inter_host_bytes, for b and c), and what each host's link sent (its interface's tx_bytes, headers
included; every configuration, gloo's too). Per step FULL_SHARD moves the parameters across hosts three times: the
forward's all-gather, the backward's (reshard_after_forward), and the gradients' reduce-scatter, each
(H-1)/H of the model's f32 bytes per host: the "exact bound" column is that over the link rate.

The loss run (``--loss-*``, unshaped): b and c side by side for ``--loss-steps`` steps of a smaller GPT, all ranks on
this machine under one torchrun, split into simulated hosts (SHARDKIT_HOST_ID): the same hierarchical engine and
wire format as on the bed, without the links' wait. The data is a seeded synthetic chain a model can learn (each token
has 4 possible successors: the loss can fall from ln(vocab) to ln 4), so a drift of int8 against exact would show.
Compared: the mean of the last 10 steps' losses, c against b (relative), and the largest gap along the way.

On this 2-core machine every rank of every host shares the same two cores, so the step times hold the ranks' compute
(serialised four ranks to two cores) as well as the link: the ratios, not the absolute times, are the result.

Results: ``benchmarks/results/hosts_train.json`` and the loss curves ``benchmarks/results/hosts_train_loss.png``.
A run with --skip-bed or --skip-loss keeps the other part's results in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from _common import Series, format_table, plot_panels  # noqa: E402  (the benchmarks folder is not a package)
from _gpt import ModelConfig, n_params  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    add_target,
    bed_run,
    header,
    load_note,
    machine_info,
    merge_results,
    round_ratios,
    write_json,
    wrote,
)
from support.hostbed import unavailable  # noqa: E402

RANK_SCRIPT = Path(__file__).resolve().parent / "_hosts_train_rank.py"
KEYS = ("a", "b", "c")
LABELS = {"a": "torch FSDP2 / gloo", "b": "shardkit.fully_shard, exact", "c": "shardkit.fully_shard, int8"}
MiB = 1 << 20
LAST = 10  # the final loss: the mean of the last LAST steps


def rank_command(out: Path, mode: str, cfg: ModelConfig, extra: list[str]) -> list[str]:
    return [str(RANK_SCRIPT), str(out), "--mode", mode, "--model", json.dumps(dataclasses.asdict(cfg)), *extra]


def run_bed(args: argparse.Namespace, cfg: ModelConfig, work: Path) -> dict[str, Any]:
    """The timed run on a fresh bed; the rank script's JSON."""
    out = work / "bed.json"
    script = rank_command(out, "time", cfg, ["--warmup", str(args.warmup), "--rounds", str(args.rounds)])
    return bed_run(script, out, hosts=args.hosts, ranks_per_host=args.ranks_per_host, rate_mbit=args.rate,
                   timeout=args.timeout, logs=work / "logs-bed", what="hosts_train.py: the bed run")


def run_loss(args: argparse.Namespace, cfg: ModelConfig, work: Path) -> dict[str, Any]:
    """The loss run: one torchrun on this machine, its ranks split into simulated hosts."""
    out = work / "loss.json"
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_HOST_ID"}
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.hosts * args.ranks_per_host}",
               *rank_command(out, "loss", cfg, ["--steps", str(args.loss_steps), "--keys", "b", "c",
                                                "--simulate-hosts", str(args.hosts)])]
    # stderr passes through: rank 0's progress every 25 steps, and the story of a failure
    done = subprocess.run(command, env=env, timeout=args.timeout, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"hosts_train.py: the loss run failed (exit {done.returncode}); its output:\n"
                           f"{done.stdout[-6000:]}")
    return json.loads(out.read_text())


def exact_bound_s(psi: int, hosts: int, rate_mbit: float) -> float:
    """A FULL_SHARD step's exact bytes across a host's link over the rate: two all-gathers and a reduce-scatter of
    the f32 parameters, each (H-1)/H of them per host."""
    return 3 * 4 * psi * (hosts - 1) / hosts / (rate_mbit * 1e6 / 8)


def summarize_bed(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per configuration: step-time statistics, bytes per step, the loss after the run's steps; and c's ratios."""
    rows: dict[str, Any] = {}
    for k in KEYS:
        d = data[k]
        sent = [max(r) for r in d["inter_host_bytes_by_rank"]] if k != "a" else None
        rows[k] = {"label": LABELS[k], "step_s": statistics.median(d["step_s"]), "step_s_best": min(d["step_s"]),
                   "step_s_samples": d["step_s"],
                   # bytes are the same every step (the sizes fix them): the median guards against a stray one
                   "inter_host_bytes_rank0": statistics.median(r[0] for r in d["inter_host_bytes_by_rank"])
                   if sent else None,
                   "inter_host_bytes_max_rank": statistics.median(sent) if sent else None,
                   "link_tx_bytes_by_host": [statistics.median(r[h] for r in d["link_tx_bytes_by_host"])
                                             for h in range(args.hosts)],
                   "final_loss": d["loss"][-1], "loss": d["loss"]}

    def paired(num: str, den: str) -> float:
        return statistics.median(round_ratios(rows[num]["step_s_samples"], rows[den]["step_s_samples"]))

    ratios = {f"{n}/{d}": {"medians": rows[n]["step_s"] / rows[d]["step_s"], "per_round_median": paired(n, d)}
              for n, d in (("c", "a"), ("c", "b"), ("b", "a"))}
    wire = rows["c"]["inter_host_bytes_max_rank"] / rows["b"]["inter_host_bytes_max_rank"]
    links = [rows[k]["link_tx_bytes_by_host"] for k in ("b", "c")]
    link = max(links[1]) / max(links[0]) if min(links[0] + links[1]) >= 0 else None  # -1: not readable
    return {"rows": rows, "ratios": ratios, "inter_host_bytes_c_over_b": wire, "link_tx_bytes_c_over_b": link}


def print_bed(summary: dict[str, Any], data: dict[str, Any], args: argparse.Namespace) -> None:
    rows, psi = summary["rows"], data["n_params"]
    bound = exact_bound_s(psi, args.hosts, args.rate)
    table = []
    for k, row in rows.items():
        sent = "-" if row["inter_host_bytes_rank0"] is None else \
            f"{row['inter_host_bytes_rank0'] / MiB:.1f} / {row['inter_host_bytes_max_rank'] / MiB:.1f}"
        link = " / ".join("-" if x < 0 else f"{x / MiB:.1f}" for x in row["link_tx_bytes_by_host"])
        table.append([f"({k}) {row['label']}", f"{row['step_s_best']:.3f}", f"{row['step_s']:.3f}",
                      f"{row['step_s'] / bound:.2f}×", f"{row['step_s'] / rows['a']['step_s']:.3f}",
                      f"{row['step_s'] / rows['b']['step_s']:.3f}", sent, link, f"{row['final_loss']:.4f}"])
    print(f"\n=== {args.hosts} hosts x {args.ranks_per_host} ranks, links {args.rate:g} Mbit/s: step time (s; slowest "
          f"rank; best and median of {args.rounds} interleaved rounds after {args.warmup} warm-up) ===")
    print(format_table(["configuration", "best", "median", "÷ exact bound", "÷ (a)", "÷ (b)",
                        "inter-host MiB/step r0 / max rank", "link tx MiB/step per host", f"loss @ {data['steps']}"],
                       table, left=1))
    print(f"exact bound: 3 × 4Ψ × (H-1)/H over the link = {bound:.3f} s (Ψ = {psi:,}); inter-host: "
          f"shardkit.backend.inter_host_bytes per rank; link tx: the host interface's bytes (headers included)")
    for name, r in summary["ratios"].items():
        print(f"step time {name}: {r['medians']:.3f}× (ratio of medians), per-round median "
              f"{r['per_round_median']:.3f}×")
    link = summary["link_tx_bytes_c_over_b"]
    print(f"bytes per step c/b: inter-host {summary['inter_host_bytes_c_over_b']:.4f} (largest rank), link tx "
          + ("-" if link is None else f"{link:.4f}") + " (busier host)")


def summarize_loss(data: dict[str, Any]) -> dict[str, Any]:
    b, c = data["b"]["loss"], data["c"]["loss"]
    final_b, final_c = statistics.fmean(b[-LAST:]), statistics.fmean(c[-LAST:])
    gaps = [abs(y - x) / abs(x) for x, y in zip(b, c)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"steps": len(b), "first_loss": b[0], "final_loss_exact": final_b, "final_loss_int8": final_c,
            "final_rel_diff": (final_c - final_b) / abs(final_b), "max_rel_gap": gaps[worst],
            "max_rel_gap_step": worst + 1, "floor": math.log(data["fanout"]),
            "loss_exact": b, "loss_int8": c}


def print_loss(summary: dict[str, Any], data: dict[str, Any]) -> None:
    cfg = data["model"]
    print(f"\n=== loss, exact (b) vs int8 (c): {summary['steps']} steps, {data['world']} ranks as "
          f"{len(set(data['host_of']))} simulated hosts (unshaped), GPT Ψ = {data['n_params']:,} (d_model "
          f"{cfg['d_model']}, {cfg['layers']} blocks, vocab {cfg['vocab']}, batch {cfg['batch']} × seq {cfg['seq']} "
          f"per rank) ===")
    b, c = summary["loss_exact"], summary["loss_int8"]
    marks = sorted({1, 10, 50, 100, 200, summary["steps"]} & set(range(1, summary["steps"] + 1)))
    table = [[str(s), f"{b[s - 1]:.4f}", f"{c[s - 1]:.4f}", f"{(c[s - 1] - b[s - 1]) / abs(b[s - 1]):+.2e}"]
             for s in marks]
    table.append([f"mean of last {LAST}", f"{summary['final_loss_exact']:.4f}", f"{summary['final_loss_int8']:.4f}",
                  f"{summary['final_rel_diff']:+.2e}"])
    print(format_table(["step", "exact (b)", "int8 (c)", "rel. diff"], table, left=1))
    print(f"largest relative gap along the run: {summary['max_rel_gap']:.2e} at step {summary['max_rel_gap_step']}; "
          f"start ln(vocab) = {math.log(cfg['vocab']):.3f}, floor ln {data['fanout']} = {summary['floor']:.3f}")


def plot_loss(summary: dict[str, Any], data: dict[str, Any], path: Path) -> Path | None:
    steps = list(range(1, summary["steps"] + 1))
    b, c = summary["loss_exact"], summary["loss_int8"]
    return plot_panels(path, {
        "loss (mean over ranks)": [Series("(b) exact", steps, b, "b", marker=""),
                                   Series("(c) int8 between hosts", steps, c, "c", linestyle="--", marker="")],
        "int8 − exact": [Series("(c) − (b)", steps, [y - x for x, y in zip(b, c)], "c", marker="")],
    }, xlabel="step", ylabel="loss", loglog=False,
        suptitle=f"shardkit.fully_shard, exact vs int8 between hosts: GPT Ψ = {data['n_params'] / 1e6:.2f}M, "
                 f"{data['world']} ranks on {len(set(data['host_of']))} simulated hosts")


def report_load(what: str, cores: float | None, machine: dict[str, Any]) -> None:
    """Other processes' CPU during a run: on 2 cores, a compiler beside the ranks shows in every step time."""
    if (note := load_note(cores, machine, f"the {what}", noisy=" — its times are noisy")):
        print(note)


def targets_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 28's targets, from the (merged) results: the int8 step against torch FSDP2 on gloo (2x faster) and
    against shardkit exact (1.5x faster), on the bed; the int8 run's final loss within 2% of the exact run's."""
    targets: list[dict[str, Any]] = []
    bed, loss = results.get("bed_run") or {}, results.get("loss_run") or {}
    rate = (bed.get("config") or {}).get("rate_mbit")
    ratios = bed.get("ratios") or {}
    for pair, limit, anchor in (("c/a", 0.5, "torch FSDP2 on gloo"), ("c/b", 1 / 1.5, "shardkit.fully_shard exact")):
        value = (ratios.get(pair) or {}).get("medians")
        params = (bed.get("config") or {}).get("n_params") or 0
        add_target(targets, f"2x2 hosts, {rate:g} Mbit/s, {params / 1e6:.1f}M GPT fully_shard step: int8 ÷ {anchor} "
                   f"≤ {limit:.2f}",
                   value, limit, higher_is_better=False, unit="×")
    diff = loss.get("final_rel_diff")
    add_target(targets, f"final loss after {loss.get('steps')} steps: |int8 - exact| ÷ exact ≤ 0.02",
               None if diff is None else abs(diff), 0.02, higher_is_better=False, unit="")
    return targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", type=float, default=1000, help="link rate of the bed, Mbit/s")
    p.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    p.add_argument("--layers", type=int, default=ModelConfig.layers)
    p.add_argument("--vocab", type=int, default=ModelConfig.vocab)
    p.add_argument("--batch", type=int, default=ModelConfig.batch, help="sequences per rank per step")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds on the bed (the first builds)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds on the bed")
    p.add_argument("--loss-steps", type=int, default=300)
    p.add_argument("--loss-d-model", type=int, default=128)
    p.add_argument("--loss-layers", type=int, default=4)
    p.add_argument("--loss-vocab", type=int, default=512)
    p.add_argument("--loss-batch", type=int, default=8)
    p.add_argument("--skip-bed", action="store_true", help="only the loss run")
    p.add_argument("--skip-loss", action="store_true", help="only the bed run")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.rounds < 1:
        raise SystemExit("--warmup and --rounds must be ≥ 1")
    bed_cfg = ModelConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, batch=args.batch)
    loss_cfg = ModelConfig(vocab=args.loss_vocab, d_model=args.loss_d_model, heads=4, layers=args.loss_layers,
                           batch=args.loss_batch)
    if not args.skip_bed:
        why = unavailable()
        if why:
            print(f"hosts_train.py: cannot make namespace hosts here: {why}", file=sys.stderr)
            return 2
    machine = machine_info()
    print(header("hosts_train", machine, f"{args.hosts} hosts x {args.ranks_per_host} ranks, 1 thread per rank"))
    payload: dict[str, Any] = {"benchmark": "hosts_train", "machine": machine}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardkit-hosts-train-") as tmp:
        if not args.skip_bed:
            print(f"bed: GPT Ψ = {n_params(bed_cfg):,} (d_model {bed_cfg.d_model}, {bed_cfg.layers} blocks, vocab "
                  f"{bed_cfg.vocab}, batch {bed_cfg.batch} × seq {bed_cfg.seq} per rank), links {args.rate:g} Mbit/s",
                  flush=True)
            with ForeignLoad() as load:
                data = run_bed(args, bed_cfg, Path(tmp))
            summary = summarize_bed(data, args)
            print_bed(summary, data, args)
            report_load("bed run", load.cores, machine)
            payload["bed_run"] = {"config": {"hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
                                             "rate_mbit": args.rate, "warmup": args.warmup, "rounds": args.rounds,
                                             "model": data["model"], "n_params": data["n_params"]},
                                  "bed": data["bed"], "host_of": data["host_of"],
                                  "exact_bound_s": exact_bound_s(data["n_params"], args.hosts, args.rate),
                                  "foreign_load_cores": load.cores, "machine": machine_info(), **summary}
        if not args.skip_loss:
            print(f"loss run: GPT Ψ = {n_params(loss_cfg):,}, {args.loss_steps} steps of (b) and (c)", flush=True)
            with ForeignLoad() as load:
                data = run_loss(args, loss_cfg, Path(tmp))
            summary = summarize_loss(data)
            print_loss(summary, data)
            report_load("loss run", load.cores, machine)
            png = plot_loss(summary, data, args.out / "hosts_train_loss.png")
            payload["loss_run"] = {"config": {"world": data["world"], "simulated_hosts": args.hosts,
                                              "steps": args.loss_steps, "model": data["model"],
                                              "n_params": data["n_params"], "lr": data["lr"],
                                              "fanout": data["fanout"], "final_loss": f"mean of the last {LAST}"},
                                   "host_of": data["host_of"], "foreign_load_cores": load.cores,
                                   "machine": machine_info(), **summary,
                                   "plot": str(png) if png else None}
    payload["seconds"] = time.monotonic() - started
    path = args.out / "hosts_train.json"
    merged = merge_results(path, payload, {})
    merged["targets"] = targets_of(merged)
    json_path = write_json(path, merged)
    print("\n" + wrote(json_path) + f"; total {payload['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Collectives across real (namespace) hosts over shaped links: shardkit's hierarchical engine (rails, and the
leader scheme) against torch's gloo, each beside the link bound.

    python benchmarks/hosts.py                       # 2 hosts x 2 ranks, links at 1, 10 and 100 Gbit/s, 64 MiB
    python benchmarks/hosts.py --rates 1000 --mbytes 16 --reps 3

Needs root (network namespaces, tc): the test bed is tests/python/support/hostbed.py. Each rate gets a fresh bed
of ``--hosts`` namespace hosts on one bridge, each host's link shaped both ways by tbf; on every host torchrun
starts ``--ranks-per-host`` ranks of benchmarks/_hosts_rank.py, which times all_reduce, all_gather_into_tensor
and reduce_scatter_tensor of ``--mbytes`` (the larger side, per rank) on the shardkit backend (its default, rails
where hosts hold equal numbers of ranks; the same group with its inter-host bytes quantized, every op inside
``inter_host_format(shardkit.Quantized(weights="int8", grads="int8", block=256))``; and a group made with
SHARDKIT_INTER_HOST=leaders) and on gloo over the same ranks, repetitions interleaved.

The link bound is what must cross a host's link, divided by the rate (a link carries R each way at once, so
the bound is the larger of what a host sends and what it receives): with H hosts and the larger side S,

    all_reduce              2 S (H-1)/H     (reduce-scatter then all-gather of S among the hosts)
    all_gather_into_tensor    S (H-1)/H     (every host receives the other hosts' part of the output)
    reduce_scatter_tensor     S (H-1)/H     (every host sends its partial sums of the other hosts' blocks)

"× bound" is the median time over that bound: 1.0 is the link's speed; what is above it is time the link stood
idle (in-host steps that do not overlap the link, one socket per host, protocol overhead). On one machine the
hosts share its cores, so at high rates the CPU, not the link, can be the limit: the 100 Gbit/s bed is as good as
unshaped here, and its times are this machine's floor for each op (where the 10 Gbit/s times equal it, the link
was not what held them back).

The int8 column is timed against the same bound, that of the exact bytes: below 1.0 it beats the exact link
bound, by sending about a quarter of the bytes (an int8 record is one byte per element plus an f32 scale per block
of 256: 0.254 of f32's bytes). The wire-byte table shows what each rank sent to other hosts per op
(``shardkit.backend.inter_host_bytes``: rank 0's and the largest rank's) for exact rails, int8 and the leader
scheme (whose exact allreduce and all-gather run as gloo collectives, which that counter does not see), and int8's
bytes over exact's.

On 2 cores another process's CPU shows in every time: each rate's run records how many cores other processes
used meanwhile (``foreign_load_cores``), and warns above 0.1.

Results: ``benchmarks/results/hosts.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from _common import format_table  # noqa: E402
from _harness import RESULTS_DIR, ForeignLoad, add_target, bed_run, machine_info, write_json, wrote  # noqa: E402
from support.hostbed import unavailable  # noqa: E402

RANK_SCRIPT = Path(__file__).resolve().parent / "_hosts_rank.py"
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
# As _hosts_rank.py names them: "shardkit" is its default group, "shardkit-int8" that group with int8 between hosts.
BACKENDS = ("shardkit", "shardkit-int8", "shardkit-leaders", "gloo")
COUNTED = ("shardkit", "shardkit-int8", "shardkit-leaders")  # the backends whose inter-host bytes are counted
MiB = 1 << 20
# Issue 28's targets for allreduce, all-gather and reduce-scatter (median time over the link bound).
TARGETS = {1000: 1.1, 10000: 1.4}


def crossing_bytes(op: str, nbytes: int, hosts: int) -> float:
    """What must cross one host's link (each way) for ``op`` with the larger side ``nbytes``, exact."""
    return nbytes * (hosts - 1) / hosts * (2 if op == "all_reduce" else 1)


def link_bound_s(op: str, nbytes: int, hosts: int, rate_mbit: float) -> float:
    return crossing_bytes(op, nbytes, hosts) / (rate_mbit * 1e6 / 8)


def run_rate(rate: float, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"rate{rate:g}.json"
    script = [str(RANK_SCRIPT), str(out), "--bytes", str(args.mbytes << 20), "--reps", str(args.reps)]
    return bed_run(script, out, hosts=args.hosts, ranks_per_host=args.ranks_per_host, rate_mbit=rate,
                   timeout=args.timeout, logs=work / f"logs-{rate:g}", what=f"hosts.py: the launch at {rate:g} Mbit/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rates", type=float, nargs="+", default=[1000, 10000, 100000], help="link rates, Mbit/s")
    p.add_argument("--mbytes", type=int, default=64, help="the larger side of each op per rank, MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"hosts.py: cannot make namespace hosts here: {why}", file=sys.stderr)
        return 2
    rows, wire_rows, runs, targets = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="shardkit-hosts-") as tmp:
        for rate in args.rates:
            with ForeignLoad() as load:  # other processes' CPU: on 2 cores it shows in every time
                data = run_rate(rate, args, Path(tmp))
            data["foreign_load_cores"] = load.cores
            if load.cores is not None and load.cores > 0.1:
                print(f"warning: other processes used {load.cores:.2f} cores on average during the {rate:g} Mbit/s "
                      "run: its times are noisy", file=sys.stderr)
            expected_hosts = sorted(set(data["host_of"]))
            assert len(expected_hosts) == args.hosts, f"shardkit saw hosts {data['host_of']}"
            runs.append({"rate_mbit": rate, **data})
            for op in OPS:
                bound = link_bound_s(op, data["bytes"], args.hosts, rate)
                medians = {b: statistics.median(data["seconds"][f"{op}/{b}"]) for b in BACKENDS}
                rows.append([f"{rate:g}", op, f"{bound:.3f}"]
                            + [f"{medians[b]:.3f} ({medians[b] / bound:.2f}×)" for b in BACKENDS]
                            + [f"{medians['shardkit'] / medians['gloo']:.2f}",
                               f"{medians['shardkit-int8'] / medians['shardkit']:.2f}"])
                wire = {b: data["inter_host_bytes_per_op"][f"{op}/{b}"] for b in COUNTED}
                wire_rows.append([f"{rate:g}", op, f"{crossing_bytes(op, data['bytes'], args.hosts) / MiB:.2f}"]
                                 + [f"{wire[b]['rank0'] / MiB:.2f} / {wire[b]['max'] / MiB:.2f}" for b in COUNTED]
                                 + [f"{wire['shardkit-int8']['max'] / wire['shardkit']['max']:.4f}"
                                    if wire["shardkit"]["max"] else "-"])
                if rate in TARGETS:
                    add_target(targets, f"{args.hosts}x{args.ranks_per_host} hosts, {rate:g} Mbit/s, {op} "
                               f"{args.mbytes} MiB: shardkit ≤ {TARGETS[rate]}× the link bound",
                               medians["shardkit"] / bound, TARGETS[rate], higher_is_better=False, unit="×")
    print(f"{args.hosts} hosts x {args.ranks_per_host} ranks, {args.mbytes} MiB per rank (larger side), "
          f"medians of {args.reps} interleaved repetitions, slowest rank")
    print(format_table(["Mbit/s", "op", "bound s", "shardkit s (× bound)", "shardkit int8 s (× bound)",
                        "leader scheme s (× bound)", "gloo s (× bound)", "shardkit ÷ gloo", "int8 ÷ shardkit"],
                       rows, left=2))
    print("\nBytes each rank sent to other hosts per op, MiB (rank 0 / largest rank; shardkit.backend."
          "inter_host_bytes); host MiB: what must cross one host's link exact, shared by its ranks")
    print(format_table(["Mbit/s", "op", "host MiB", "shardkit (rails)", "shardkit int8", "leader scheme",
                        "int8 ÷ exact"], wire_rows, left=2))
    path = write_json(args.out / "hosts.json", {"benchmark": "hosts", "machine": machine_info(),
                                                "config": vars(args) | {"out": str(args.out)},
                                                "runs": runs, "targets": targets})
    print(wrote(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

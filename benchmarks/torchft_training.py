"""Training through a death under torchft: torchft's ProcessGroupGloo against shardkit's ProcessGroupShardkit as the
process group between the replica groups, for the same training, on one host and across 2 namespace hosts.

    python benchmarks/torchft_training.py                  # both placements, 3 rounds (about 15 minutes)
    python benchmarks/torchft_training.py --placements one-host --rounds 2

Each job is examples/torchft_train.py as its README section runs it: 2 replica groups of 2 ranks (world 4), each
group under its own ``torchrun --standalone --max-restarts=1``, shardkit's DDP inside a group (``--front ddp``:
each bucket averaged over the group's ranks on the shardkit backend, then across the groups by torchft's Manager),
a GPT of 23.1M parameters (d_model 512, 6 layers, vocabulary 8192; ``--batch``/``--seq`` sequences per rank), AdamW,
one lighthouse (heartbeat timeout ``--heartbeat-ms``). Configurations, the process group between the groups:

  gloo           torchft's ProcessGroupGloo                                            the anchor
  shardkit       shardkit.integrations.torchft.ProcessGroupShardkit, exact
  shardkit-int8  the same with comm=shardkit.Quantized(int8) for the bytes between hosts (two hosts only: on one
                 host nothing crosses a host)

Placements: ``one-host`` (this machine, the lighthouse in this process) and ``two-hosts`` (root: a namespace test
bed, tests/python/support/hostbed.py, links shaped to ``--rate`` Mbit/s both ways; group g on host g, the lighthouse
on host 0, gloo bound to the hosts' links, each group's Manager advertised at its host's address).

Every job trains together for ``--warmup-steps + --timed-steps`` steps, then rank 1 of group 1 SIGKILLs itself in
the backward of the next step (the kill step); its torchrun restarts the group, which heals from group 0 and trains
with it again until a step both groups took part in. From the ranks' records (the example's ``--records``):

- step time: the steps after the warm-up and before the kill, each the slowest rank's; its median.
- the cross-group allreduce's share of the step: per step, the seconds the ranks waited on the Manager's allreduce
  (the records' ``cross_group_s``, averaged over the 4 ranks; every front here waits for it inside the backward);
  its median, in seconds and as a fraction of the step. The targets compare the seconds with gloo's (the median of
  the per-round ratios): how much of the step gloo's allreduce took is left.
- kill -> survivors' next step: from the kill to the end of group 0's retried attempt of the kill step (the slower
  of its two ranks). Of it, kill -> survivors' quorum: until the retried attempt's quorum came back (the lighthouse's
  heartbeat timeout, then a quorum without the dead group), i.e. the survivors' wait; the rest is one step.
- restart -> rejoined: from the restarted group's process start to the end of its first committed step (the
  healing one: the quorum, the state from group 0, its load).
- steps lost: group 0's attempts that failed besides the kill step's one (0: none lost), and every committed
  step in order without a gap; every rank ends with bitwise equal parameters.

Rounds: each runs every configuration of a placement once, in an order rotated by the round, so drift on this shared
machine hits all alike; figures are medians over rounds and ratios the medians of the per-round ratios. On this
2-core machine the 4 ranks share two cores: the compute is serialised, so shares and ratios, not absolute times,
are the result.

Results: ``benchmarks/results/torchft_training.json`` (a run of one placement keeps the other's rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
sys.path.insert(0, str(ROOT / "tests" / "python"))
from _common import format_table  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    add_target,
    header,
    interleaved_rounds,
    load_note,
    machine_info,
    merge_results,
    paired_summary,
    write_json,
    wrote,
)
from support import torchft_replay  # noqa: E402
from support.hostbed import unavailable  # noqa: E402

EXAMPLE = ROOT / "examples" / "torchft_train.py"
CONFIGS = {"gloo": ("gloo", "exact"), "shardkit": ("shardkit", "exact"), "shardkit-int8": ("shardkit", "int8")}
LABELS = {"gloo": "torchft ProcessGroupGloo", "shardkit": "shardkit ProcessGroupShardkit",
          "shardkit-int8": "shardkit ProcessGroupShardkit, int8 between hosts"}
PLACEMENTS = {"one-host": ("gloo", "shardkit"), "two-hosts": ("gloo", "shardkit", "shardkit-int8")}
GROUP_WORLD = 2
LIGHTHOUSE_PORT = 29510  # on the bed only: host 0's network namespace is new, nothing else listens there
# Targets (issue 40): the cross-group allreduce's share of the step against gloo's; the survivors' next step.
SHARE_LIMITS = {("one-host", "shardkit"): 0.5, ("two-hosts", "shardkit"): 0.7, ("two-hosts", "shardkit-int8"): 0.35}
KILL_TO_NEXT_LIMIT_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--placements", nargs="+", choices=tuple(PLACEMENTS), default=list(PLACEMENTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of each job left out of the step time")
    p.add_argument("--timed-steps", type=int, default=8, help="steps of each job timed before the kill")
    p.add_argument("--rate", type=float, default=1000.0, help="two-hosts: each link's rate, Mbit/s")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--job-timeout", type=float, default=420.0, help="seconds one job may take")
    return p.parse_args(argv)


def example_args(args: argparse.Namespace, key: str, work: Path, replica: int) -> list[str]:
    """The example's arguments for ``replica``'s group in a job of configuration ``key`` writing under ``work``."""
    ft_pg, comm = CONFIGS[key]
    kill_step = args.warmup_steps + args.timed_steps
    argv = [str(EXAMPLE), "--front", "ddp", "--ft-pg", ft_pg, "--ft-comm", comm, "--replica-id", str(replica),
            "--steps", str(kill_step + 2), "--records", str(work / "records"), "--ready-dir", str(work / "ready"),
            "--replicas", "2", "--finish-together", "--timeout", "60",
            "--batch", str(args.batch), "--seq", str(args.seq), "--layers", "6", "--d-model", "512", "--heads", "8",
            "--vocab", "8192"]
    if replica == 1:
        argv += ["--kill-at-step", str(kill_step), "--kill-marker", str(work / "killed"), "--kill-rank", "1"]
    return argv


def torchrun(argv: list[str], address: str | None = None) -> list[str]:
    """A replica group's torchrun (it restarts the group once). On the bed, a rendezvous at the host's ``address``
    on a fixed port (the host's network namespace is new): its made-up host name resolves nowhere, and torchrun's
    --standalone would advertise it."""
    rendezvous = ["--standalone"] if address is None else ["--nnodes=1", f"--master_addr={address}",
                                                           "--master_port=29400"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={GROUP_WORLD}",
            "--max-restarts=1", *argv]


def rank_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SHARDKIT_HOST_ID", "GLOO_SOCKET_IFNAME")}
    env.update({"OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])})
    return env


def run_one_host(args: argparse.Namespace, key: str, work: Path) -> None:
    """Both groups' torchruns on this machine, one lighthouse in this process."""
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at "info"
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10_000,
                                  heartbeat_timeout_ms=args.heartbeat_ms)
    env = {**rank_environment(), "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    procs, logs = [], []
    try:
        for replica in range(2):
            log = open(work / f"replica{replica}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(torchrun(example_args(args, key, work, replica)), env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + args.job_timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if codes != [0, 0]:
            story = []
            for replica, log in enumerate(logs):
                log.seek(0)
                story.append(f"--- replica group {replica} (exit {codes[replica]})\n{log.read()[-5000:]}")
            raise RuntimeError(f"torchft_training.py: the one-host {key} job failed\n" + "\n".join(story))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
        lighthouse.shutdown()


def run_two_hosts(args: argparse.Namespace, key: str, work: Path, bed: Any) -> None:
    """Group g on host g of ``bed``; the lighthouse on host 0, started by host 0's shell before its torchrun."""
    address = f"http://{bed.addr(0)}:{LIGHTHOUSE_PORT}"
    lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}",
                  "--min_replicas", "1", "--join_timeout_ms", "10000", "--heartbeat_timeout_ms",
                  str(args.heartbeat_ms)]
    commands = []
    for h in range(2):
        group = ["env", f"GLOO_SOCKET_IFNAME={bed.host_if[h]}", f"TORCHFT_LIGHTHOUSE={address}",
                 *torchrun([*example_args(args, key, work, h), "--advertise-host", bed.addr(h)], bed.addr(h))]
        if h == 0:  # the lighthouse goes when the host does (its PID namespace ends with the torchrun)
            group = ["sh", "-c", f"{shlex.join(lighthouse)} >{work / 'lighthouse.log'} 2>&1 & exec \"$@\"", "sh",
                     *group]
        commands.append(group)
    result = bed.launch(commands, env=rank_environment(), timeout=args.job_timeout, logs=work / "hosts")
    if not result.ok:
        raise RuntimeError(f"torchft_training.py: the two-hosts {key} job failed\n{result.story()}")


def summarize_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One job's figures from its records (see the module docstring)."""
    records = torchft_replay.read_records(work / "records")
    expected = [(r, g) for r in range(2) for g in range(GROUP_WORLD)]
    if sorted(records) != expected:
        raise RuntimeError(f"torchft_training.py: records of {sorted(records)}, expected {expected}")
    kill_step = args.warmup_steps + args.timed_steps
    steps, cross = [], []  # per timed step: its time (the slowest rank's), its seconds in the cross-group allreduce
    for step in range(args.warmup_steps, kill_step):
        attempts = []
        for rank_records in records.values():
            found = [a for a in rank_records.attempts if a["step"] == step and a["committed"]]
            if len(found) != 1 or found[0]["participants"] != 2:
                raise RuntimeError(f"torchft_training.py: step {step} was not one committed step of both groups: "
                                   f"{found}")
            attempts.append(found[0])
        steps.append(max(a["t_end"] - a["t_start"] for a in attempts))
        cross.append(statistics.mean(a["cross_group_s"] for a in attempts))
    killed_at = json.loads((work / "killed").read_text())["t"]
    recoveries = [torchft_replay.recovery(records[(0, g)], records[(1, g)], killed_at, kill_step)
                  for g in range(GROUP_WORLD)]
    extra_failures = sum(len(r.failed) - sum(a["step"] == kill_step for a in r.failed) for r in recoveries)
    if any(r.retried is None or not r.after_restart for r in recoveries):
        raise RuntimeError("torchft_training.py: group 0 never retried the kill step, or group 1 never rejoined")
    participation = torchft_replay.participation(records)  # raises on a gap in the committed steps
    hashes = {torch.load(work / "records" / f"replica{r}.rank{g}.final.pt", weights_only=True)["hash"]
              for r, g in records}
    figures = recoveries[0].figures
    return {"step_s": statistics.median(steps), "cross_group_s": statistics.median(cross),
            "cross_group_share": statistics.median(c / s for c, s in zip(cross, steps)),
            "kill_to_next_step_s": max(r.figures["kill_to_next_survivor_step_s"] for r in recoveries),
            "kill_to_quorum_s": max(r.figures["kill_to_survivor_quorum_s"] for r in recoveries),
            "restart_to_rejoined_s": figures["restart_to_rejoined_s"],
            "restart_to_first_step_s": figures["restart_to_first_step_s"],
            "healing_step_s": figures["healing_step_s"],
            "survivor_failed_attempts_besides_the_kill_step": extra_failures,
            "steps_alone": sum(1 for replicas, _ in participation.values() if replicas == [0]),
            "bitwise_equal_at_the_end": len(hashes) == 1}


def median_of(jobs: list[dict[str, Any]], field: str) -> float:
    return statistics.median(job[field] for job in jobs)


def summarize(placement: str, jobs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for key in PLACEMENTS[placement]:
        row: dict[str, Any] = {"placement": placement, "config": key, "label": LABELS[key], "rounds": len(jobs[key])}
        for field in ("step_s", "cross_group_s", "cross_group_share", "kill_to_next_step_s", "kill_to_quorum_s",
                      "restart_to_rejoined_s", "restart_to_first_step_s", "healing_step_s"):
            row[field] = median_of(jobs[key], field)
        row["kill_to_next_step_s_max"] = max(job["kill_to_next_step_s"] for job in jobs[key])
        row["survivor_failed_attempts_besides_the_kill_step"] = sum(
            job["survivor_failed_attempts_besides_the_kill_step"] for job in jobs[key])
        row["bitwise_equal_at_the_end"] = all(job["bitwise_equal_at_the_end"] for job in jobs[key])
        row["jobs"] = jobs[key]
        if key != "gloo":
            for field in ("step_s", "cross_group_s", "cross_group_share"):
                row[f"{field}_vs_gloo"] = paired_summary([j[field] for j in jobs[key]],
                                                         [j[field] for j in jobs["gloo"]])
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    def ratio(row: dict[str, Any], field: str) -> str:
        value = row.get(f"{field}_vs_gloo")
        return "1 (anchor)" if row["config"] == "gloo" else (f"{value['median']:.2f}" if value else "–")

    print(format_table(
        ["placement", "between the groups", "step", "cross-group allreduce", "vs gloo", "step vs gloo",
         "kill -> quorum", "kill -> next step", "restart -> rejoined"],
        [[r["placement"], r["label"], f"{r['step_s']:.3f} s",
          f"{r['cross_group_s']:.3f} s ({100 * r['cross_group_share']:.0f}%)", ratio(r, "cross_group_s"),
          ratio(r, "step_s"), f"{r['kill_to_quorum_s']:.2f} s", f"{r['kill_to_next_step_s']:.2f} s",
          f"{r['restart_to_rejoined_s']:.1f} s"] for r in rows], left=2))


def run_placement(args: argparse.Namespace, placement: str) -> list[dict[str, Any]]:
    """Every round of one placement's jobs; its rows."""
    jobs: dict[str, list[dict[str, Any]]] = {key: [] for key in PLACEMENTS[placement]}
    with contextlib.ExitStack() as stack:
        bed = None
        if placement == "two-hosts":
            from support.hostbed import HostBed

            bed = stack.enter_context(HostBed(2, args.rate))
        for _, keys, _ in interleaved_rounds(PLACEMENTS[placement], 0, args.rounds, print,
                                             label=f"  {placement} round"):
            for key in keys:
                with tempfile.TemporaryDirectory(prefix=f"torchft-bench-{key}-") as tmp:
                    work = Path(tmp)
                    if bed is None:
                        run_one_host(args, key, work)
                    else:
                        run_two_hosts(args, key, work, bed)
                    job = summarize_job(args, work)
                jobs[key].append(job)
                print(f"    {key}: step {job['step_s']:.3f} s, cross-group share "
                      f"{100 * job['cross_group_share']:.1f}%, kill -> next step {job['kill_to_next_step_s']:.2f} s, "
                      f"restart -> rejoined {job['restart_to_rejoined_s']:.1f} s", flush=True)
    return summarize(placement, jobs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    if "two-hosts" in args.placements and (why := unavailable()) is not None:
        raise SystemExit(f"torchft_training.py: two-hosts needs a namespace test bed: {why} "
                         "(run --placements one-host)")
    print(header("torchft: ProcessGroupGloo vs ProcessGroupShardkit between replica groups", machine,
                 f"2 groups x {GROUP_WORLD} ranks, 23.1M-parameter GPT, {args.rounds} rounds"))
    rows: list[dict[str, Any]] = []
    with ForeignLoad() as load:
        for placement in args.placements:
            rows += run_placement(args, placement)
    note = load_note(load.cores, machine, "the jobs")
    print_rows(rows)
    if note:
        print(note)
    path = RESULTS_DIR / "torchft_training.json"
    merged = merge_results(path, {"machine": machine, "args": vars(args), "foreign_load_cores": load.cores,
                                  "rows": rows},
                           {"rows": lambda row: (row["placement"], row["config"])})
    merged["targets"] = targets(merged["rows"])  # over every row in the file: this run's and the other placement's
    write_json(path, merged)
    print(wrote(path))
    return 0


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets over ``rows``, printed."""
    checks: list[dict[str, Any]] = []
    for row in rows:
        limit = SHARE_LIMITS.get((row["placement"], row["config"]))
        if limit is not None:
            value = row["cross_group_s_vs_gloo"]
            add_target(checks, f"{row['placement']}: the step's seconds in the cross-group allreduce, {row['label']} "
                       "against gloo's", value and value["median"], limit, False, "x")
    shardkit_rows = [row for row in rows if row["config"] != "gloo"]
    add_target(checks, "kill -> survivors' next completed step (slowest job, shardkit between the groups)",
               max((row["kill_to_next_step_s_max"] for row in shardkit_rows), default=None), KILL_TO_NEXT_LIMIT_S,
               False, " s")
    add_target(checks, "survivors' failed attempts besides the kill step's, every job (0: no step lost)",
               sum(row["survivor_failed_attempts_besides_the_kill_step"] for row in rows), 0, False, "")
    return checks


if __name__ == "__main__":
    sys.exit(main())

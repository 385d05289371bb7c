"""Kill-and-restart cycles under real ``torchrun --max-restarts N`` (``make chaos``; not part of ``make test``).

For each front (fully_shard, the FSDP1 front, ZeRO-2, DDP; all on the shardkit backend) and world size (2 and 4):
one torchrun job whose first N attempts (default 20) each lose a rank to SIGKILL at a random moment, and whose last
attempt trains to the end. The worker is tests/python/support/restart_script.py with ``--seed``: attempt A's victim
rank and moment are drawn from the seed and A; in 3 of 10 attempts the moment is a time since the process began
(0 to 8 s: in the imports, the start-up or training), else a training step (0 to 11).

It asserts, per job: exit 0; every attempt started up (every rank through init_process_group and a first step),
except one whose victim died before it could; no rank of any attempt failed before that attempt's kill (a start-up
tripping over the killed attempt's entries fails there, naming a pid of an earlier attempt); a rank that failed after
the kill named only this attempt's pids; nothing of the job's left in /dev/shm (its own SHARDKIT_SHM_TAG).

Prints a summary: per front and world, the restarts attempted and started, attempts killed before start-up, and the
seconds per restart (from the kill to the next attempt's last rank having started: torchrun's detection and teardown,
the interpreters' start, shardkit's start-up). Exit status 1 if any job failed its assertions.

    python tests/chaos/restart_cycles.py [--cycles 20] [--worlds 2 4] [--fronts fully_shard fsdp zero2 ddp]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "python" / "support" / "restart_script.py"
FRONTS = ("fully_shard", "fsdp", "zero2", "ddp")


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def check_job(markers: Path, cycles: int, world: int) -> tuple[list[str], dict[str, object]]:
    """The job's failed assertions (empty: passed) and its figures."""
    problems: list[str] = []
    started = killed_early = 0
    restart_seconds: list[float] = []
    pids = {a: {int(read(markers / f"attempt{a}.rank{r}.began").split()[1])
                for r in range(world) if (markers / f"attempt{a}.rank{r}.began").exists()}
            for a in range(cycles + 1)}
    for attempt in range(cycles + 1):
        kill = read(markers / f"attempt{attempt}.killed").split()
        kill_time = float(kill[0]) if kill else None
        all_started = all((markers / f"attempt{attempt}.rank{r}.started").exists() for r in range(world))
        if attempt < cycles and kill_time is None:
            problems.append(f"attempt {attempt}: no rank was killed (ended another way)")
        if all_started:
            started += attempt > 0
        elif kill_time is not None:
            killed_early += attempt > 0
        else:
            problems.append(f"attempt {attempt}: did not start up and was not killed")
        for r in range(world):
            error = read(markers / f"attempt{attempt}.rank{r}.error")
            if not error:
                continue
            when, _, text = error.partition(" ")
            if kill_time is None or float(when) < kill_time:
                problems.append(f"attempt {attempt} rank {r} failed before any kill: {text[:400]}")
                continue
            named = {int(p) for p in re.findall(r"pid (\d+)", text)}
            earlier = named - pids[attempt]
            if earlier:
                problems.append(f"attempt {attempt} rank {r} named pid(s) {sorted(earlier)} of an earlier attempt: "
                                f"{text[:400]}")
        if attempt > 0 and all_started:
            before = read(markers / f"attempt{attempt - 1}.killed").split()
            if before:
                last_start = max(float(read(markers / f"attempt{attempt}.rank{r}.started").split()[0])
                                 for r in range(world))
                restart_seconds.append(last_start - float(before[0]))
    for r in range(world):
        if not (markers / f"attempt{cycles}.rank{r}.done").exists():
            problems.append(f"the last attempt's rank {r} did not train to the end")
    # The restarts are attempts 1..cycles: each started, or its victim died before it could.
    figures = {"attempted": cycles, "started": started, "killed_before_start": killed_early,
               "restart_seconds": restart_seconds}
    return problems, figures


def run_job(front: str, world: int, cycles: int, seed: int, timeout: float) -> tuple[list[str], dict[str, object]]:
    tag = f"chaos{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix=f"restart-{front}-{world}-") as directory:
        markers = Path(directory)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKIT_SHM_TAG": tag,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               f"--max-restarts={cycles}", str(SCRIPT), "--front", front, "--markers", str(markers),
               "--kills", str(cycles), "--seed", str(seed), "--max-delay", "8", "--steps", "4"]
        began = time.monotonic()
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            problems = [] if result.returncode == 0 else [
                f"torchrun exited {result.returncode}: {result.stderr[-3000:]}"]
        except subprocess.TimeoutExpired:
            problems = [f"torchrun ran past {timeout:.0f} s"]
        seconds = time.monotonic() - began
        more, figures = check_job(markers, cycles, world)
        problems += more
        left = [n for n in os.listdir("/dev/shm") if f"shardkit-{tag}-" in n]
        if left:
            problems.append(f"left in /dev/shm: {left}")
            for name in left:
                os.unlink(f"/dev/shm/{name}")
        figures["seconds"] = seconds
        return problems, figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--fronts", nargs="+", choices=FRONTS, default=list(FRONTS))
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    args = parser.parse_args()
    print(f"restart cycles: {args.cycles} per job, seed {args.seed}", flush=True)
    failed = False
    rows = []
    for world in args.worlds:
        for front in args.fronts:
            problems, figures = run_job(front, world, args.cycles, args.seed, timeout=60.0 * (args.cycles + 1))
            restarts = figures["restart_seconds"]
            assert isinstance(restarts, list)
            per = (f"{statistics.median(restarts):5.1f} s median, {max(restarts):5.1f} s max" if restarts
                   else "   -")
            row = (f"{front:12s} world {world}: restarts attempted {figures['attempted']:3d}, started "
                   f"{figures['started']:3d} (attempts killed before start-up: {figures['killed_before_start']}); "
                   f"seconds per restart {per}; job {figures['seconds']:.0f} s  "
                   f"{'FAILED' if problems else 'ok'}")
            print(row, flush=True)
            rows.append(row)
            for problem in problems:
                print(f"    {problem}", flush=True)
            failed = failed or bool(problems)
    print("\nsummary:\n" + "\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Resume under faults (``make chaos``; not part of ``make test``): examples/train_gpt.py for 300 steps under real
``torchrun --max-restarts``, with a worker SIGKILLed at 3 random moments, must end with the weights and optimizer
state of the run never interrupted, bit for bit.

For each front (fully_shard, ZeRO-2, DDP; world 2, the shardkit backend): one uninterrupted run, then one run whose
attempts 0, 1 and 2 each lose a random rank at a random moment (drawn from ``--seed``): as a training step begins
(a random step), or inside the save of a checkpoint (a random checkpoint step: the save dies before any rank
committed it, leaving its staging directory). Each attempt after a fault resumes from the newest whole checkpoint
(examples/train_gpt.py --checkpoint-dir, every ``--every`` steps); the worker is
tests/python/support/resume_train_gpt.py, which also logs when each thing happened.

Asserts, per front: exit 0; exactly the 3 faults happened (attempts 0-2 each killed, attempt 3 finished); the
final checkpoint's model and optimizer entries equal the uninterrupted run's bit for bit. Prints, per fault, the
time lost, split into
  restart     from the kill to the next attempt's load_latest call (torchrun's detection and teardown, the
              interpreters' start, shardkit's start-up, building the model),
  load        load_latest (listing, verifying every file, loading),
  recompute   the steps trained again: from the loaded checkpoint's step up to the killed step.

Then, per front, a resume at another world size (``--reshard-world``, 4 by default; 0 skips it): a world-2 run to a
random checkpoint step s (a multiple of ``--every`` up to half of ``--steps``, drawn from the seed and the front),
whose checkpoint of step s is resumed at that world size twice: once uninterrupted to the end, once with 3 faults
drawn as above after step s (a fault before the first save there resumes from the world-2 checkpoint again). Asserts
the same of the faulted run, against the uninterrupted run at that world size from that step, and prints the same
figures.
Exit status 1 if any front failed.

    python tests/chaos/resume_chaos.py [--seed 0] [--steps 300] [--every 25] [--fronts fully_shard zero2 ddp]
        [--reshard-world 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "python" / "support" / "resume_train_gpt.py"
sys.path.insert(0, str(SCRIPT.parent))  # the worker's module also says what "bitwise equal" compares
from resume_train_gpt import final_bits  # noqa: E402

FRONTS = ("fully_shard", "zero2", "ddp")
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2",
        "--log-every", "1000", "--json"]
WORLD = 2


def faults(rng: random.Random, steps: int, every: int, world: int = WORLD,
           low: int = 2) -> list[tuple[int, int, int, str]]:
    """(attempt, rank, step, where) for attempts 0-2, steps from ``low``: steps increasing, so each attempt reaches
    its own (it resumes at or before the previous fault's step)."""
    chosen: list[tuple[int, int, int, str]] = []
    for attempt in range(3):
        high = low + (steps - 10 - low) // (3 - attempt)
        where = rng.choice(["step", "step", "save"])
        if where == "save":
            candidates = [s for s in range(low, high + 1) if s % every == 0]
            if not candidates:
                where = "step"
            else:
                step = rng.choice(candidates)
        if where == "step":
            step = rng.randint(low, high)
        chosen.append((attempt, rng.randrange(world), step, where))
        low = step + 1
    return chosen


def run(args: list[str], kills: str, events: Path, timeout: float, world: int = WORLD) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "--max-restarts=3", "--monitor-interval=0.2", str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKIT_TEST_KILLS": kills, "SHARDKIT_TEST_EVENTS": str(events)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)




def attempts(events: Path, rank: int) -> list[list[dict]]:
    """A rank's events, one list per attempt."""
    path = Path(f"{events}.rank{rank}")
    split: list[list[dict]] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        event = json.loads(line)
        if event["event"] == "start":
            split.append([])
        split[-1].append(event)
    return split


def lost_time(events: Path, chosen: list[tuple[int, int, int, str]]) -> tuple[list[str], list[dict[str, float]]]:
    """The problems found in the events, and per fault its restart / load / recompute seconds."""
    problems, figures = [], []
    zero = attempts(events, 0)
    if len(zero) != len(chosen) + 1:
        problems.append(f"{len(zero)} attempts started on rank 0, expected {len(chosen) + 1}")
        return problems, figures
    for attempt, rank, step, where in chosen:
        mine = attempts(events, rank)[attempt]
        kills = [e for e in mine if e["event"] == "kill"]
        if [(e["step"], e["where"]) for e in kills] != [(step, where)]:
            problems.append(f"attempt {attempt}: rank {rank} logged kills {kills}, expected step {step} ({where})")
            continue
        after = zero[attempt + 1]
        loaded = next(e for e in after if e["event"] == "loaded")
        resumed = loaded["step"] or 0
        last_lost = step - 1  # the steps of the killed attempt that were done (a save of step s follows step s-1)
        caught_up = next((e["t"] for e in after if e["event"] == "step" and e["step"] == last_lost), loaded["t"])
        figures.append({"attempt": attempt, "rank": rank, "step": step, "where": where, "resumed": resumed,
                        "restart": loaded["t0"] - kills[0]["t"], "load": loaded["t"] - loaded["t0"],
                        "recompute": max(0.0, caught_up - loaded["t"]) if last_lost >= resumed else 0.0,
                        "recomputed_steps": max(0, step - resumed)})
    return problems, figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--fronts", nargs="+", choices=FRONTS, default=list(FRONTS))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    p.add_argument("--reshard-world", type=int, default=4, help="the other world size to resume at (0: none)")
    options = p.parse_args(argv)
    rng = random.Random(options.seed)
    failed = False
    with tempfile.TemporaryDirectory(prefix="shardkit-resume-chaos-") as scratch_name:
        scratch = Path(scratch_name)
        for front in options.fronts:
            args = [*TINY, "--strategy", front, "--steps", str(options.steps), "--checkpoint-every",
                    str(options.every)]
            chosen = faults(rng, options.steps, options.every)
            kills = ",".join(f"{a}:{r}:{s}:{w}" for a, r, s, w in chosen)
            whole, chaotic = scratch / f"{front}-whole", scratch / f"{front}-chaos"
            problems = []
            for directory, plan in ((whole, ""), (chaotic, kills)):
                done = run([*args, "--checkpoint-dir", str(directory)], plan, scratch / f"{directory.name}-events",
                           options.timeout)
                if done.returncode != 0:
                    problems.append(f"{directory.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
            figures: list[dict[str, float]] = []
            if not problems:
                found, figures = lost_time(scratch / f"{chaotic.name}-events", chosen)
                problems += found
                if final_bits(chaotic, options.steps, scratch) != final_bits(whole, options.steps, scratch):
                    problems.append("the final weights or optimizer state differ from the uninterrupted run's")
            failed |= summary(f"{front}: faults {kills}", problems, figures)
            if options.reshard_world:
                failed |= resharded(front, args, options, scratch)
    return 1 if failed else 0


def summary(title: str, problems: list[str], figures: list[dict[str, float]]) -> bool:
    """Prints a job's outcome and figures; True if it failed."""
    print(f"{title}: {'FAILED' if problems else 'bitwise equal to the uninterrupted run'}", flush=True)
    for problem in problems:
        print(f"  problem: {problem}")
    for f in figures:
        print(f"  attempt {f['attempt']}: rank {f['rank']} killed at step {f['step']} ({f['where']}), "
              f"resumed at {f['resumed']}: lost {f['restart']:.2f} s restart + {f['load']:.2f} s load + "
              f"{f['recompute']:.2f} s recomputing {f['recomputed_steps']} steps", flush=True)
    return bool(problems)


def resharded(front: str, args: list[str], options: argparse.Namespace, scratch: Path) -> bool:
    """The world-2 checkpoint of a random step resumed at ``--reshard-world`` with 3 faults, against the same
    resume uninterrupted; True if it failed."""
    world = options.reshard_world
    rng = random.Random(f"{options.seed}-reshard-{front}")  # apart from the world-2 draws, which stay as they were
    start = rng.choice(range(options.every, options.steps // 2 + 1, options.every))
    chosen = faults(rng, options.steps, options.every, world, low=start + 1)
    kills = ",".join(f"{a}:{r}:{s}:{w}" for a, r, s, w in chosen)
    base = scratch / f"{front}-world{WORLD}-to-{start}"
    problems = []
    done = run([*args[:args.index("--steps") + 1], str(start), *args[args.index("--steps") + 2:], "--checkpoint-dir",
                str(base)], "", scratch / f"{base.name}-events", options.timeout)
    if done.returncode != 0:
        problems.append(f"{base.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    whole, chaotic = scratch / f"{front}-world{world}-whole", scratch / f"{front}-world{world}-chaos"
    for directory, plan in ((whole, ""), (chaotic, kills)):
        if problems:
            break
        directory.mkdir()
        shutil.copytree(base / f"step-{start:08d}", directory / f"step-{start:08d}")
        done = run([*args, "--checkpoint-dir", str(directory)], plan, scratch / f"{directory.name}-events",
                   options.timeout, world)
        if done.returncode != 0:
            problems.append(f"{directory.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    figures: list[dict[str, float]] = []
    if not problems:
        problems, figures = lost_time(scratch / f"{chaotic.name}-events", chosen)
        if final_bits(chaotic, options.steps, scratch) != final_bits(whole, options.steps, scratch):
            problems.append("the final weights or optimizer state differ from the uninterrupted run's")
    return summary(f"{front}: world {WORLD} step {start} resumed at world {world}, faults {kills}", problems, figures)


if __name__ == "__main__":
    sys.exit(main())

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
Exit status 1 if any front failed.

    python tests/chaos/resume_chaos.py [--seed 0] [--steps 300] [--every 25] [--fronts fully_shard zero2 ddp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def faults(rng: random.Random, steps: int, every: int) -> list[tuple[int, int, int, str]]:
    """(attempt, rank, step, where) for attempts 0-2: steps increasing, so each attempt reaches its own (it
    resumes at or before the previous fault's step)."""
    chosen: list[tuple[int, int, int, str]] = []
    low = 2
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
        chosen.append((attempt, rng.randrange(WORLD), step, where))
        low = step + 1
    return chosen


def run(args: list[str], kills: str, events: Path, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
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
            print(f"{front}: faults {kills}: {'FAILED' if problems else 'bitwise equal to the uninterrupted run'}")
            for problem in problems:
                print(f"  problem: {problem}")
            for f in figures:
                print(f"  attempt {f['attempt']}: rank {f['rank']} killed at step {f['step']} ({f['where']}), "
                      f"resumed at {f['resumed']}: lost {f['restart']:.2f} s restart + {f['load']:.2f} s load + "
                      f"{f['recompute']:.2f} s recomputing {f['recomputed_steps']} steps")
            failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

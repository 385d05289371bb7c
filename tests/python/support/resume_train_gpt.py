"""examples/train_gpt.py under torchrun, with faults on purpose: a worker SIGKILLs itself at the moments
``SHARDKIT_TEST_KILLS`` names, and every worker logs what a fault cost (tests/python/test_resume.py,
tests/chaos/resume_chaos.py).

    SHARDKIT_TEST_KILLS="0:1:7:step,1:0:12:save"   attempt:rank:step:where, comma-separated
    SHARDKIT_TEST_EVENTS=/tmp/events               each worker appends JSON lines to /tmp/events.rank<r>

``attempt`` is torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 the first time, 1 after the first restart, ...).
``where``: ``step`` kills the worker as it begins that step (before its batch); ``save`` kills it inside the
save of the checkpoint of that step, once the save has created its staging directory and before any rank
committed (torch.distributed.checkpoint.save is where it dies), which leaves a staging directory behind.

Events (seconds on the wall clock, ``time.time()``): ``{"event": "start", "attempt", "t"}`` when the worker's
Python starts; ``{"event": "loaded", "step", "t0", "t"}`` around Checkpointer.load_latest (``step``: what it
resumed at, null for none); ``{"event": "step", "step", "t"}`` at each step's end; ``{"event": "kill", "step",
"where", "t"}`` just before a worker kills itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

START = time.time()
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"


def _log(event: dict) -> None:
    path = os.environ.get("SHARDKIT_TEST_EVENTS")
    if not path:
        return
    with open(f"{path}.rank{os.environ['RANK']}", "a") as out:
        out.write(json.dumps(event) + "\n")
        out.flush()
        os.fsync(out.fileno())


def _die(step: int, where: str) -> None:
    _log({"event": "kill", "step": step, "where": where, "t": time.time()})
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def final_bits(directory: Path, step: int, scratch: Path) -> dict[str, bytes]:
    """The model and optimizer entries of the Checkpointer's ``directory/step-<step>``, whole (consolidated into
    ``scratch``), as bytes per key: what "bitwise equal to the uninterrupted run" compares."""
    import torch

    from shardkit import checkpoint

    out = scratch / f"{directory.name}.pt"
    checkpoint.consolidate(directory / f"step-{step:08d}", out)
    whole = torch.load(out, weights_only=True)

    def flat(prefix: str, value) -> dict[str, bytes]:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() for k, v in flat(f"{prefix}.{key}", sub).items()}
        if isinstance(value, torch.Tensor):
            return {prefix: value.reshape(-1).view(torch.uint8).numpy().tobytes()}
        return {prefix: repr(value).encode()}
    return {**flat("model", whole["model"]), **flat("optim", whole["optim"])}


def main() -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    _log({"event": "start", "attempt": attempt, "t": START})
    kills = {}
    for spec in filter(None, os.environ.get("SHARDKIT_TEST_KILLS", "").split(",")):
        when, who, step, where = spec.split(":")
        if int(when) == attempt and int(who) == rank:
            kills[(int(step), where)] = True

    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    batches = example.batches

    def logged_batches(*args, **kwargs):
        batch = batches(*args, **kwargs)
        previous: list[int] = []

        def at(step: int):
            if previous:  # the previous step has ended
                _log({"event": "step", "step": previous[-1], "t": time.time()})
            if (step, "step") in kills:
                _die(step, "step")
            previous.append(step)
            return batch(step)
        return at
    example.batches = logged_batches

    from shardkit.checkpoint import Checkpointer

    load_latest, save = Checkpointer.load_latest, Checkpointer.save

    def timed_load_latest(self, state):
        t0 = time.time()
        step = load_latest(self, state)
        _log({"event": "loaded", "step": step, "t0": t0, "t": time.time()})
        return step

    def dying_save(self, step, state):
        if (step, "save") in kills:
            import torch.distributed.checkpoint as dcp

            dcp.save = lambda *args, **kwargs: _die(step, "save")
        return save(self, step, state)
    Checkpointer.load_latest = timed_load_latest
    Checkpointer.save = dying_save

    return example.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

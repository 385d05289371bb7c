"""Reading examples/torchft_train.py's records, and the reference run they are compared with
(tests/python/test_torchft_recovery.py).

The reference is one process in float32, no process group: the same initial model, the same batches (the
example's ``batch_for``), and per committed step the gradient torchft's Manager makes of it: each participating
replica group's gradient (averaged over its ranks first), summed in replica order and divided by the participant
count the ranks recorded; a group that was healing, or absent, contributes nothing. Which groups took part in which
step is read from the records, so the reference applies the run's own participation, step by step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example() -> ModuleType:
    """examples/torchft_train.py as a module (its model, batches and flags)."""
    spec = importlib.util.spec_from_file_location("torchft_train", EXAMPLES / "torchft_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("torchft_train", module)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class GroupRecords:
    """One rank's records: its starts (one per process) and its step attempts, in the order written."""

    replica: int
    rank: int
    starts: list[dict[str, Any]]
    attempts: list[dict[str, Any]]


def read_records(directory: Path) -> dict[tuple[int, int], GroupRecords]:
    """{(replica, group rank): its records} from DIR/replica<R>.rank<G>.jsonl."""
    found = {}
    for path in sorted(directory.glob("replica*.rank*.jsonl")):
        replica, rank = (int(part[len(prefix):]) for part, prefix in
                         zip(path.name.removesuffix(".jsonl").split("."), ("replica", "rank")))
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        found[(replica, rank)] = GroupRecords(replica, rank, [x for x in lines if x.get("event") == "start"],
                                              [x for x in lines if "step" in x])
    return found


@dataclasses.dataclass
class Recovery:
    """A death and the rejoin after it, as one rank of the surviving group and the same rank of the killed (and
    restarted) group recorded them; what test_torchft_recovery asserts and benchmarks/torchft_training.py reports."""

    failed: list[dict[str, Any]]         # the survivor's attempts that were not committed (the kill step's: one)
    retried: dict[str, Any] | None       # the survivor's committed attempt of the kill step
    after_restart: list[dict[str, Any]]  # the restarted group's committed attempts after its restart
    figures: dict[str, float]


def recovery(survivor: GroupRecords, killed: GroupRecords, killed_at: float, kill_step: int) -> Recovery:
    """The timeline of a death at ``killed_at`` (wall clock) in step ``kill_step``: how soon the survivor trained
    again, how long its longest attempt took, and how long the killed group took to start again and rejoin (its
    first committed attempt after the restart heals it; figures in seconds)."""
    failed = [a for a in survivor.attempts if not a["committed"]]
    retried = next((a for a in survivor.attempts if a["step"] == kill_step and a["committed"]), None)
    restarted_at = killed.starts[-1]["t"]
    after = [a for a in killed.attempts if a["t_start"] >= restarted_at and a["committed"]]
    figures = {"survivor_longest_step_s": max(a["t_end"] - a["t_start"] for a in survivor.attempts)}
    if retried is not None:
        figures["kill_to_next_survivor_step_s"] = retried["t_end"] - killed_at
        figures["kill_to_survivor_quorum_s"] = retried["t_quorum"] - killed_at  # training again from here
    if after:
        first = next(a for a in killed.attempts if a["t_start"] >= restarted_at)
        figures.update(restart_to_rejoined_s=after[0]["t_end"] - restarted_at,
                       kill_to_rejoined_s=after[0]["t_end"] - killed_at,
                       restart_to_first_step_s=first["t_start"] - restarted_at,  # start-up: imports, groups
                       healing_step_s=after[0]["t_end"] - after[0]["t_start"])  # quorum, transfer, load
    return Recovery(failed, retried, after, figures)


def participation(records: dict[tuple[int, int], GroupRecords]) -> dict[int, tuple[list[int], int]]:
    """Per committed step: (the replica groups whose gradient went in, the participant count they divided by).
    Checks that every rank that committed a step agrees on the count. (The count is torchft's: the groups at the
    quorum's highest step. A group healing from one of them at that same step, as at step 0 with init_sync, counts
    but contributes zeros; one healing from an earlier step does not count.)"""
    steps: dict[int, tuple[set[int], set[int]]] = {}
    for (replica, _), group in records.items():
        for attempt in group.attempts:
            if attempt["committed"]:
                contributors, counts = steps.setdefault(attempt["step"], (set(), set()))
                counts.add(attempt["participants"])
                if attempt["participating"]:
                    contributors.add(replica)
    result = {}
    for step, (contributors, counts) in sorted(steps.items()):
        assert len(counts) == 1 and len(contributors) <= min(counts), \
            f"step {step}: participant counts {sorted(counts)}, contributors {sorted(contributors)}"
        result[step] = (sorted(contributors), counts.pop())
    assert sorted(result) == list(range(len(result))), f"committed steps with gaps: {sorted(result)}"
    return result


def reference(steps: dict[int, tuple[list[int], int]], args: list[str], group_world: int
              ) -> tuple[dict[tuple[int, int], float], dict[str, torch.Tensor]]:
    """Replays ``steps`` (participation()'s) with the example's flags ``args``: returns the loss of every
    (step, shard) that took part, and the final parameters."""
    ex = example()
    flags = ex.parse_args(args)
    cfg = ex.model_config(flags)
    model = ex.initial_model(cfg)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=flags.lr, weight_decay=0.1)
    losses: dict[tuple[int, int], float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same reduction orders in the kernels
    try:
        for step, (replicas, participants) in sorted(steps.items()):
            total: list[torch.Tensor] | None = None
            for replica in replicas:
                group: list[torch.Tensor] | None = None
                for rank in range(group_world):
                    shard = replica * group_world + rank
                    model.zero_grad(set_to_none=True)
                    tokens, targets = ex.batch_for(cfg, step, shard)
                    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                    loss.backward()
                    losses[(step, shard)] = loss.item()
                    grads = [p.grad.detach().clone() for p in params]
                    group = grads if group is None else [a + b for a, b in zip(group, grads)]
                assert group is not None
                if group_world > 1:
                    group = [g / group_world for g in group]
                total = group if total is None else [a + b for a, b in zip(total, group)]
            assert total is not None
            for p, g in zip(params, total):
                p.grad = g / participants
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

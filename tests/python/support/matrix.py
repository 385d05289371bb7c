"""The everyday matrix as data: fronts × settings × entry points, each cell against torch's own wrapper on gloo.

A *cell* is one configuration (a dict: dimension -> value) whose first dimension is the front (ddp, zero1, zero2,
fully_shard, fsdp) and whose others are the settings users turn on next. Each entry point
(``support/matrix_<entry>.py``: plain torch, accelerate, the Trainer, Lightning) declares the dimensions it offers
(``DIMENSIONS``) and runs one cell on one *side*: ``"torch"`` (the entry point with torch's own wrapper for that
front -- DDP for ddp / zero1 / zero2, FSDP2 for fully_shard, FSDP1 for fsdp -- on the gloo backend: the anchor) or
``"shardkit"`` (shardkit's front on shardkit's backend), returning what the cell measured (losses, norms, the final
full state dict, what the after-training check saw).

- ``pairwise(dimensions)``: cells in which every pair of values of every two dimensions occurs at least once (a
  greedy all-pairs cover, deterministic). The front is one of the dimensions, so every front meets every setting
  and every two settings meet on some front: what ``make test`` runs, one launch per entry point. Costly values
  (``COSTLY``: compile) are packed into as few cells as their pairs need.
  ``whole(dimensions)``: every combination, for ``make matrix``.
- ``run_launch``: one launched job, every cell of one entry point in turn: the anchor on a fresh gloo default
  group, then shardkit on a fresh shardkit default group (the default group is destroyed and made again between
  them, through a new file store each time).
- ``UNSUPPORTED``: the combinations shardkit refuses, each with the error it must raise (a regular expression). A
  cell that hits one must raise exactly that on every rank; any other error, on either side, fails the test.
- ``compare``: the shardkit side against the anchor, with a tolerance per precision; an entry point whose anchor for
  a cell is not like for like (its library cannot run torch's wrapper for that front on a CPU) widens it there with a
  ``tolerance(cell)`` function that says why.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import re
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

FRONTS = ("ddp", "zero1", "zero2", "fully_shard", "fsdp")
ENTRY_POINTS = ("torch", "accelerate", "trainer", "lightning")

# Tolerances by precision: fp32 parity is near-bitwise; bf16/fp16 round the compute, and a reduction summed in
# another order than gloo's moves a rounded value by an ulp of the low precision.
TOLERANCE = {"fp32": dict(rtol=2e-5, atol=2e-6), "bf16": dict(rtol=3e-2, atol=3e-3),
             "fp16": dict(rtol=1e-2, atol=1e-3)}

# (entry point or "*", {dimension: value, ...}) -> the error shardkit raises for it. Kept short: each row is a
# feature that is not built, and the note of the session that added it says why.
UNSUPPORTED: list[tuple[str, dict[str, Any], str]] = [
    # fp16 loss scaling needs the scaler to unscale and check the gradients; ZeRO-2's live in shards it cannot see.
    ("torch", {"front": "zero2", "precision": "fp16"},
     r"NotImplementedError: ZeroRedundancyOptimizer \(rank \d\): zero_stage=2 with torch\.amp\.GradScaler"),
    # Lightning leads with FSDP2 (ModelParallelStrategy); ShardkitStrategy offers fully_shard, not the FSDP1 front.
    ("lightning", {"front": "fsdp"},
     r"ValueError: ShardkitStrategy: strategy='fsdp' \(shardkit's FSDP1 front\) is not offered under Lightning"),
]


# Values that make a cell cost several times what the others do (a compile cell: ~8 s per side, where the others
# take ~1 s). The pairwise cover packs their pairs into as few cells as it can (test_matrix.py checks the minimum).
COSTLY: dict[str, tuple] = {"compile": (True,)}


def pairwise(dimensions: dict[str, tuple], refused: list[dict[str, Any]] = (),
             costly: dict[str, tuple] = COSTLY) -> list[dict[str, Any]]:
    """Cells covering every pair of values of every two dimensions at least once (greedy; deterministic).

    ``refused``: partial cells (settings shardkit refuses together). No covering cell contains one, since a cell
    that raises tests none of its other pairs; instead each refused combination gets one cell of its own (the first
    value of every other dimension), which asserts the refusal.
    ``costly``: values that make a cell cost far more than the others (``COSTLY``). Their pairs are covered first,
    packed into as few cells as the other dimensions allow; the cells that follow never take them."""
    names = list(dimensions)

    def allowed(cell: dict[str, Any]) -> bool:
        return not any(all(k in cell and cell[k] == v for k, v in row.items()) for row in refused)

    def is_costly(pair: tuple[str, Any]) -> bool:
        return pair[1] in costly.get(pair[0], ())

    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in dimensions[a] for vb in dimensions[b] if allowed({a: va, b: vb})}
    cells: list[dict[str, Any]] = []
    while uncovered:
        # Start from the first uncovered pair (one with a costly value while any is left), then fill each other
        # dimension with the allowed value covering most.
        costly_left = {p for p in uncovered if is_costly(p[0]) or is_costly(p[1])}
        (a, va), (b, vb) = min(costly_left or uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]),
                                                                         str(p[0][1]), str(p[1][1])))
        cell = {a: va, b: vb}
        for name in names:
            if name in cell:
                continue

            def gain(value: Any) -> int:
                return sum(((n, cell[n]), (name, value)) in uncovered or ((name, value), (n, cell[n])) in uncovered
                           for n in cell)

            candidates = [v for v in dimensions[name] if allowed({**cell, name: v})]
            if not costly_left:
                candidates = [v for v in candidates if not is_costly((name, v))] or candidates
            cell[name] = max(candidates, key=gain)  # ties: the first value (the default setting)
        ordered = {name: cell[name] for name in names}
        uncovered -= {((x, ordered[x]), (y, ordered[y])) for x, y in itertools.combinations(names, 2)}
        cells.append(ordered)
    for row in refused:
        cells.append({name: row.get(name, dimensions[name][0]) for name in names})
    return cells


def whole(dimensions: dict[str, tuple]) -> list[dict[str, Any]]:
    names = list(dimensions)
    return [dict(zip(names, values)) for values in itertools.product(*(dimensions[n] for n in names))]


def covered_pairs(cells: list[dict[str, Any]]) -> set:
    return {((a, c[a]), (b, c[b])) for c in cells for a, b in itertools.combinations(list(c), 2)}


def cell_name(cell: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in cell.items())


def expected_error(entry: str, cell: dict[str, Any]) -> str | None:
    """The error shardkit must raise for this cell, or None where it must train."""
    for row_entry, settings, error in UNSUPPORTED:
        if row_entry in ("*", entry) and all(cell.get(k) == v for k, v in settings.items()):
            return error
    return None


def cells_for(entry: str, scope: str) -> list[dict[str, Any]]:
    dimensions = importlib.import_module(f"support.matrix_{entry}").DIMENSIONS
    refused = [settings for row_entry, settings, _ in UNSUPPORTED if row_entry in ("*", entry)]
    return whole(dimensions) if scope == "whole" else pairwise(dimensions, refused)


# --- inside a launched job -------------------------------------------------------------------------------------
@contextlib.contextmanager
def fresh_default_group(backend: str | None, rank: int, world: int, directory: str,
                        timeout_s: float = 60.0, env: dict[str, str] | None = None) -> Iterator[None]:
    """A default process group of its own for one run of a job that runs several in turn: made through a new file
    store in ``directory`` (``backend`` None: the run makes its own, as its library does), and on leaving, once every
    rank is done with it, destroyed, with the environment as it was before (libraries' teardowns edit it: Lightning
    drops WORLD_SIZE). ``env``: variables set for this run alone, before its group starts (SHARDKIT_HOST_ID: shardkit
    reads the host identity at every group's start-up). test_transformers.py's and test_lightning.py's jobs of
    several runs go through it too."""
    from datetime import timedelta

    import torch.distributed as dist

    environment = dict(os.environ)
    os.environ.update(env or {})
    try:
        if backend is not None:
            dist.init_process_group(backend, init_method=f"file://{directory}/store", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        yield
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()  # no rank tears its group down under a peer still using it
            except Exception:  # noqa: BLE001 - a failed run may have broken the group
                pass
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


def run_launch(rank: int, world: int, entry: str, cells: list[dict[str, Any]], workdir: str,
               timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every cell on both sides, in turn. A side's exception is recorded (as text), never raised, so one cell's
    failure does not hide the others'. Each side gets a fresh default process group."""
    import time
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # torch's and the libraries' advice, repeated per cell, hides the failures
    runner = importlib.import_module(f"support.matrix_{entry}")
    results = []
    for index, cell in enumerate(cells):
        outcome: dict[str, Any] = {"cell": cell}
        for side, backend in (("torch", "gloo"), ("shardkit", "shardkit")):
            directory = os.path.join(workdir, f"cell{index}-{side}")
            os.makedirs(directory, exist_ok=True)
            torch._dynamo.reset()
            started = time.perf_counter()
            try:
                with fresh_default_group(backend, rank, world, directory, timeout_s):
                    outcome[side] = runner.run_cell(side, cell, rank, world, directory)
            except Exception as error:  # noqa: BLE001 - the test judges every error against UNSUPPORTED
                outcome[f"{side}_error"] = f"{type(error).__name__}: {error}"
                outcome[f"{side}_traceback"] = traceback.format_exc()
            outcome[f"{side}_seconds"] = round(time.perf_counter() - started, 2)
        results.append(outcome)
    return results


# --- in the test process ---------------------------------------------------------------------------------------
def _normalise(key: str) -> str:
    """A parameter's name as both sides spell it: wrappers' prefixes removed (checkpoint_wrapper, compile, DDP)."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "module.", "_fsdp_wrapped_module."):
        key = key.replace(prefix, "")
    return key


def compare(entry: str, outcomes_by_rank: list[list[dict[str, Any]]]) -> list[str]:
    """Problems found in one launch's cells (empty: every cell passed or raised its named error)."""
    runner = importlib.import_module(f"support.matrix_{entry}")  # may widen a cell's tolerance (``tolerance``)
    problems = []
    for index, cell in enumerate(outcomes_by_rank[0]):
        settings = cell["cell"]
        name = f"{entry}[{cell_name(settings)}]"
        expected = expected_error(entry, settings)
        for rank, outcomes in enumerate(outcomes_by_rank):
            outcome = outcomes[index]
            if "torch_error" in outcome:
                problems.append(f"{name} rank {rank}: the anchor (torch on gloo) failed: {outcome['torch_traceback']}")
                continue
            error = outcome.get("shardkit_error")
            if expected is not None:
                if error is None or not re.search(expected, error):
                    problems.append(f"{name} rank {rank}: expected shardkit to raise /{expected}/, got "
                                    f"{error or 'no error'}")
                continue
            if error is not None:
                problems.append(f"{name} rank {rank}: shardkit failed: {outcome['shardkit_traceback']}")
                continue
            tolerance = (getattr(runner, "tolerance", lambda cell: None)(settings)
                         or TOLERANCE[settings.get("precision", "fp32")])
            problems += [f"{name} rank {rank}: {p}"
                         for p in _differences(outcome["torch"], outcome["shardkit"], tolerance)]
    return problems


def _differences(anchor: dict[str, Any], ours: dict[str, Any], tolerance: dict[str, float]) -> list[str]:
    """What differs between the two sides' measurements (same keys; arrays and floats within ``tolerance``;
    state dicts compared by normalised names; anything else exactly)."""
    found = []
    for key in sorted(set(anchor) | set(ours)):
        if key not in anchor or key not in ours:
            found.append(f"{key!r} measured on one side only")
            continue
        a, b = anchor[key], ours[key]
        if isinstance(a, dict):
            a = {_normalise(k): v for k, v in a.items()}
            b = {_normalise(k): v for k, v in b.items()}
            if set(a) != set(b):
                found.append(f"{key}: names differ: torch only {sorted(set(a) - set(b))}, "
                             f"shardkit only {sorted(set(b) - set(a))}")
                continue
            for name in sorted(a):
                if not _close(a[name], b[name], tolerance):
                    found.append(f"{key}[{name}] differs: max |diff| "
                                 f"{np.max(np.abs(np.asarray(a[name], np.float64) - np.asarray(b[name], np.float64)))}")
        elif isinstance(a, (list, tuple)) and not all(isinstance(x, (int, float)) for x in list(a) + list(b)):
            if list(a) != list(b):
                found.append(f"{key} differs: torch {a}, shardkit {b}")
        elif isinstance(a, (list, tuple, np.ndarray, float)):
            if not _close(a, b, tolerance):
                found.append(f"{key} differs: torch {a}, shardkit {b}")
        elif a != b:
            found.append(f"{key} differs: torch {a!r}, shardkit {b!r}")
    return found


def _close(a: Any, b: Any, tolerance: dict[str, float]) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, equal_nan=True, **tolerance))

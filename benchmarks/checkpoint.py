"""FSDP checkpoints: save and load time and peak RSS, shardkit FSDP vs torch FSDP2, sharded (DCP) and full.

    python benchmarks/checkpoint.py               # world 2, ~30M-parameter GPT (fsdp_step.py's), ~4 minutes
    python benchmarks/checkpoint.py --quick       # tiny model, 2 rounds, RSS of the full save only (< 2 minutes)
    python benchmarks/checkpoint.py --kinds full --rounds 12 --no-rss

One job of spawned ranks; their default group is shardkit (both wrappers run over it, as in fsdp_step.py)
and they also hold a gloo group, used only to agree on times and outcomes. Each system wraps its own copy
of the same seeded GPT (fsdp_step.py's, tied embedding / LM head) and takes one AdamW step on the same
synthetic tokens, so optimizer state exists; then the same state is saved and loaded again and again:

  shardkit  shardkit.FullyShardedDataParallel FULL_SHARD, transformer_auto_wrap_policy over Block
  fsdp2     torch FSDP2: fully_shard per Block, then the root, on init_device_mesh("cpu", (2,))

and four operations of each, model + AdamW optimizer state every time:

  sharded save  shardkit: under FSDP.state_dict_type(model, SHARDED_STATE_DICT), {"model": model.state_dict(),
                "optim": FSDP.optim_state_dict(model, opt)}; fsdp2: get_state_dict(model, opt) (DTensors).
                Then torch.distributed.checkpoint.save(state, checkpoint_id=DIR) on every rank (default
                FileSystemWriter: one file per rank, fsync'ed).
  sharded load  the same state dict as a skeleton (views of the live shards), dcp.load into it, then set:
                shardkit: model.load_state_dict + FSDP.optim_state_dict_to_load(..., load_directly=True);
                fsdp2: set_state_dict(model, opt, model_state_dict=..., optim_state_dict=...).
  full save     gathered to rank 0, offloaded to CPU: shardkit: FULL_STATE_DICT with
                FullStateDictConfig(offload_to_cpu=True, rank0_only=True), model.state_dict() and
                FSDP.optim_state_dict; fsdp2: get_state_dict with StateDictOptions(full_state_dict=True,
                cpu_offload=True) (which keeps values on rank 0 only). Rank 0 torch.save's
                {"model": ..., "optim": ...} into one file (no fsync, as torch.save does).
  full load     every rank torch.load's the file (defaults: weights_only=True, read into memory, no mmap), then
                shardkit: FULL_STATE_DICT model.load_state_dict + FSDP.optim_state_dict_to_load(...,
                load_directly=True); fsdp2: set_state_dict(..., options=StateDictOptions(full_state_dict=True))
                — the every-rank-reads form; broadcast_from_rank0=True (rank 0 reads, broadcasts) is the
                other torch offers and is not measured here.

Every measurement writes a fresh directory under one scratch directory (``--scratch``, default the system
temp dir; the filesystem is recorded in the JSON: ext4 on a virtio disk here), removed after its load; the
loads read files just written, so from the page cache. Before each operation rank 0 calls sync(), so the
dirty pages of earlier ones (a full save's file is not fsync'ed) are not flushed inside the next one's
fsync. The scratch directory goes at the end.

Correctness: before every load each rank overwrites its parameter shards and all its optimizer state (moments
and step) with NaN, so a load that misses anything shows. After the load, every rank's local shards of the
parameters and of the optimizer state must equal, bit for bit, a copy taken before the first save, and one
eval forward on a fixed batch must give exactly the loss it gave before the save. A load that raises or
fails these checks is a failed row (the reason and the traceback's head are recorded); so is a save that
raises, with its load skipped. The two systems' pre-save eval losses must agree (rel. 1e-4): same model.

Timing: the first round (``--warmup``) is untimed; in round r the systems take turns in an order that
alternates with r: both save (sharded), both load it, both save (full), both load it. Each operation starts
after a barrier; its time is the slowest rank's (and so are its phases: state dict / write; state dict / read /
set; gather / write; read / set); best and median over rounds; ratios shardkit ÷ fsdp2 of the medians, and the
per-round ratios (the interleaving makes a round's pair comparable).

Peak RSS: each (system, operation) in fresh ranks, as fsdp_step.py does: glibc returns large frees to the
OS, a miniature GPT wrapped the same way runs the same operation once (kernel code and DCP's one-off state
resident), then the real model is built and stepped (and, for a load, saved and overwritten with NaN). Right
before the operation the peak is reset (``echo 5 > /proc/self/clear_refs``, which sets VmHWM to the current
RSS); the figure is VmHWM after the operation minus the RSS at the reset: what the operation added at its
peak, per rank (rank 0 holds the whole model for a full save). Where clear_refs cannot be written, the
ru_maxrss growth over the process's earlier peak is recorded instead (a lower bound), and the JSON says so.

Targets (issue #11): each operation's time ≤ 1.0× torch FSDP2 + DCP's (medians); peak RSS growth during a
full save ≤ FSDP2's (the fuller rank, rank 0).

Results: ``benchmarks/results/checkpoint.{json,png}`` (``--quick`` writes ``checkpoint_quick.*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _common import (  # noqa: E402
    MiB,
    filesystem_of,
    format_table,
    live_rss_bytes,
    mib,
    peak_rss_bytes,
    plot_bar_panels,
    return_large_frees_to_os,
    synthetic_token_batches,
)
from _gpt import GPT, QUICK_MODEL, Block, ModelConfig, n_params  # noqa: E402
from _harness import (  # noqa: E402
    RESULTS_DIR,
    ForeignLoad,
    RunConfig,
    add_target,
    agree_max,
    header,
    init_groups,
    interleaved_rounds,
    launch_attempts,
    load_note,
    machine_info,
    probe,
    rank0_progress,
    round_ratios,
    save_results,
    utc_now,
    warn_if_busy,
    wrote,
)

LR = 1e-3
LOSS_RTOL = 1e-4
KINDS = ("sharded", "full")
OPERATIONS = ("sharded_save", "sharded_load", "full_save", "full_load")
PHASES = {"sharded_save": ("state_dict", "write"), "sharded_load": ("state_dict", "read", "set"),
          "full_save": ("gather", "write"), "full_load": ("read", "set")}
FULL_FILE = "full.pt"


@dataclasses.dataclass(frozen=True)
class System:
    key: str
    label: str


SYSTEMS: tuple[System, ...] = (
    System("shardkit", "shardkit FSDP FULL_SHARD + DCP"),
    System("fsdp2", "torch FSDP2 + DCP"),
)
ANCHOR = "fsdp2"


def system(key: str) -> System:
    return next(s for s in SYSTEMS if s.key == key)


def op_label(op: str) -> str:
    return op.replace("_", " ")


# --- building and stepping ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Built:
    system: System
    model: nn.Module
    optimizer: torch.optim.Optimizer


def build(key: str, cfg: ModelConfig, groups: dict[str, Any]) -> Built:
    """The same seeded GPT, wrapped by ``key``'s FSDP over the default (shardkit) group, with AdamW."""
    torch.manual_seed(0)
    module = GPT(cfg)
    if key == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in module.blocks:
            fully_shard(block, mesh=groups["mesh"])
        model: nn.Module = fully_shard(module, mesh=groups["mesh"])
    else:
        from shardkit import FullyShardedDataParallel as FSDP
        from shardkit.wrap import transformer_auto_wrap_policy

        model = FSDP(module, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                transformer_layer_cls={Block}))
    return Built(system(key), model, torch.optim.AdamW(model.parameters(), lr=LR))


def train_step(built: Built, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    tokens, targets = batch
    loss = F.cross_entropy(built.model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def eval_loss(built: Built, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    tokens, targets = batch
    with torch.no_grad():
        loss = F.cross_entropy(built.model(tokens).flatten(0, 1), targets.flatten()).item()
    if built.system.key == "fsdp2":  # FSDP2 keeps the root unsharded after a forward without backward
        built.model.reshard()
    return loss


# --- the operations ----------------------------------------------------------------------------------------
# Each calls ``mark()`` at the end of each of its phases (PHASES[op]); the checkpoint lives in the directory ``path``.

class Marks:
    """Phase boundaries of one operation: the time at each, and with ``rss`` the peak RSS so far (VmHWM)."""

    def __init__(self, rss: bool = False) -> None:
        self.rss = rss
        self.times = [time.perf_counter()]
        self.peaks: list[int | None] = []

    def __call__(self) -> None:
        self.times.append(time.perf_counter())
        if self.rss:
            self.peaks.append(_status_kib("VmHWM:"))

    def phases(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def _dcp_state(built: Built) -> dict[str, Any]:
    """The sharded state dict of model + optimizer, as each system's user gets it (no copies in either)."""
    if built.system.key == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(built.model, built.optimizer)
        return {"model": msd, "optim": osd}
    from shardkit import FullyShardedDataParallel as FSDP
    from shardkit.fsdp import StateDictType

    with FSDP.state_dict_type(built.model, StateDictType.SHARDED_STATE_DICT):
        return {"model": built.model.state_dict(), "optim": FSDP.optim_state_dict(built.model, built.optimizer)}


def sharded_save(built: Built, path: Path, mark: Callable[[], None]) -> None:
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(built)
    mark()
    dcp.save(state, checkpoint_id=str(path))
    mark()


def sharded_load(built: Built, path: Path, mark: Callable[[], None]) -> None:
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(built)
    mark()
    dcp.load(state, checkpoint_id=str(path))
    mark()
    if built.system.key == "fsdp2":
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(built.model, built.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        from shardkit import FullyShardedDataParallel as FSDP
        from shardkit.fsdp import StateDictType

        with FSDP.state_dict_type(built.model, StateDictType.SHARDED_STATE_DICT):
            built.model.load_state_dict(state["model"])
            FSDP.optim_state_dict_to_load(built.model, built.optimizer, state["optim"], load_directly=True)
    mark()


def full_save(built: Built, path: Path, mark: Callable[[], None]) -> None:
    if built.system.key == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(built.model, built.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        from shardkit import FullyShardedDataParallel as FSDP
        from shardkit.fsdp import FullStateDictConfig, StateDictType

        with FSDP.state_dict_type(built.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            msd = built.model.state_dict()
            osd = FSDP.optim_state_dict(built.model, built.optimizer)
    mark()
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, path / FULL_FILE)
    mark()


def full_load(built: Built, path: Path, mark: Callable[[], None]) -> None:
    state = torch.load(path / FULL_FILE)
    mark()
    if built.system.key == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(built.model, built.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        from shardkit import FullyShardedDataParallel as FSDP
        from shardkit.fsdp import FullStateDictConfig, StateDictType

        with FSDP.state_dict_type(built.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            built.model.load_state_dict(state["model"])
            FSDP.optim_state_dict_to_load(built.model, built.optimizer, state["optim"], load_directly=True)
    mark()


RUN_OP: dict[str, Callable[[Built, Path, Callable[[], None]], None]] = {
    "sharded_save": sharded_save, "sharded_load": sharded_load, "full_save": full_save, "full_load": full_load}


# --- correctness -------------------------------------------------------------------------------------------

def local_state(built: Built) -> list[torch.Tensor]:
    """This rank's pieces of the parameters and of every optimizer state tensor, in a fixed order (a DTensor's
    local shard; shardkit's parameters are already the pieces)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    out = [local(p).detach() for p in built.model.parameters()]
    opt = built.optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            out += [local(state[k]).detach() for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def snapshot(built: Built) -> list[torch.Tensor]:
    return [t.clone() for t in local_state(built)]


def scramble(built: Built) -> None:
    """NaN into every local parameter piece and optimizer state tensor: what a load leaves out shows."""
    with torch.no_grad():
        for t in local_state(built):
            t.fill_(float("nan") if t.is_floating_point() else -1)


def restore(built: Built, reference: list[torch.Tensor]) -> str | None:
    """The saved state copied back into this rank's pieces after a failed load; why not, where it cannot be."""
    now = local_state(built)
    if [t.shape for t in now] != [t.shape for t in reference]:
        return "the local state tensors no longer have the shapes they had before the save"
    with torch.no_grad():
        for t, saved in zip(now, reference):
            t.copy_(saved)
    return None


def check_loaded(built: Built, reference: list[torch.Tensor], loss_before: float,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """None when this rank's state is bit for bit the one saved and the eval loss is unchanged; else why not."""
    now = local_state(built)
    if len(now) != len(reference):
        return f"{len(now)} local state tensors after the load, {len(reference)} before the save"
    bad = [i for i, (a, b) in enumerate(zip(now, reference))
           if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b)]
    if bad:
        nan = sum(int(now[i].isnan().any()) for i in bad if now[i].is_floating_point())
        return (f"{len(bad)} of {len(now)} local state tensors differ from the saved ones after the load "
                f"({nan} still hold NaN); first index {bad[0]}")
    loss = eval_loss(built, batch)
    if loss != loss_before:
        return f"eval loss {loss!r} after the load, {loss_before!r} before the save"
    return None


# --- memory ------------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int | None:
    try:
        for entry in Path("/proc/self/status").read_text().splitlines():
            if entry.startswith(field):
                return int(entry.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """VmHWM := the current RSS (Linux: ``5`` into /proc/self/clear_refs); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# --- the ranks ---------------------------------------------------------------------------------------------

def setup_groups(rank: int, world: int, store: str, timeout_s: float) -> dict[str, Any]:
    """Default group shardkit (the one both wrappers and DCP use), a gloo group for agreeing, FSDP2's mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
    return {"gloo": init_groups(rank, world, store, timeout_s, gloo_timeout=True),
            "mesh": init_device_mesh("cpu", (world,))}


def _error_head(limit: int = 1500) -> str:
    """The exception line first, then the traceback's innermost frames (what failed where), bounded."""
    lines = traceback.format_exc().rstrip().splitlines()
    return "\n".join([lines[-1], *lines[-12:-1]])[:limit]


def timed(op: str, built: Built, path: Path, gloo: Any) -> tuple[list[float], str | None]:
    """One operation on every rank after a barrier: ([total, *phases], each the slowest rank's), and the error
    of the first rank that raised (None if none did); all ranks agree on both."""
    if dist.get_rank() == 0:  # earlier operations' dirty pages are flushed now, not by this one's fsync
        os.sync()
    dist.barrier()
    marks = Marks()
    error = None
    try:
        RUN_OP[op](built, path, marks)
        phases = marks.phases()
    except Exception:  # noqa: BLE001 - a failing path is a result, reported with its reason
        error, phases = _error_head(), [0.0] * len(PHASES[op])
    total = time.perf_counter() - marks.times[0]
    failed, *times = agree_max([float(error is not None), total, *phases], gloo)
    return times, agreed_error(error, gloo) if failed else None


def agreed_error(error: str | None, gloo: Any) -> str | None:
    """The first rank's error (or None on all ranks when none has one)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=gloo)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rank_main(rank: int, world: int, store: str, run: RunConfig, scratch: str) -> dict[str, Any]:
    groups = setup_groups(rank, world, store, run.pg_timeout_s)
    gloo = groups["gloo"]
    cfg = run.model

    progress = rank0_progress(rank)

    train, probe = synthetic_token_batches(cfg.vocab, cfg.batch, cfg.seq, rank, 2)
    systems = list(dict.fromkeys(k.split(":")[0] for k in run.keys))
    kinds = [kind for kind in KINDS if any(k.endswith(":" + kind) for k in run.keys)]
    status: dict[str, dict[str, str]] = {s: {} for s in systems}
    built: dict[str, Built] = {}
    reference: dict[str, list[torch.Tensor]] = {}
    loss_before: dict[str, float] = {}
    for s in systems:
        try:
            b = build(s, cfg, groups)
            train_step(b, train)
            loss_before[s] = eval_loss(b, probe)
            reference[s] = snapshot(b)
            built[s], error = b, None
        except Exception:  # noqa: BLE001
            error = _error_head()
        error = agreed_error(error, gloo)
        if error is not None:
            status[s] = {op: f"failed: build / first step: {error}" for op in OPERATIONS}
            built.pop(s, None)
    for s in systems:
        for kind in kinds:
            if f"{s}:{kind}" in run.keys and s in built:
                status[s].update({f"{kind}_save": "ok", f"{kind}_load": "ok"})

    samples: dict[str, dict[str, list[list[float]]]] = {s: {op: [] for op in OPERATIONS} for s in systems}
    disk: dict[str, dict[str, int]] = {s: {} for s in systems}
    active = [s for s in systems if s in built]
    alternate = lambda keys, r: list(keys) if r % 2 == 0 else list(keys)[::-1]  # noqa: E731
    for r, order, timed_round in interleaved_rounds(active, run.warmup, run.rounds, progress, order=alternate):
        for kind in kinds:
            save, load = f"{kind}_save", f"{kind}_load"
            paths = {s: Path(scratch) / f"round{r}-{kind}-{s}" for s in order}
            saved = []
            for s in order:
                if status[s].get(save) != "ok":
                    continue
                if rank == 0:
                    paths[s].mkdir(parents=True)
                times, error = timed(save, built[s], paths[s], gloo)
                if error is not None:
                    status[s][save] = f"failed: {error}"
                    if status[s].get(load) == "ok":
                        status[s][load] = "skipped: its save failed"
                    continue
                saved.append(s)
                if timed_round:
                    samples[s][save].append(times)
                if rank == 0:
                    disk[s][kind] = dir_bytes(paths[s])
            for s in order:
                if s not in saved or status[s].get(load) != "ok":
                    continue
                scramble(built[s])
                times, error = timed(load, built[s], paths[s], gloo)
                if error is None:
                    error = agreed_error(check_loaded(built[s], reference[s], loss_before[s], probe), gloo)
                    if error is not None:
                        error = f"wrong result: {error}"
                if error is not None:
                    status[s][load] = f"failed: {error}"
                    # The other operations go on from the saved state, not from what the failed load left.
                    if agreed_error(restore(built[s], reference[s]), gloo) is not None:
                        for op in OPERATIONS:
                            if status[s].get(op) == "ok":
                                status[s][op] = f"skipped: the state could not be restored after the {op_label(load)}"
                    continue
                if timed_round:
                    samples[s][load].append(times)
            dist.barrier(group=gloo)
            if rank == 0:
                for path in paths.values():
                    shutil.rmtree(path, ignore_errors=True)
    # Every rank's pre-save loss, for the check that both systems hold the same model.
    losses = {s: [0.0] * world for s in loss_before}
    for s in loss_before:
        dist.all_gather_object(losses[s], loss_before[s], group=gloo)
    return {"status": status, "samples": samples, "disk_bytes": disk, "loss_before_save": losses}


def rss_probe(rank: int, world: int, store: str, run: RunConfig, scratch: str, key: str, op: str) -> dict[str, Any]:
    """One (system, operation) in fresh ranks: the peak RSS the operation adds over the RSS right before it."""
    fixed = return_large_frees_to_os()
    groups = setup_groups(rank, world, store, run.pg_timeout_s)
    gloo = groups["gloo"]
    kind = op.split("_")[0]
    root = Path(scratch) / f"rss-{key}-{op}"
    warm, real = root / "warm", root / "real"
    if rank == 0:
        warm.mkdir(parents=True)
        real.mkdir(parents=True)
    dist.barrier(group=gloo)

    def prepare(cfg: ModelConfig, path: Path) -> tuple[Built, list[torch.Tensor], float, Any]:
        train, probe = synthetic_token_batches(cfg.vocab, cfg.batch, cfg.seq, rank, 2)
        built = build(key, cfg, groups)
        train_step(built, train)  # its backward ends with every unit resharded, in both systems
        reference, loss = [], float("nan")
        if op.endswith("load"):
            # The reference, the checkpoint to load, then state that the load must overwrite. The eval forward
            # leaves shardkit's root unit gathered; the save after it frees it, as a training step would.
            loss, reference = eval_loss(built, probe), snapshot(built)
            RUN_OP[f"{kind}_save"](built, path, Marks())
            dist.barrier()
            scramble(built)
        return built, reference, loss, probe

    # The same operation once on a miniature GPT: code paths and one-off state are not charged to it.
    mini, *_ = prepare(QUICK_MODEL, warm)
    RUN_OP[op](mini, warm, Marks())
    del mini
    dist.barrier()

    built, reference, loss, probe = prepare(run.model, real)
    gc.collect()
    dist.barrier()
    before = live_rss_bytes()
    reset = reset_peak_rss()
    base = _status_kib("VmHWM:") if reset else peak_rss_bytes()
    marks = Marks(rss=reset)
    RUN_OP[op](built, real, marks)
    peak = _status_kib("VmHWM:") if reset else peak_rss_bytes()
    after = live_rss_bytes()
    error = check_loaded(built, reference, loss, probe) if op.endswith("load") else None
    dist.barrier(group=gloo)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"peak_growth": peak - base, "peak": peak, "baseline": base,
            "peak_growth_by_phase": {name: at - base for name, at in zip(PHASES[op], marks.peaks)} if reset else None,
            "method": "VmHWM reset by clear_refs" if reset else "ru_maxrss growth (clear_refs refused)",
            "live_before": before["live"], "live_after_growth": after["live"] - before["live"],
            "anon_after_growth": after.get("anon", 0) - before.get("anon", 0),
            "shmem_after_growth": after.get("shmem", 0) - before.get("shmem", 0),
            "mmap_threshold_fixed": fixed, "load_check": error or "ok"}


# --- reporting ---------------------------------------------------------------------------------------------

def summarize(raw: list[dict[str, Any]], run: RunConfig) -> dict[tuple[str, str], dict[str, Any]]:
    """One row per (system, operation): status, time statistics (slowest rank), phases, bytes on disk."""
    head = raw[0]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for s in SYSTEMS:
        if s.key not in head["status"]:
            continue
        for op in OPERATIONS:
            if op not in head["status"][s.key]:
                continue
            row: dict[str, Any] = {"system": s.key, "label": s.label, "operation": op,
                                   "status": head["status"][s.key][op]}
            samples = head["samples"][s.key][op]
            if samples:
                totals = [x[0] for x in samples]
                row.update({"time_s": statistics.median(totals), "time_s_best": min(totals),
                            "time_s_samples": totals,
                            "phases_s": {name: statistics.median(x[1 + i] for x in samples)
                                         for i, name in enumerate(PHASES[op])}})
            kind = op.split("_")[0]
            if op.endswith("save") and kind in head["disk_bytes"][s.key]:
                row["bytes_on_disk"] = head["disk_bytes"][s.key][kind]
            if s.key in head["loss_before_save"]:
                row["eval_loss_before_save_by_rank"] = head["loss_before_save"][s.key]
            rows[(s.key, op)] = row
    return rows


def ok(rows: dict[tuple[str, str], dict[str, Any]], key: str, op: str) -> dict[str, Any] | None:
    row = rows.get((key, op))
    return row if row is not None and row["status"] == "ok" and "time_s" in row else None


def time_ratio(rows: dict[tuple[str, str], dict[str, Any]], op: str) -> float | None:
    ours, anchor = ok(rows, "shardkit", op), ok(rows, ANCHOR, op)
    return None if ours is None or anchor is None else ours["time_s"] / anchor["time_s"]


def paired(rows: dict[tuple[str, str], dict[str, Any]], op: str) -> list[float]:
    ours, anchor = ok(rows, "shardkit", op), ok(rows, ANCHOR, op)
    if ours is None or anchor is None:
        return []
    return round_ratios(ours["time_s_samples"], anchor["time_s_samples"])


def growth(row: dict[str, Any] | None, rank: int | None = None) -> float | None:
    """Peak RSS growth of one rank, or of the fuller rank (``rank=None``)."""
    probes = (row or {}).get("rss_by_rank")
    if not probes:
        return None
    return max(p["peak_growth"] for p in probes) if rank is None else probes[rank]["peak_growth"]


def print_tables(rows: dict[tuple[str, str], dict[str, Any]], run: RunConfig) -> None:
    table = []
    for op in OPERATIONS:
        for s in SYSTEMS:
            row = rows.get((s.key, op))
            if row is None:
                continue
            name = [op_label(op), s.label]
            if "time_s" not in row:
                table.append(name + [row["status"].split(":")[0]] + [""] * 7)
                continue
            ratio, per_round = time_ratio(rows, op), paired(rows, op)
            anchor_row = rows.get((ANCHOR, op))
            probes = row.get("rss_by_rank")
            rss_ratio = [growth(row, r) / growth(anchor_row, r) if growth(anchor_row, r) else None
                         for r in range(len(probes))] if probes and growth(anchor_row, 0) is not None else []
            table.append(name + [
                row["status"].split(":")[0], f"{row['time_s_best'] * 1e3:,.0f}", f"{row['time_s'] * 1e3:,.0f}",
                "-" if s.key == ANCHOR or ratio is None else
                f"{ratio:.3f}× ({statistics.median(per_round):.2f}; {min(per_round):.2f}–{max(per_round):.2f})",
                " / ".join(f"{v * 1e3:,.0f}" for v in row["phases_s"].values()),
                mib(row.get("bytes_on_disk")) if op.endswith("save") else "",
                " / ".join(mib(p["peak_growth"]) for p in probes) if probes else "-",
                "-" if s.key == ANCHOR or not rss_ratio else
                " / ".join("-" if x is None else f"{x:.2f}×" for x in rss_ratio)])
    print(f"\n=== save and load (ms: slowest rank; best and median of {run.rounds} interleaved rounds), peak RSS "
          f"growth per rank (MiB) ===")
    print(format_table(["operation", "system", "status", "best", "median", f"÷ {ANCHOR} (per round: median; range)",
                        "phases (median)", "on disk", "peak RSS Δ r0 / r1", f"÷ {ANCHOR} r0 / r1"], table, left=3))
    print("phases: sharded save = state dict / dcp.save; sharded load = state dict / dcp.load / set; full save = "
          "gather / torch.save (rank 0); full load = torch.load / set. ÷: shardkit ÷ fsdp2 of the medians. "
          "Peak RSS Δ: the operation's peak over the RSS right before it, fresh ranks (VmHWM reset)")
    by_phase = []
    for op in OPERATIONS:
        for s in SYSTEMS:
            probes = (rows.get((s.key, op)) or {}).get("rss_by_rank")
            if probes and all(p.get("peak_growth_by_phase") for p in probes):
                by_phase.append([op_label(op), s.label] + [
                    " / ".join(f"{name} {mib(v)}" for name, v in p["peak_growth_by_phase"].items()) for p in probes])
    if by_phase:
        print("\n=== where the peak comes from: peak RSS growth so far at the end of each phase (MiB) ===")
        print(format_table(["operation", "system"] + [f"rank {r}" for r in range(len(by_phase[0]) - 2)], by_phase,
                           left=4))
    for row in rows.values():
        if row["status"] != "ok":
            print(f"({row['system']} {op_label(row['operation'])}) {row['status']}")


def check_targets(rows: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def failed(op: str) -> str | None:
        row = rows.get(("shardkit", op))
        return None if row is None or row["status"] == "ok" else row["status"]

    for op in OPERATIONS:
        name = f"shardkit {op_label(op)} time ≤ 1.0× torch FSDP2 + DCP's (medians)"
        if failed(op):  # a shardkit path that raises or loads wrong values misses its target
            checks.append({"target": name, "status": "MISS", "value": None, "limit": 1.0, "reason": failed(op)})
            print(f"[MISS] {name}: {failed(op).splitlines()[0][:200]}")
        elif ("shardkit", op) in rows:
            add_target(checks, name, time_ratio(rows, op), 1.0, higher_is_better=False, unit="×")
    name = "shardkit full save peak RSS growth ≤ torch FSDP2's (fuller rank, rank 0)"
    ours, anchor = growth(rows.get(("shardkit", "full_save"))), growth(rows.get((ANCHOR, "full_save")))
    if failed("full_save"):
        checks.append({"target": name, "status": "MISS", "value": None, "limit": 1.0, "reason": failed("full_save")})
        print(f"[MISS] {name}: {failed('full_save').splitlines()[0][:200]}")
    elif ("shardkit", "full_save") in rows:
        add_target(checks, name, None if ours is None or anchor is None else ours / anchor, 1.0,
                   higher_is_better=False, unit=f"× ({mib(ours)} vs {mib(anchor)} MiB)" if ours and anchor else "×")
    # Correctness guard: the two systems saved the same trained model.
    losses = {s: rows[(s, op)]["eval_loss_before_save_by_rank"] for (s, op) in rows
              if "eval_loss_before_save_by_rank" in rows[(s, op)]}
    if "shardkit" in losses and ANCHOR in losses:
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses["shardkit"], losses[ANCHOR]))
        add_target(checks, f"both systems hold the same model: pre-save eval loss agrees (rel. ≤ {LOSS_RTOL:g})",
                   rel, LOSS_RTOL, higher_is_better=False, unit=" rel. diff")
    return checks


def plot(rows: dict[tuple[str, str], dict[str, Any]], path: Path, cfg: ModelConfig, psi: int) -> Path | None:
    names = [op_label(op) for op in OPERATIONS]

    def per_system(value) -> dict[str, list[float]]:
        out = {}
        for s in SYSTEMS:
            vals = [value(rows.get((s.key, op))) for op in OPERATIONS]
            out[s.label] = [float("nan") if v is None else v for v in vals]
        return out

    panels = {"time (median, slowest rank)": (names, per_system(
        lambda row: row["time_s"] * 1e3 if row and "time_s" in row and row["status"] == "ok" else None))}
    for rank in (0, 1) if any(r.get("rss_by_rank") for r in rows.values()) else ():
        panels[f"peak RSS growth, rank {rank}"] = (names, per_system(
            lambda row, r=rank: None if growth(row, r) is None else growth(row, r) / MiB))
    return plot_bar_panels(path, panels, ylabels={"time (median, slowest rank)": "ms", "peak RSS growth, rank 0": "MiB",
                                                  "peak RSS growth, rank 1": "MiB"},
                           grouped=tuple(panels),
                           suptitle=f"FSDP checkpoints, world 2, {psi / 1e6:.1f}M-parameter GPT + AdamW state "
                                    f"(CPU, shardkit backend)")


# --- main --------------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds, RSS of the full save only: a smoke test")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (every operation of every system once each)")
    p.add_argument("--layers", type=int, default=ModelConfig.layers)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="sharded (DCP) and/or full")
    p.add_argument("--systems", nargs="+", choices=[s.key for s in SYSTEMS], default=[s.key for s in SYSTEMS])
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak-RSS probes")
    p.add_argument("--scratch", type=Path, default=None,
                   help="where the checkpoint directories go (default: the system temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for checkpoint.json/png")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    world = 2
    if args.quick:
        cfg, warmup, rounds = QUICK_MODEL, 1, 2
    else:
        cfg, warmup, rounds = dataclasses.replace(ModelConfig(), layers=args.layers), args.warmup, args.rounds
    if warmup < 0 or rounds < 1:
        raise SystemExit("--warmup must be ≥ 0 and --rounds ≥ 1")
    keys = tuple(f"{s}:{kind}" for s in args.systems for kind in args.kinds)
    run = RunConfig(model=cfg, warmup=warmup, rounds=rounds, keys=keys, pg_timeout_s=120.0)
    psi = n_params(cfg)
    machine = machine_info()
    scratch = tempfile.mkdtemp(prefix="shardkit-ckpt-bench-", dir=args.scratch)
    fs = filesystem_of(scratch)
    print(header("shardkit checkpoint benchmark", machine, f"world {world}, 1 thread per rank, default group "
                 f"shardkit{' (--quick)' if args.quick else ''}"))
    print(f"model: GPT, vocab {cfg.vocab}, d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} blocks, tied LM "
          f"head: Ψ = {psi:,} parameters; model + AdamW state = {mib(12 * psi)} MiB in fp32")
    print(f"checkpoints under {scratch} ({fs}); {warmup} warm-up + {rounds} timed rounds")
    warn_if_busy(machine)

    try:
        attempts = [keys]
        if "shardkit" in args.systems and len(args.systems) > 1:  # a shardkit path that kills the job: keep FSDP2's
            attempts.append(tuple(k for k in keys if not k.startswith("shardkit:")))
        with ForeignLoad() as load:
            raw, _, job_error = launch_attempts(rank_main, world, attempts,
                                                lambda keys: (dataclasses.replace(run, keys=keys), scratch),
                                                timeout=1800.0,
                                                retry_note=lambda keys: "the job failed; again without shardkit's rows")
        if job_error is not None:
            raw[0]["status"]["shardkit"] = {f"{kind}_{what}": f"failed: the job died with it ({job_error[-1500:]})"
                                            for kind in args.kinds for what in ("save", "load")}
        rows = summarize(raw, run)
        for op in OPERATIONS:
            if (per_round := paired(rows, op)):
                rows[("shardkit", op)].update({f"time_vs_{ANCHOR}": time_ratio(rows, op),
                                               f"time_vs_{ANCHOR}_per_round": per_round})
        if not args.no_rss:
            for (key, op), row in rows.items():
                if row["status"] != "ok" or (args.quick and op != "full_save"):
                    continue
                probe(row, f"{key} {op_label(op)}", rss_probe, world, run, scratch, key, op, timeout=600.0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    if (note := load_note(load.cores, machine, "the timed job")):
        print("\n" + note)
    print_tables(rows, run)
    print("\n=== targets ===")
    checks = check_targets(rows)

    elapsed = time.monotonic() - started
    stem = "checkpoint_quick" if args.quick else "checkpoint"
    config = {"world": world, "model": dataclasses.asdict(cfg), "n_params": psi, "optimizer": "AdamW", "lr": LR,
              "threads_per_rank": 1, "default_group": "shardkit",
              "systems": {s.key: s.label for s in SYSTEMS},
              "scratch_filesystem": fs,
              "sharded": "dcp.save / dcp.load (default FileSystemWriter/Reader) of {'model', 'optim'}; shardkit "
                         "SHARDED_STATE_DICT + FSDP.optim_state_dict; fsdp2 get_state_dict / set_state_dict",
              "full": "gathered to rank 0 on CPU (shardkit FullStateDictConfig(offload_to_cpu, rank0_only); fsdp2 "
                      "StateDictOptions(full_state_dict, cpu_offload)), torch.save by rank 0; torch.load on every "
                      "rank, then shardkit FULL_STATE_DICT load / fsdp2 set_state_dict(full_state_dict=True)",
              "check": "after every load: local parameter and optimizer-state pieces bitwise equal to before the "
                       "save (overwritten with NaN first), eval loss unchanged",
              "timing": "barrier, then the operation; slowest rank; best and median over rounds; systems "
                        "alternate order by round",
              "rss": "fresh ranks per (system, operation): VmHWM after the operation minus the RSS at a VmHWM "
                     "reset (clear_refs 5) right before it"}
    payload = {"benchmark": "checkpoint", "quick": args.quick, "machine": machine, "config": config,
               "results": list(rows.values()),
               "runs": {"warmup_rounds": warmup, "timed_rounds": rounds, "foreign_load_cores": load.cores,
                        "machine_load_avg_1m": machine["load_avg_1m"], "git_commit": machine["git_commit"],
                        "finished": utc_now()},
               "targets": checks, "seconds": elapsed}
    json_path = args.out / f"{stem}.json"
    # A run of some kinds or systems keeps the others' rows, if they are of the same model.
    payload = save_results(json_path, payload, {"results": lambda r: (r["system"], r["operation"]),
                                                "targets": lambda t: t["target"]}, same_if="config")
    png_path = plot({(r["system"], r["operation"]): r for r in payload["results"]}, args.out / f"{stem}.png", cfg, psi)
    print("\n" + wrote(json_path, png_path) + f"; total {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

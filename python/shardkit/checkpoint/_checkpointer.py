"""``Checkpointer``: a training loop's checkpoints under one root — save every N steps, keep the newest K, and
resume exactly from the newest one that is whole.

    ckpt = Checkpointer("ckpt", every=100, keep=3)
    state = {"model": model, "optim": optimizer, "data": sampler}
    start = ckpt.load_latest(state) or 0
    for step in range(start, steps):
        train_one_step()
        ckpt.save_if_due(step + 1, state)
    ckpt.close()

Layout: ``root/step-00000100/`` (eight digits, the step the checkpoint resumes at), each a shardkit checkpoint
(save.py: committed by one rename, with a manifest of every file's size and CRC32C). What is saved, beside the
step (``_shardkit.step``):

- each value of ``state``: an ``nn.Module`` through ``shardkit.state_dict.get_model_state_dict`` (sharded:
  DDP, ZeRO, shardkit.fully_shard, the FSDP1 front, torch's own wrappers), an optimizer through
  ``get_optimizer_state_dict`` with the module of ``state`` that holds its parameters, any other object with
  ``state_dict``/``load_state_dict`` (a ResumableSampler, an LR scheduler, a GradScaler) through those, a dict
  as it is (loaded in place). An object's state dict is taken to be the same on every rank: DCP keeps one copy
  of an entry that every rank saves under the same key;
- every rank's RNG states (_rng.py: torch CPU, CUDA, Python ``random``, numpy), under per-rank keys
  (``_shardkit_rng.rank3.torch``: DCP would otherwise keep one rank's). Restored at the same world size only;
  at another one there is no rank-for-rank mapping of random streams (two ranks given one stream would draw the
  same dropout masks), so each rank keeps its own generators and a warning says so. Likewise, with a warning,
  where the saved generators do not fit this process's (saved with CUDA or numpy, resumed without).

``load_latest`` agrees on the candidates once (rank 0 lists the root, one all-gather hands its list to every
rank, so ranks that see the storage at different moments still choose alike), then tries them newest first:
``shardkit.checkpoint.load`` verifies every file (a collective; every rank raises the same
CheckpointIntegrityError) before loading anything, so a torn or bit-flipped checkpoint is skipped on every rank
together, with a warning naming it and why, and the next newest is tried. A ``step-*`` directory without a
manifest (not committed by shardkit's save) and a staging directory an interrupted save left are skipped with a
warning too. A checkpoint of another model (not an integrity failure) raises.

Retention (``keep=K``, rank 0, after the save that triggers it is committed: for an async save once its handle
says so, in ``wait()`` or the next save): of the committed checkpoints older than the one just written, all but
the K-1 newest are removed (renamed to a dot name first, so a half-removed one is never a ``step-*``
candidate). Never the one just written, never a newer one, never an uncommitted directory or a save's staging
directory. One async save is in flight at a time: the next save waits for it first (its error raises there).

The checkpoint package imports no front (docs/design.md, "Python"): shardkit.state_dict hands this module its
four functions when it is imported (``_front_protocol.use_state_dict_functions``; ``import shardkit`` imports it).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import _commit, _rng
from ._errors import CheckpointIntegrityError
from ._front_protocol import state_dict_functions
from ._load import load
from ._manifest import MANIFEST_NAME, read_manifest
from ._ranks import Ranks
from ._reader import read_metadata
from ._save import save

_STEP = re.compile(r"^step-(\d{8,})$")
_LEFTOVER = re.compile(r"^\.step-(\d{8,})\.shardkit-(staging|old)-")
_PRUNING = ".shardkit-pruning"
_STEP_KEY = "_shardkit"
_RNG_KEY = "_shardkit_rng"


@dataclasses.dataclass(frozen=True)
class _Scan:
    committed: list[tuple[int, str, int | None]]  # (step, path, world size in its manifest), oldest first
    skipped: list[tuple[str, str]]                # (path, why)


class Checkpointer:
    """Saves ``state`` every ``every`` steps under ``root`` (``root/step-00000100``), keeps the newest ``keep``
    (None: all), and resumes from the newest whole one; see the module docstring. ``async_save=True`` hands each
    save to ``shardkit.checkpoint.save(..., async_save=True)`` and returns while it writes. A collective object:
    every rank of ``process_group`` (default: the default group) makes the same calls in the same order."""

    def __init__(self, root: str | os.PathLike, every: int | None = None, keep: int | None = None,
                 async_save: bool = False, process_group: Any = None) -> None:
        if every is not None and every < 1:
            raise ValueError(f"shardkit Checkpointer: every={every}; save every 1 or more steps (None: only save())")
        if keep is not None and keep < 1:
            raise ValueError(f"shardkit Checkpointer: keep={keep}; keep 1 or more checkpoints (None: all)")
        if async_save and "async_save" not in inspect.signature(save).parameters:
            raise NotImplementedError("shardkit Checkpointer: async_save=True needs shardkit.checkpoint.save's "
                                      "async_save, which this shardkit does not have")
        self.root = Path(os.path.abspath(root))
        self.every, self.keep, self.async_save = every, keep, async_save
        self.process_group = process_group
        self._pending: tuple[int, Any] | None = None  # (step, AsyncSave handle) of the save in flight
        self._last_step: int | None = None  # the step last loaded or saved

    @property
    def last_step(self) -> int | None:
        """The step of the checkpoint this object last loaded or saved (None before either)."""
        return self._last_step

    # --- paths ---------------------------------------------------------------------------------------------------
    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def _scan(self) -> _Scan:
        """Rank 0's listing of the root (committed checkpoints, and what is skipped and why), handed to every
        rank by one all-gather."""
        ranks = Ranks(self.process_group)
        scan = None
        if ranks.rank == 0:
            committed: list[tuple[int, str, int | None]] = []
            skipped: list[tuple[str, str]] = []
            names = sorted(os.listdir(self.root)) if self.root.is_dir() else []
            for name in names:
                path = self.root / name
                if (match := _STEP.match(name)) and path.is_dir():
                    if not (path / MANIFEST_NAME).is_file():
                        skipped.append((str(path), "not committed (no shardkit manifest)"))
                        continue
                    try:
                        world: int | None = read_manifest(path).world_size  # type: ignore[union-attr]
                    except ValueError:
                        world = None  # its verification names the damage
                    committed.append((int(match.group(1)), str(path), world))
                elif _LEFTOVER.match(name):
                    skipped.append((str(path), "the staging directory of an interrupted save"))
            scan = _Scan(sorted(committed), skipped)
        agreed = ranks.all_gather(scan)[0]
        assert isinstance(agreed, _Scan)
        return agreed

    # --- load ------------------------------------------------------------------------------------------------
    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Loads the newest committed checkpoint under the root that passes verification into ``state`` (its
        modules, optimizers and objects, and this rank's RNG states); returns its step, or None when there is
        none. Skips the others with a warning naming each (see the module docstring). A collective."""
        self._check(state)
        ranks = Ranks(self.process_group)
        scan = self._scan()
        for path, why in scan.skipped:
            warnings.warn(f"shardkit Checkpointer (rank {ranks.rank}): skipped {path}: {why}", stacklevel=2)
        for step, path, world in reversed(scan.committed):
            try:
                self._load(Path(path), state, world, ranks)
            except CheckpointIntegrityError as error:
                warnings.warn(f"shardkit Checkpointer (rank {ranks.rank}): skipped {path}: it failed verification "
                              f"({error})", stacklevel=2)
                continue
            self._last_step = step
            return step
        return None

    def _load(self, path: Path, state: dict[str, Any], saved_world: int | None, ranks: Ranks) -> None:
        functions = state_dict_functions()
        template = self._state_dicts(state)
        template[_STEP_KEY] = {"step": -1}
        skip_rng = None  # why the RNG states are not restored
        if saved_world is not None and saved_world != ranks.world:
            skip_rng = (f"it was saved by {saved_world} ranks, this job has {ranks.world}: the RNG states are not "
                        "restored (each rank keeps its own generators)")
        else:
            saved, local = self._saved_rng_shapes(path, ranks), _rng.capture()
            shapes = {kind: list(value.shape) for kind, value in local.items()}
            if saved is not None and saved != shapes:  # saved with CUDA or numpy, or another number of GPUs
                differ = sorted(k for k in set(saved) | set(shapes) if saved.get(k) != shapes.get(k))
                skip_rng = (f"its RNG states {differ} do not fit this process's generators ({shapes}, saved "
                            f"{saved}): the RNG states are not restored")
            else:
                template[_RNG_KEY] = {f"rank{ranks.rank}": {k: torch.empty_like(v) for k, v in local.items()}}
        load(template, path, process_group=self.process_group)
        if skip_rng is not None:
            warnings.warn(f"shardkit Checkpointer (rank {ranks.rank}): {path}: {skip_rng}; the model, optimizer and "
                          "data position are restored", stacklevel=3)
        for key, value in state.items():  # modules before the optimizers that follow their parameters
            if isinstance(value, nn.Module):
                functions.set_model(value, template[key])
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                functions.set_optimizer(self._module_of(state, key, value), value, template[key])
            elif not isinstance(value, (nn.Module, dict)):
                value.load_state_dict(template[key])
        if skip_rng is None:
            _rng.restore(template[_RNG_KEY][f"rank{ranks.rank}"])

    def _saved_rng_shapes(self, path: Path, ranks: Ranks) -> dict[str, list[int]] | None:
        """The RNG entries rank 0's states hold in the checkpoint and their shapes (every rank saves the same kinds),
        as rank 0 reads them from its metadata; None where the metadata cannot be read (its verification then fails
        and names it)."""
        shapes = None
        if ranks.rank == 0:
            try:
                prefix = f"{_RNG_KEY}.rank0."
                shapes = {key[len(prefix):]: list(meta.size) for key, meta in
                          read_metadata(path).state_dict_metadata.items()
                          if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
            except Exception:  # noqa: BLE001 - whatever makes it unreadable, verification reports it
                shapes = None
        agreed = ranks.all_gather(shapes)[0]
        assert agreed is None or isinstance(agreed, dict)
        return agreed

    # --- save ------------------------------------------------------------------------------------------------
    def save_if_due(self, step: int, state: dict[str, Any]) -> bool:
        """Saves at the steps ``every`` divides (not step 0, nor the step just loaded or saved); returns whether
        it saved."""
        if self.every is None or step <= 0 or step % self.every or step == self._last_step:
            return False
        self.save(step, state)
        return True

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Saves ``state`` as ``root/step-<step>`` now (after the save in flight, if any, is committed), then
        applies the retention once it is committed. A collective."""
        self._check(state)
        self.wait()
        ranks = Ranks(self.process_group)
        saved = self._state_dicts(state)
        saved[_STEP_KEY] = {"step": step}
        saved[_RNG_KEY] = {f"rank{ranks.rank}": _rng.capture()}
        target = self.path(step)
        if self.async_save:
            save_async: Any = save  # its async_save and AsyncSave handle: checked in __init__
            handle = save_async(saved, target, process_group=self.process_group, async_save=True)
            self._pending = (step, handle)
        else:
            save(saved, target, process_group=self.process_group)
            self._prune(step)
        self._last_step = step

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the async save in flight (raising its error), then applies the retention."""
        if self._pending is None:
            return
        step, handle = self._pending
        self._pending = None
        handle.result(timeout=timeout)
        self._prune(step)

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- retention -------------------------------------------------------------------------------------------
    def _prune(self, written: int) -> None:
        """Rank 0: removes the committed checkpoints older than ``written`` (committed) but the keep-1 newest."""
        if self.keep is None or Ranks(self.process_group).rank != 0:
            return
        older = sorted((int(m.group(1)), self.root / name) for name in os.listdir(self.root)
                       if (m := _STEP.match(name)) and int(m.group(1)) < written
                       and (self.root / name / MANIFEST_NAME).is_file())
        doomed = older[:max(0, len(older) - (self.keep - 1))]
        for _, path in doomed:
            aside = path.parent / f".{path.name}{_PRUNING}"
            try:
                os.rename(path, aside)
            except OSError as error:
                warnings.warn(f"shardkit Checkpointer: could not remove {path} (keep={self.keep}): {error}",
                              stacklevel=3)
                continue
            _commit.remove_tree(aside)
        if doomed:
            _commit.fsync_directory(self.root)

    # --- the state -------------------------------------------------------------------------------------------
    def _check(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key.startswith(_STEP_KEY):
                raise ValueError(f"shardkit Checkpointer: state key {key!r}: keys starting with {_STEP_KEY!r} are "
                                 "the checkpointer's own")
            if not isinstance(value, (nn.Module, torch.optim.Optimizer, dict)) and not (
                    hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
                raise TypeError(f"shardkit Checkpointer: state[{key!r}] is a {type(value).__name__}: give a module, "
                                "an optimizer, an object with state_dict/load_state_dict, or a dict")

    def _state_dicts(self, state: dict[str, Any]) -> dict[str, Any]:
        functions = state_dict_functions()
        out: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, nn.Module):
                out[key] = functions.get_model(value)
            elif isinstance(value, torch.optim.Optimizer):
                out[key] = functions.get_optimizer(self._module_of(state, key, value), value)
            elif isinstance(value, dict):
                out[key] = value
            else:
                out[key] = value.state_dict()
        return out

    @staticmethod
    def _module_of(state: dict[str, Any], key: str, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The module of ``state`` holding ``optimizer``'s parameters."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for value in state.values():
            if isinstance(value, nn.Module) and any(id(p) in params for p in value.parameters()):
                return value
        raise ValueError(f"shardkit Checkpointer: state[{key!r}] is an optimizer over parameters of no module in "
                         "the state: add its model to the state")

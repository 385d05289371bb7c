"""``save``: a DCP checkpoint with a commit point — it appears whole, checksummed, or not at all.

The commit protocol (every rank runs ``save``; "agree" is one object all-gather, the same on every rank):

  1. prepare   rank 0 brings back a checkpoint an interrupted publish left aside (_commit.recover_and_clean),
               removes other leftovers of earlier saves into this target, checks that the target may be
               replaced, draws the save id and creates the empty staging directory .TARGET.shardkit-staging-<id>
               beside the target. Agree: every rank learns the id (or rank 0's failure; then all raise).
  2. write     every rank runs torch.distributed.checkpoint.save into the staging directory with a
               ChecksummingWriter: its data files, each checksummed while written and fsync'ed; rank 0 also
               writes .metadata (after DCP's own gather of every rank's write results). Each rank fsyncs the
               staging directory's entries.
  3. agree     every rank reports whether its part succeeded, with its files' sizes and CRC32Cs. A rank that
               failed, or a collective that failed (a dead peer), ends the save here: no rank commits.
  4. commit    rank 0 alone: writes the manifest (every file's size and CRC32C, .metadata's included, the save
               id, the world size), fsyncs it and the directory, then publishes: one atomic rename (an exchange
               where a checkpoint is being replaced), fsyncs the parent, and removes the replaced checkpoint.
  5. agree     every rank learns rank 0's outcome: all return, or all raise the same error.

What a crash (a rank killed, a full disk, a power cut) leaves at each point:
  - before the publish rename (steps 1-4): the target untouched, the previous checkpoint intact; the staging
    directory is removed by rank 0 (which deletes it whenever it does not commit) or by a rank that knows no
    commit can happen (it reported a failure), else by the next save's step 1;
  - after it: the new checkpoint, whole and durable (everything in it was fsync'ed before the rename); the
    replaced one, under the staging (or .old) name, is removed by rank 0 or the next save.
Why a load can never see a mix of two saves: files are only ever written into a fresh staging directory that
nothing reads; it becomes the checkpoint by one rename, after step 3 established that every rank's files are
complete and durable; and the manifest ties each file's exact bytes to the save. Were a file changed
afterwards anyway (a plain dcp.save into the directory, a copy from elsewhere, a disk's bit flips), load's
verification refuses it, naming the file.

A non-zero rank removes the staging directory only when it reported a failure in step 3 (then rank 0 cannot
have seen every rank succeed, so cannot be publishing it): deleting a directory that rank 0 is renaming could
otherwise publish a partial checkpoint. Every wait is a collective, bounded by the process group's timeout.

Step 1 gathers every rank's report, not only rank 0's: a rank that could not stage its state for an asynchronous
save reports that there, and every rank stops before anything is written.

Asynchronous saves (``async_save=True``, _async.py) run this same protocol (``run_protocol``) on a staged copy of
the state, on the process's one writer thread, and their agreements — these all-gathers and DCP's own gather and
scatter of plans — run on a gloo group of the writer's own, created once per training group in the foreground at
the first asynchronous save (``dist.new_group(ranks, backend="gloo", timeout=<the training group's>)``, which every
member calls at that same point). Chosen over the training group, where the writer's collectives would interleave
with training's in a different order on each rank (collectives match by issue order), and over agreeing through
the Store, because DCP's save itself needs a process group for its plans, and a Store-based agreement would be a
second protocol with deadlines and clean-up of its own. A synchronous save first waits for the writer to be idle.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import _async, _commit
from ._errors import CheckpointSaveError
from ._manifest import FileRecord, Manifest, write_manifest
from ._ranks import Ranks
from ._writer import ChecksummingWriter, WriteLedger

_ANOTHER_RANK_FAILED = "stopped: another rank failed"


@dataclasses.dataclass(frozen=True)
class _Failure:
    rank: int
    step: str  # what the rank was doing
    cause: str  # what went wrong, naming the file where one is known
    no_space: bool = False

    def __str__(self) -> str:
        return f"rank {self.rank}, {self.step}: {self.cause}"


@dataclasses.dataclass(frozen=True)
class _Report:
    """One rank's contribution to an agreement: its failure, or what it has to hand on."""
    failure: _Failure | None = None
    save_id: str | None = None  # step 1, from rank 0
    files: dict[str, FileRecord] = dataclasses.field(default_factory=dict)  # step 3


def _failure(rank: int, step: str, error: BaseException, ledger: WriteLedger | None = None) -> _Failure:
    """The cause to report: the first OSError a write met (the ledger keeps it where DCP's messages lose it),
    else this rank's own exception inside DCP's CheckpointException, else the exception."""
    written = ledger.first_failure if ledger is not None else None
    if written is not None:
        error_number = written.error.errno
        cause = f"writing {written.path}: [Errno {error_number}] {os.strerror(error_number or 0)}"
        return _Failure(rank, step, cause, error_number == errno.ENOSPC)
    if isinstance(error, CheckpointException):
        own = error.failures.get(rank)
        if own is None:  # another rank failed; it reports its own cause
            return _Failure(rank, step, _ANOTHER_RANK_FAILED)
        error = own[0] if isinstance(own, tuple) else own
    no_space = isinstance(error, OSError) and error.errno == errno.ENOSPC
    return _Failure(rank, step, f"{type(error).__name__}: {error}", no_space)


def _save_error(ranks: Ranks, target: Path, failures: list[_Failure], detail: str = "") -> CheckpointSaveError:
    own = [f for f in failures if f.cause != _ANOTHER_RANK_FAILED] or failures
    disk = " (No space left on device)" if any(f.no_space for f in failures) else ""
    causes = [str(f) for f in own] + ([detail] if detail else [])
    return CheckpointSaveError(
        f"shardkit checkpoint save (rank {ranks.rank}): saving {target} failed{disk} and nothing was committed: "
        f"the previous checkpoint there, if any, is intact. " + "; ".join(causes))


def save(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike, *, process_group: Any = None,
         async_save: bool = False) -> _async.AsyncSave | None:
    """Saves ``state_dict`` as the DCP checkpoint directory ``checkpoint_id``, replacing any checkpoint there only
    once the new one is complete on every rank, durable and checksummed (see the module docstring). A
    collective: call it on every rank of ``process_group`` (default: the default group), like ``dcp.save``.
    Raises CheckpointSaveError, on every rank, when nothing was committed.

    ``async_save=True``: returns, once ``state_dict`` is copied into the staging area, an ``AsyncSave`` handle
    (``done()``, ``result(timeout)``, ``status``); the save itself runs on this process's checkpoint writer thread
    (checkpoint/_async.py), whose ``result()`` raises the CheckpointSaveError this call would have raised. A
    synchronous save first waits for this process's asynchronous saves still in flight."""
    if async_save:
        return _async.save_async(state_dict, Path(os.path.abspath(checkpoint_id)), process_group, run_protocol)
    _async.wait_for_writer(Ranks(process_group))
    run_protocol(state_dict, Path(os.path.abspath(checkpoint_id)), Ranks(process_group))
    return None


def _no_phase(phase: str) -> None:
    pass


def run_protocol(state_dict: dict[str, Any], target: Path, ranks: Ranks, *, staging_failure: str | None = None,
                 phase: Callable[[str], None] = _no_phase) -> None:
    """The commit protocol (module docstring) on ``ranks`` (whose group DCP's own gathers run on too).
    ``staging_failure``: this rank could not stage its state for an asynchronous save (the cause); it takes part
    in step 1's agreement, which then stops every rank. ``phase`` hears each step's name as it begins
    ("preparing", "writing", "agreeing", "committing"): an asynchronous save's status."""
    # 1. prepare
    phase("preparing")
    prepared = _Report()
    if staging_failure is not None:
        prepared = _Report(failure=_Failure(ranks.rank, "staging its state", staging_failure))
    elif ranks.rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _commit.recover_and_clean(target)
            _commit.check_replaceable(target)
            save_id = uuid.uuid4().hex
            _commit.staging_path(target, save_id).mkdir()
            _commit.fsync_directory(target.parent)
            prepared = _Report(save_id=save_id)
        except Exception as error:  # noqa: BLE001 - whatever it is, every rank must hear of it
            prepared = _Report(failure=_failure(0, "preparing the staging directory", error))
    try:
        begun = ranks.all_gather(prepared)
    except Exception as error:  # noqa: BLE001 - a peer died or the group broke before the save began
        if prepared.save_id is not None:
            _commit.remove_tree(_commit.staging_path(target, prepared.save_id))
        known = [prepared.failure] if prepared.failure else []
        raise _save_error(ranks, target, known, f"the ranks could not agree to begin: {error}") from error
    refused = [r.failure for r in begun if r.failure is not None]
    if refused:
        if prepared.save_id is not None:
            _commit.remove_tree(_commit.staging_path(target, prepared.save_id))
        raise _save_error(ranks, target, refused)
    save_id = begun[0].save_id
    staging = _commit.staging_path(target, save_id)

    # 2. write
    phase("writing")
    writer: ChecksummingWriter | None = None
    try:
        writer = ChecksummingWriter(staging, target, save_id, ranks.rank)
        with ranks.quiet_single_process():
            dcp.save(state_dict, storage_writer=writer, process_group=ranks.group, no_dist=not ranks.distributed)
        _commit.fsync_directory(staging)
        written = _Report(files=writer.ledger.files)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - CheckpointException is a BaseException
        ledger = writer.ledger if writer is not None else None
        written = _Report(failure=_failure(ranks.rank, "writing its files", error, ledger))

    # 3. agree
    phase("agreeing")
    try:
        reports = ranks.all_gather(written)
    except Exception as error:  # noqa: BLE001 - a peer died or the group broke: nobody can commit
        if written.failure is not None or ranks.rank == 0:
            _commit.remove_tree(staging)
        known = [written.failure] if written.failure else []
        raise _save_error(ranks, target, known, f"the ranks could not agree: {error}") from error
    failures = [r.failure for r in reports if r.failure is not None]
    if failures:
        if ranks.rank == 0:
            _commit.remove_tree(staging)
        raise _save_error(ranks, target, failures)

    # 4. commit
    phase("committing")
    committed = _Report()
    if ranks.rank == 0:
        committed = _commit_on_rank0(staging, target, save_id, ranks.world, reports)

    # 5. agree
    try:
        outcome = ranks.all_gather(committed)[0]
    except Exception as error:  # noqa: BLE001
        if ranks.rank == 0 and committed.failure is None:
            warnings.warn(f"shardkit checkpoint save: {target} was committed, but the other ranks could not be told "
                          f"({error})", stacklevel=2)
            return
        raise CheckpointSaveError(
            f"shardkit checkpoint save (rank {ranks.rank}): could not learn whether rank 0 committed {target} "
            f"({error}); it holds either the previous checkpoint or this save's, whole "
            f"(shardkit.checkpoint.verify tells)") from error
    if outcome.failure is not None:
        raise _save_error(ranks, target, [outcome.failure])


def _commit_on_rank0(staging: Path, target: Path, save_id: str, world: int, reports: list[_Report]) -> _Report:
    """Step 4: manifest, then the atomic publish, then the replaced checkpoint's removal."""
    files = {name: record for report in reports for name, record in report.files.items()}
    try:
        write_manifest(staging, Manifest(save_id=save_id, world_size=world, files=files))
        _commit.fsync_directory(staging)
        replaced = _commit.publish(staging, target, save_id)
    except Exception as error:  # noqa: BLE001 - whatever it is, every rank must hear of it
        _commit.remove_tree(staging)
        return _Report(failure=_failure(0, "committing", error))
    # Committed: from here on nothing may be reported as "not committed".
    try:
        _commit.fsync_directory(target.parent)
    except OSError as error:
        warnings.warn(f"shardkit checkpoint save: {target} was committed, but syncing {target.parent} failed "
                      f"({error}): a power cut now could bring back the previous checkpoint", stacklevel=3)
    if replaced is not None:
        _commit.remove_tree(replaced)
    return _Report()

"""``load``: ``torch.distributed.checkpoint.load`` after verifying the checkpoint's files (``verify``, see
_verify.py) and checking that it holds exactly the tensors of the state dict (``strict``).

DCP alone reads what the state dict asks for and ignores the rest (a checkpoint of a bigger model loads
silently) and names shardkit's flattened sizes only; ``check_matches`` raises first, naming the parameters and
their own shapes in the checkpoint and in the model (or, where those agree, the two layouts). Each rank reads the
same metadata file; one exchange of the state dicts' keys lets a rank tell the entries of another rank's pieces
(a ZeRO optimizer state dict names only the parameters the rank holds pieces of) from a model's that is not this
one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import _torch_compat
from ._ranks import Ranks
from ._reader import read_metadata, saved_paths, saved_shapes
from ._safe_pickle import SafeFileSystemReader, SafeLoadPlanner, refusal
from ._sharded_state import SHAPES_KEY
from ._verify import check_for_load


def load(state_dict: dict[str, Any], checkpoint_id: str | Path, *, strict: bool = True, verify: bool = True,
         process_group: Any = None) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=...)`` into ``state_dict``, after

    - ``verify``: every file's size and CRC32C against the manifest shardkit's ``save`` wrote (the reading
      spread over the ranks, each byte read once per job), or for a plain ``dcp.save`` checkpoint, with an
      UnverifiedCheckpointWarning, its files' sizes against its metadata; ``verify=False`` checks sizes only.
      A torn, mixed, truncated or damaged checkpoint raises CheckpointIntegrityError on every rank, naming
      each bad file and what differs, and nothing is loaded;
    - ``strict``: that the checkpoint matches ``state_dict`` (see the module docstring).

    Nothing is read with plain pickle (_safe_pickle.py): a ``.metadata`` naming any global but DCP's metadata
    classes, or a non-tensor value ``torch.load(weights_only=True)`` refuses, raises UnsafeCheckpointError (a
    CheckpointIntegrityError) naming the file or the key, on every rank, and nothing of it runs.

    A collective: call it on every rank of ``process_group`` (default: the default group)."""
    directory = Path(checkpoint_id)
    ranks = Ranks(process_group)
    check_for_load(directory, ranks, checksums=verify)
    if strict:
        # A sharded optimizer's state dict names only the parameters this rank holds pieces of (ZeRO-1/2): the
        # checkpoint's other entries are another rank's, not strangers. One exchange of the names finds out; a
        # second of the verdicts makes every rank raise where any rank's state dict does not match (the others
        # would otherwise wait in dcp.load for it).
        flat, _ = _torch_compat.flatten_state_dict(state_dict)
        held = set().union(*ranks.all_gather(sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))))
        problems = _problems(state_dict, directory, held)
        everyone = ranks.all_gather(problems)
        if any(everyone):
            first = next(r for r, theirs in enumerate(everyone) if theirs)
            told = problems or [f"rank {first}'s state dict does not: " + "; ".join(everyone[first])]
            raise RuntimeError(_message(directory, told))
    with ranks.quiet_single_process():
        reader = SafeFileSystemReader(str(directory))
        try:
            dcp.load(state_dict, checkpoint_id=str(directory), storage_reader=reader,
                     planner=SafeLoadPlanner(directory), process_group=process_group)
        except CheckpointException as error:  # every rank reads .metadata and holds every rank's failures
            refused = refusal(error, reader)
            if refused is None:
                raise
            raise refused from error


def check_matches(state_dict: dict[str, Any], directory: Path, held_by_some_rank: set[str] | None = None) -> None:
    """Raises RuntimeError naming the missing, unexpected and mismatched tensors of ``state_dict`` against the
    checkpoint in ``directory`` (only checkpoint entries under ``state_dict``'s top-level keys count; an entry
    in ``held_by_some_rank``, the keys every rank's state dict holds, is not unexpected). No communication."""
    problems = _problems(state_dict, directory, held_by_some_rank or set())
    if problems:
        raise RuntimeError(_message(directory, problems))


def _message(directory: Path, problems: list[str]) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"shardkit checkpoint load (rank {rank}): {directory} does not match the state dict: " + "; ".join(problems)


def _problems(state_dict: dict[str, Any], directory: Path, held_by_some_rank: set[str]) -> list[str]:
    metadata = read_metadata(directory)
    flat, paths = _torch_compat.flatten_state_dict(state_dict)
    tops = {path[0] for path in paths.values()}
    their_paths = saved_paths(metadata)
    saved = {key: meta for key, meta in metadata.state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata) and their_paths[key][0] in tops}
    ours = {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}
    missing = [key for key in ours if key not in saved]
    unexpected = [key for key in saved if key not in ours and key not in held_by_some_rank]
    mismatched = [key for key in ours if key in saved and torch.Size(saved[key].size) != ours[key].size()]
    if not (missing or unexpected or mismatched):
        return []
    their_shapes = saved_shapes(directory, metadata, their_paths)
    our_shapes = {}
    for key, value in flat.items():
        if str(paths[key][-1]).endswith(SHAPES_KEY):
            our_shapes.update(json.loads(value))
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"not in the model: {unexpected}")
    for key in mismatched:
        name = next((str(part) for part in reversed(paths[key])
                     if str(part) in our_shapes or str(part) in their_shapes), None)
        theirs = their_shapes.get(name, list(saved[key].size)) if name else list(saved[key].size)
        mine = our_shapes.get(name, list(ours[key].size())) if name else list(ours[key].size())
        if list(theirs) != list(mine):
            problems.append(f"{key} has shape {list(theirs)} in the checkpoint but {list(mine)} in the model")
        else:  # the same parameter, laid out differently: flat (FSDP1 front, ZeRO) against its own shape
            problems.append(
                f"{key} is {list(mine)} in both, but the checkpoint holds it as {list(saved[key].size)} and the "
                f"state dict as {list(ours[key].size())}: the layouts differ (checkpoints of shardkit before 0.2 "
                "hold parameters flattened; `python -m shardkit checkpoint consolidate` reads them whole)")
    return problems

"""torch.distributed.checkpoint (DCP) directories: a strict ``load`` for training ranks, and
``python -m shardkit checkpoint info|consolidate``, which read one in a plain process (no process group, no GPU).

- ``load(state_dict, checkpoint_id, strict=True)``: ``torch.distributed.checkpoint.load`` after checking that
  the checkpoint holds exactly the tensors of ``state_dict`` (under its top-level keys) with their shapes.
  DCP alone reads what the state dict asks for and ignores the rest (a checkpoint of a bigger model loads
  silently) and names shardkit's flattened sizes only; this raises first, on every rank alike (each reads the
  same metadata file, no communication), naming the parameters and their own shapes in the checkpoint and in
  the model.

- ``info DIR``: what the checkpoint holds: its tensors (count, elements, bytes), the world size that saved it
  (the number of ranks' data files), and its entries by top-level key.
- ``consolidate DIR OUT.pt [--no-optim]``: one plain state dict, written with ``torch.save``, that
  ``torch.load(OUT, weights_only=True)`` reads without shardkit. Tensors are read one at a time (never the
  whole checkpoint in memory besides the output) and take their parameters' own shapes again where the
  checkpoint recorded them (shardkit's sharded state dicts flatten parameters; see fsdp_state_dict). The
  nesting of what was saved is kept: ``{"model": {...}, "optim": {"state": ..., "param_groups": [...]}}``
  for ``dcp.save({"model": ..., "optim": ...})``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .fsdp_state_dict import SHAPES_KEY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    info = actions.add_parser("info", help="what a DCP checkpoint directory holds")
    info.add_argument("directory", type=Path)
    info.set_defaults(run=_info_main)
    cons = actions.add_parser("consolidate", help="a DCP checkpoint directory -> one torch.save file")
    cons.add_argument("directory", type=Path)
    cons.add_argument("output", type=Path)
    cons.add_argument("--no-optim", action="store_true", help="leave the optimizer state (key 'optim') out")
    cons.set_defaults(run=_consolidate_main)


def load(state_dict: dict[str, Any], checkpoint_id: str | Path, *, strict: bool = True,
         process_group: Any = None) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=...)``, first checking (``strict``) that the
    checkpoint matches ``state_dict``; see the module docstring. Call on every rank."""
    if strict:
        check_matches(state_dict, Path(checkpoint_id))
    dcp.load(state_dict, checkpoint_id=str(checkpoint_id), process_group=process_group)


def check_matches(state_dict: dict[str, Any], directory: Path) -> None:
    """Raises RuntimeError naming the missing, unexpected and mismatched tensors of ``state_dict`` against the
    checkpoint in ``directory`` (only checkpoint entries under ``state_dict``'s top-level keys count)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    metadata = read_metadata(directory)
    flat, paths = flatten_state_dict(state_dict)
    tops = {path[0] for path in paths.values()}
    saved_paths = _paths(metadata)
    saved = {key: meta for key, meta in metadata.state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata) and saved_paths[key][0] in tops}
    ours = {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}
    missing = [key for key in ours if key not in saved]
    unexpected = [key for key in saved if key not in ours]
    mismatched = [key for key in ours if key in saved and torch.Size(saved[key].size) != ours[key].size()]
    if not (missing or unexpected or mismatched):
        return
    their_shapes = _shapes(directory, metadata, saved_paths)
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
        name = next((str(part) for part in reversed(paths[key]) if str(part) in our_shapes), None)
        theirs = their_shapes.get(name, list(saved[key].size)) if name else list(saved[key].size)
        mine = our_shapes.get(name, list(ours[key].size())) if name else list(ours[key].size())
        problems.append(f"{key} has shape {list(theirs)} in the checkpoint but {list(mine)} in the model")
    raise RuntimeError(f"shardkit checkpoint load (rank {rank}): {directory} does not match the state dict: "
                       + "; ".join(problems))


def read_metadata(directory: Path) -> Metadata:
    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"{directory} is not a torch.distributed.checkpoint directory (no .metadata file)")
    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise RuntimeError(f"{Path(directory) / '.metadata'}: unreadable checkpoint metadata ({error})") from error


def _paths(metadata: Metadata) -> dict[str, tuple]:
    """Each flattened key's path in the saved (nested) state dict; a key that was not nested is its own path."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: tuple(mapping.get(key, (key,))) for key in metadata.state_dict_metadata}


def _load_one(directory: Path, key: str, value: Any) -> Any:
    holder = {key: value}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(holder, checkpoint_id=str(directory), no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - CheckpointException is a BaseException
        files = sorted({info.relative_path for index, info in _storage(directory).items() if index.fqn == key})
        raise RuntimeError(f"checkpoint {directory}: reading {key!r} from {files} failed: {error}") from error
    return holder[key]


def _storage(directory: Path) -> dict:
    return read_metadata(directory).storage_data


def _shapes(directory: Path, metadata: Metadata, paths: dict[str, tuple]) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for key, path in paths.items():
        if str(path[-1]).endswith(SHAPES_KEY):
            shapes.update(json.loads(_load_one(directory, key, "")))
    return shapes


def _place(root: dict, path: tuple, value: Any) -> None:
    node: Any = root
    for part, following in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= part:
                node.append({} if not isinstance(following, int) else [])
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(following, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def consolidate(directory: Path, output: Path, optim: bool = True) -> dict[str, int]:
    metadata = read_metadata(directory)
    paths = _paths(metadata)
    shapes = _shapes(directory, metadata, paths)
    result: dict[str, Any] = {}
    counts = {"tensors": 0, "objects": 0}
    for key, meta in metadata.state_dict_metadata.items():
        path = paths[key]
        if str(path[-1]).endswith(SHAPES_KEY) or (not optim and path[0] == "optim"):
            continue
        if isinstance(meta, TensorStorageMetadata):
            tensor = _load_one(directory, key, torch.empty(meta.size, dtype=meta.properties.dtype))
            for name in (path[-1], path[-2] if len(path) > 1 else None):  # a parameter, or its optimizer state
                if isinstance(name, str) and name in shapes and math.prod(shapes[name]) == tensor.numel():
                    tensor = tensor.view(shapes[name])
                    break
            _place(result, path, tensor)
            counts["tensors"] += 1
        else:
            _place(result, path, _load_one(directory, key, None))
            counts["objects"] += 1
    _tuples_back(result)
    torch.save(result, output)
    return counts


def _tuples_back(node: Any) -> None:
    """Optimizer options saved as tuples (Adam's betas) come back from DCP's flattening as lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "betas" and isinstance(value, list):
                node[key] = tuple(value)
            else:
                _tuples_back(value)
    elif isinstance(node, list):
        for value in node:
            _tuples_back(value)


def info(directory: Path) -> dict[str, Any]:
    metadata = read_metadata(directory)
    paths = _paths(metadata)
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    files = {info.relative_path for info in metadata.storage_data.values()}
    ranks = {int(m.group(1)) for f in files if (m := re.match(r"__(\d+)_", f))}
    by_top: dict[str, int] = {}
    for key in tensors:
        by_top[str(paths[key][0])] = by_top.get(str(paths[key][0]), 0) + 1
    elements = sum(math.prod(m.size) for m in tensors.values())
    nbytes = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors.values())
    return {"tensors": len(tensors), "elements": elements, "bytes": nbytes, "saved_by_ranks": len(ranks),
            "files": len(files), "by_top_level_key": by_top,
            "file_bytes": sum((Path(directory) / f).stat().st_size for f in files if (Path(directory) / f).exists())}


def _fail(error: BaseException) -> int:
    print(f"shardkit checkpoint: error: {error}", file=sys.stderr)
    return 1


def _info_main(args: argparse.Namespace) -> int:
    try:
        facts = info(args.directory)
    except (OSError, RuntimeError) as error:
        return _fail(error)
    print(f"checkpoint {args.directory}: saved by {facts['saved_by_ranks']} ranks ({facts['files']} data files, "
          f"{facts['file_bytes']} bytes on disk)")
    print(f"tensors: {facts['tensors']} holding {facts['elements']} elements ({facts['bytes']} bytes)")
    for top, count in facts["by_top_level_key"].items():
        print(f"  {top}: {count} tensors")
    return 0


def _consolidate_main(args: argparse.Namespace) -> int:
    try:
        counts = consolidate(args.directory, args.output, optim=not args.no_optim)
    except (OSError, RuntimeError) as error:
        return _fail(error)
    print(f"wrote {args.output}: {counts['tensors']} tensors, {counts['objects']} other entries")
    return 0

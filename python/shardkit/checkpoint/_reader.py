"""Reading a torch.distributed.checkpoint (DCP) directory in a plain process (no process group, no GPU): its
metadata, ``info`` (what it holds) and ``consolidate`` (one plain ``torch.save`` file).

- ``info(DIR)``: its tensors (count, elements, bytes), the world size that saved it (the number of ranks' data
  files), its entries by top-level key, and its shardkit manifest's save id (None for a plain DCP checkpoint).
- ``consolidate(DIR, OUT.pt, optim=True)``: one plain state dict, written with ``torch.save``, that
  ``torch.load(OUT, weights_only=True)`` reads without shardkit. Tensors are read one at a time (never the
  whole checkpoint in memory besides the output) and take their parameters' own shapes again where the
  checkpoint recorded them (shardkit's sharded state dicts flattened parameters before PieceTensor; see
  SHAPES_KEY in _sharded_state.py). The
  nesting of what was saved is kept: ``{"model": {...}, "optim": {"state": ..., "param_groups": [...]}}``
  for a save of ``{"model": ..., "optim": ...}``.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._errors import UnsafeCheckpointError
from ._manifest import read_manifest
from ._safe_pickle import SafeFileSystemReader, SafeLoadPlanner, refusal
from ._sharded_state import SHAPES_KEY


def read_metadata(directory: Path) -> Metadata:
    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"{directory} is not a torch.distributed.checkpoint directory (no .metadata file)")
    try:
        return SafeFileSystemReader(str(directory)).read_metadata()
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise RuntimeError(f"{Path(directory) / '.metadata'}: unreadable checkpoint metadata ({error})") from error


def saved_paths(metadata: Metadata) -> dict[str, tuple]:
    """Each flattened key's path in the saved (nested) state dict; a key that was not nested is its own path."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: tuple(mapping.get(key, (key,))) for key in metadata.state_dict_metadata}


def _load_one(directory: Path, key: str, value: Any) -> Any:
    holder = {key: value}
    reader = SafeFileSystemReader(str(directory))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(holder, checkpoint_id=str(directory), storage_reader=reader, planner=SafeLoadPlanner(directory),
                     no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - CheckpointException is a BaseException
        refused = refusal(error, reader)
        if refused is not None:
            raise refused from error
        files = sorted({info.relative_path for index, info in _storage(directory).items() if index.fqn == key})
        raise RuntimeError(f"checkpoint {directory}: reading {key!r} from {files} failed: {error}") from error
    return holder[key]


def _storage(directory: Path) -> dict:
    return read_metadata(directory).storage_data


def saved_shapes(directory: Path, metadata: Metadata, paths: dict[str, tuple]) -> dict[str, list[int]]:
    """The parameters' own shapes, as shardkit's sharded state dicts recorded them beside flattened values until
    they were saved in their own shapes (older checkpoints; none in newer ones)."""
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
    paths = saved_paths(metadata)
    shapes = saved_shapes(directory, metadata, paths)
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
    paths = saved_paths(metadata)
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    files = {info.relative_path for info in metadata.storage_data.values()}
    ranks = {int(m.group(1)) for f in files if (m := re.match(r"__(\d+)_", f))}
    by_top: dict[str, int] = {}
    for key in tensors:
        by_top[str(paths[key][0])] = by_top.get(str(paths[key][0]), 0) + 1
    elements = sum(math.prod(m.size) for m in tensors.values())
    nbytes = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors.values())
    manifest = read_manifest(Path(directory))
    return {"tensors": len(tensors), "elements": elements, "bytes": nbytes, "saved_by_ranks": len(ranks),
            "files": len(files), "by_top_level_key": by_top, "save_id": manifest.save_id if manifest else None,
            "file_bytes": sum((Path(directory) / f).stat().st_size for f in files if (Path(directory) / f).exists())}

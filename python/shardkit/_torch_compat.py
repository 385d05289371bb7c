"""The private torch interfaces shardkit relies on (checkpoints, FSDP2), in one place (the twin of csrc/compat.h).

Each function says what it uses (shardkit supports torch >= 2.11). The checkpoint interfaces were read in torch
2.13 (installed here) and 2.14.1 (its wheel), and in an older revision of torch's main branch (2.5-era), which
uses them the same way; 2.11 lies between and was not read itself. A torch release that changes one of these
fails here, with a message naming the interface, rather than somewhere inside a save.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """DCP's own flattening of a nested state dict: ``(flat, paths)``, keys as DCP's metadata spells them
    (``torch.distributed.checkpoint._nested_dict``, present in 2.13 and 2.14)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def use_filesystem(writer: FileSystemWriter, filesystem: FileSystem) -> None:
    """Makes ``writer`` open, rename and remove every file it writes through ``filesystem``.

    FileSystemWriter keeps its FileSystem in the attribute ``fs`` and goes through it for every file of a save:
    ``write_data`` hands ``self.fs.create_stream`` to ``_write_files_from_queue`` (the data files, one stream
    per file, written front to back: ``tell()`` gives each item's offset, then ``write`` calls, then an
    optional ``fsync(stream.fileno())`` and ``close()``), and ``finish`` writes ``.metadata.tmp`` through
    ``self.fs.create_stream`` and renames it with ``self.fs.rename`` (2.13 and 2.14 alike, and the 2.5-era code;
    2.14 adds a ``flush()`` before the fsync, which 2.13 lacks).
    """
    if not isinstance(getattr(writer, "fs", None), FileSystem):
        raise RuntimeError(f"shardkit checkpoint: this torch's FileSystemWriter ({type(writer).__module__}) has no "
                           "FileSystem in its attribute 'fs': shardkit cannot checksum the files it writes "
                           "(python/shardkit/_torch_compat.py needs updating for this torch)")
    writer.fs = filesystem


# --- FSDP2 (torch.distributed.fsdp.fully_shard): what shardkit.fully_shard plugs into. Read in torch 2.13 and
# 2.14.1 (FSDPModule.set_custom_all_gather / set_custom_reduce_scatter and the AllGather / ReduceScatter
# interfaces exist in both, as in 2.11's documentation); the private attributes below are those of both.
def fsdp2_fully_shard():
    """torch's ``fully_shard`` (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def fsdp2_comm_interfaces() -> tuple[type, type]:
    """FSDP2's custom-collective interfaces ``(AllGather, ReduceScatter)``: an ``allocate(size, *, dtype, device)``
    for the buffers FSDP2 hands the collective, and a ``__call__`` that issues it."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as error:
        raise RuntimeError("shardkit.fully_shard: this torch has no FSDP2 custom-collective interface "
                           "(torch.distributed.fsdp._fully_shard._fsdp_api.AllGather / ReduceScatter); shardkit "
                           "supports torch 2.11, 2.13 and 2.14") from error
    return AllGather, ReduceScatter


def fsdp2_param_groups(fsdp_module: Any) -> list[Any]:
    """The FSDPParamGroups of one ``fully_shard`` call (FSDPState._fsdp_param_groups: a list in 2.13 and 2.14;
    an older torch's single ``_fsdp_param_group``, None where the module manages no parameters)."""
    state = fsdp_module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups or [])
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def fsdp2_shard_group(param_group: Any) -> Any:
    """The process group a parameter group shards over (``FSDPParamGroup.mesh_info.shard_process_group``)."""
    return param_group.mesh_info.shard_process_group


def fsdp2_params(param_group: Any) -> list[Any]:
    """The parameters (DTensors) a parameter group manages (``FSDPParamGroup.fsdp_params[i].sharded_param``)."""
    return [fsdp_param.sharded_param for fsdp_param in param_group.fsdp_params]


def fsdp2_module_path(param_group: Any) -> str:
    """The group's module path in the root, as FSDP2 learns it at the root's lazy init (``_module_fqn``); "" for the
    root, or before the root's first forward."""
    return getattr(param_group, "_module_fqn", "") or ""


def all_gather_single(output: Any, input: Any, group: Any, async_op: bool) -> Any:
    """``dist.all_gather_single`` (torch >= 2.13, where ``all_gather_into_tensor`` warns it is deprecated), else
    ``all_gather_into_tensor``: the same collective."""
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: Any, input: Any, op: Any, group: Any, async_op: bool) -> Any:
    """``dist.reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor``: the same collective."""
    import torch.distributed as dist

    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output=output, input=input, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


# --- DCP's checkpointable protocol: what shardkit.checkpoint._sharded_state.PieceTensor answers DCP with. DCP asks a value for
# ``__create_write_items__(fqn, obj)`` (planner_helpers._create_write_items), ``__create_chunk_list__()``
# (_create_chunk_list, on load) and ``__get_tensor_shard__(index)`` (utils.find_tensor_shard) where it has them,
# as DTensor does (torch 2.13 and 2.14.1 alike); the items and chunks are DCP's public dataclasses.
def dcp_shard_write_item(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], global_shape: Any,
                         local: Any) -> Any:
    """DCP's WriteItem for one box (``offsets``, ``sizes``) of a tensor of ``global_shape`` whose data is ``local``'s
    dtype (as DCP's own ShardedTensor items: type SHARD, indexed by the box's offsets)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=dcp_chunk(offsets, sizes),
                                                 properties=TensorProperties.create_from_tensor(local),
                                                 size=torch.Size(global_shape)))


def dcp_chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    """DCP's ChunkStorageMetadata of one box."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


# --- autograd's end-of-backward callbacks (what FSDP1 and FSDP2 use too) ---------------------------------------
def current_graph_task() -> int | None:
    """The id of the backward pass this thread is running (``torch._C._current_graph_task_id``), None outside
    one."""
    import torch

    task = torch._C._current_graph_task_id()
    return None if task == -1 else task


def engine_will_run(node: Any) -> bool:
    """Whether the backward pass this thread is running will run autograd node ``node``
    (``torch._C._will_engine_execute_node``; call it during a backward pass only)."""
    import torch

    return bool(torch._C._will_engine_execute_node(node))


def queue_end_of_backward(callback: Any) -> None:
    """Runs ``callback`` once the current backward pass has finished (``Variable._execution_engine.queue_callback``;
    callbacks run in the order queued)."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)

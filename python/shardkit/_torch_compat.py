"""Every private torch interface shardkit relies on, and every difference between the torch versions it supports,
in one place (the twin of csrc/compat.h). tests/python/test_layers.py fails on a private torch name used anywhere
else in python/shardkit.

Each function says what it uses and why shardkit needs it (shardkit supports torch 2.11, 2.13 and 2.14). The
checkpoint interfaces were read in torch 2.13 (installed here) and 2.14.1 (its wheel), and in an older revision of
torch's main branch (2.5-era), which uses them the same way; 2.11 lies between and was not read itself. A torch
release that changes one of these fails here, with a message naming the interface, rather than somewhere inside a
save. What shardkit.fully_shard assumes about FSDP2's calls into its plug-ins is pinned by
tests/python/test_torch_compat.py.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    # What c10d hands a backend creator registered with extended_api=True (store, group_rank, group_size, timeout,
    # group_id, global_ranks_in_group): shardkit.backend's creator reads it. Named for annotations only.
    from torch.distributed.distributed_c10d import _DistributedBackendOptions as BackendOptions  # noqa: F401


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
    from torch.distributed.checkpoint.filesystem import FileSystem

    if not isinstance(getattr(writer, "fs", None), FileSystem):
        raise RuntimeError(f"shardkit checkpoint: this torch's FileSystemWriter ({type(writer).__module__}) has no "
                           "FileSystem in its attribute 'fs': shardkit cannot checksum the files it writes "
                           "(python/shardkit/_torch_compat.py needs updating for this torch)")
    writer.fs = filesystem


# What a DCP checkpoint's ``.metadata`` pickle names besides torch's dtypes (shardkit.checkpoint._safe_pickle
# allows these and refuses every other global): found by saving plain tensors, values, optimizer state,
# fully_shard DTensors and PieceTensors with dcp.save on torch 2.13 and listing the globals its unpickling asks
# for; torch 2.14.1's metadata.py is the same file and its _StorageInfo the same class. Enum members and
# torch.Size come back through REDUCE of the class named here; ``torch.strided`` through _get_layout; a
# checkpoint_id given as a Path is stored as one (StorageMeta.checkpoint_id).
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # FileSystemWriter's storage_data entries
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles (TensorProperties.layout)
    ("pathlib", "PosixPath"),
})


def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """The metadata file a FileSystemReader reads (``FileSystemReader._get_metadata_path``: ``.metadata``, or
    ``__<rank>.metadata`` where a rank is asked for, under the reader's ``path`` through its ``fs``)."""
    if hasattr(reader, "_get_metadata_path"):
        return reader._get_metadata_path(rank)
    return reader.fs.concat_path(reader.path, ".metadata" if rank is None else f"__{rank}.metadata")


def set_state_dict_element(root: dict[str, Any], path: tuple, value: Any) -> None:
    """Puts ``value`` at ``path`` in a nested state dict (``torch.distributed.checkpoint._traverse.set_element``,
    what DefaultLoadPlanner.load_bytes uses to place a flattened key's value; 2.13 and 2.14 alike)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


# --- FSDP2 (torch.distributed.fsdp.fully_shard): what shardkit.fully_shard plugs into. Read in torch 2.13 and
# 2.14.1 (FSDPModule.set_custom_all_gather / set_custom_reduce_scatter and the AllGather / ReduceScatter
# interfaces exist in both, as in 2.11's documentation); the private attributes below are those of both.
def fsdp2_fully_shard():
    """torch's ``fully_shard`` (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def fsdp2_comm_interfaces() -> tuple[Any, Any]:
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


def fsdp2_device(param_group: Any) -> torch.device:
    """The device of the parameters a parameter group manages (``FSDPParamGroup.device``): shardkit's plug-ins
    apply to host (CPU) parameters only."""
    return param_group.device


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


# --- DCP's checkpointable protocol: what shardkit.checkpoint._sharded_state.PieceTensor answers DCP with. DCP asks a
# value for
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


# --- process groups (torch.distributed.distributed_c10d): present in 2.11, 2.13 and 2.14 ---------------------------
def default_group() -> dist.ProcessGroup:
    """The default (world) process group (``distributed_c10d._get_default_group``): where a ``group=None`` must
    become a group object shardkit can ask for its size, ranks or backend. Raises if none is initialised."""
    return dist.distributed_c10d._get_default_group()


def backend_options(store: dist.Store, group_rank: int, group_size: int, timeout: timedelta, group_id: str,
                    global_ranks: list[int]) -> Any:
    """What c10d hands a backend creator registered with ``extended_api=True`` (``distributed_c10d.
    _DistributedBackendOptions``), made by hand: shardkit's torchft process group (integrations/torchft.py) builds a
    shardkit backend outside ``new_group``, through the same creator (``_startup.create_backend``)."""
    options = dist.distributed_c10d._DistributedBackendOptions()
    options.store = store
    options.group_rank = group_rank
    options.group_size = group_size
    options.timeout = timeout
    options.group_id = group_id
    options.global_ranks_in_group = list(global_ranks)
    return options


def process_group_over(backend: Any, store: dist.Store, rank: int, size: int, name: str,
                       devices: list[str]) -> dist.ProcessGroup:
    """A ``ProcessGroup`` whose collectives on ``devices``' tensors run on ``backend`` (a custom backend, as
    ``init_process_group`` assembles one: ``ProcessGroup._set_default_backend``, ``_register_backend``), named
    ``name`` (``_set_group_name``, which also names the backend's flight-recorder ring). Not in torch's registry of
    groups (``_world``): its owner, not ``destroy_process_group``, ends it."""
    group = dist.ProcessGroup(store, rank, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._set_default_backend(custom)
    for device in devices:
        group._register_backend(torch.device(device), custom, backend)
    group._set_group_name(cast(Any, name))  # a GroupName (a str) where torch's stub says so
    return group


def live_process_groups() -> list[dist.ProcessGroup]:
    """Every process group not destroyed yet (the keys of ``distributed_c10d._world.pg_map``): shardkit shuts down
    the backends nobody destroyed at the interpreter's exit."""
    return list(dist.distributed_c10d._world.pg_map)


def group_backend(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The backend that runs ``group``'s collectives on ``device``'s tensors (``ProcessGroup._get_backend``);
    raises RuntimeError where the group has none for that device."""
    return group._get_backend(device)


def object_collective_device(group: dist.ProcessGroup | None) -> Any:
    """torch's own rule for the device of an object collective (``distributed_c10d._get_object_coll_device``: CPU
    when the group has a CPU backend), so shardkit's object exchanges run where torch's ``all_gather_object`` would."""
    return dist.distributed_c10d._get_object_coll_device(group)


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The operation timeout ``group`` was created with: its CPU backend's options (gloo, NCCL: ``options._timeout``),
    else its store's timeout (``distributed_c10d._world.pg_map``: the init_process_group / new_group timeout, which
    the store is created with), else torch's default. torch keeps no public record of it (2.13, 2.14)."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        if isinstance(timeout, timedelta):
            return timeout
    except (AttributeError, RuntimeError):
        pass
    entry = dist.distributed_c10d._world.pg_map.get(group)
    store_timeout = getattr(entry[1], "timeout", None) if entry else None
    if isinstance(store_timeout, timedelta) and store_timeout.total_seconds() > 0:
        return store_timeout
    return dist.distributed_c10d.default_pg_timeout


BROADCAST_BUCKET_BYTES = 250 << 20  # torch DDP's broadcast_bucket_size


def broadcast_coalesced(group: dist.ProcessGroup, tensors: list[torch.Tensor], src: int,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Broadcasts ``tensors`` in place from rank ``src`` of ``group``, flattened into buckets of at most
    ``bucket_bytes`` (``dist._broadcast_coalesced``, c10d's C++ broadcastCoalesced, whose root is a group rank: torch
    DDP's initial and per-forward sync, and the bucket size torch DDP gives it)."""
    dist._broadcast_coalesced(group, tensors, bucket_bytes, src)


def gloo_timeout_settable() -> bool:
    """Whether a gloo backend's operation timeout can be set after it connected
    (``ProcessGroupGloo._set_default_timeout``): then shardkit connects with a short timeout and operates with the
    group's."""
    return hasattr(dist.ProcessGroupGloo, "_set_default_timeout")


def set_gloo_timeout(backend: Any, timeout: timedelta) -> None:
    """Sets a connected gloo backend's operation timeout (``ProcessGroupGloo._set_default_timeout``; only where
    ``gloo_timeout_settable()``)."""
    backend._set_default_timeout(timeout)


# --- nn.Module and Tensor internals ----------------------------------------------------------------------------
# What nn.Module.load_state_dict returns (a namedtuple of missing_keys, unexpected_keys; no public name): shardkit's
# load functions return the same.
IncompatibleKeys = nn.modules.module._IncompatibleKeys


def call_runs_forward_only(module: nn.Module) -> bool:
    """Whether ``nn.Module.__call__`` on ``module`` would do nothing but call its forward: it was not compiled in
    place (``nn.Module.compile`` sets ``_compiled_call_impl``) and no hook would run (its own ``_forward_hooks``,
    ``_forward_pre_hooks``, ``_backward_hooks``, ``_backward_pre_hooks`` and nn.Module's global ones, the dicts
    ``_call_impl`` checks). shardkit DDP then skips ``__call__``'s machinery, as ``_call_impl`` would."""
    hooks = nn.modules.module
    return not (module._compiled_call_impl is not None
                or module._backward_hooks or module._backward_pre_hooks or module._forward_hooks
                or module._forward_pre_hooks or hooks._global_backward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def registered_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots, name -> parameter or None, in registration order (``module._parameters``,
    the mapping itself): unlike ``named_parameters(recurse=False)`` it keeps None slots and is not what a subclass
    overrides."""
    return module._parameters


def set_registered_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Puts ``tensor`` (a plain tensor, e.g. a view of a gathered buffer) in ``module``'s parameter slot ``name``
    (``module._parameters[name] = tensor``, as FSDP2's ``unsafe_setattr_param`` does): ``nn.Module.__setattr__``
    accepts only a Parameter or None there, and the module's forward reads the slot."""
    slots: dict[str, Any] = module._parameters
    slots[name] = tensor


def make_tensor_subclass(cls: type, data: torch.Tensor, requires_grad: bool = False) -> Any:
    """An instance of the Tensor subclass ``cls`` sharing ``data``'s storage (``torch.Tensor._make_subclass``, the
    constructor nn.Parameter uses)."""
    return torch.Tensor._make_subclass(cls, data, requires_grad)


def torch_function_disabled() -> AbstractContextManager[Any]:
    """A context in which Tensor subclasses' ``__torch_function__`` is not consulted
    (``torch._C.DisableTorchFunctionSubclass``, what ``Tensor.__torch_function__`` itself uses): a subclass's
    ``__torch_function__`` runs the op on the plain tensors under it."""
    return torch._C.DisableTorchFunctionSubclass()


def profiler_enabled_check() -> Callable[[], bool]:
    """The C function telling whether an autograd profiler is recording (``torch._C._autograd._profiler_enabled``),
    returned itself: shardkit's profiler spans cost one C call when none is."""
    return torch._C._autograd._profiler_enabled


# --- distributed tensors as DCP sees them: what an asynchronous save (checkpoint/_async.py) re-creates over staged
# local data, keeping every other property (torch 2.13 and 2.14 alike) -------------------------------------------
def dtensor_local(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard, itself (not a copy, no autograd view): ``DTensor._local_tensor``."""
    return tensor._local_tensor


def dtensor_with_local(tensor: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``tensor``'s spec (mesh, placements, global shape and stride) over ``local`` (same shape and
    dtype; it may live on another device: torch's own async stagers re-create CPU copies the same way)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, tensor._spec, requires_grad=False)


def sharded_tensor_locals(tensor: Any) -> list[torch.Tensor]:
    """A torch ShardedTensor's local shards' tensors, in order."""
    return [shard.tensor for shard in tensor.local_shards()]


def sharded_tensor_with_locals(tensor: Any, locals_: list[torch.Tensor]) -> Any:
    """A ShardedTensor with ``tensor``'s global metadata and local shards' metadata over ``locals_`` (no
    communication: ``_init_from_local_shards_and_global_metadata``)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = [Shard(local, shard.metadata) for local, shard in zip(locals_, tensor.local_shards())]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, tensor.metadata(), process_group=tensor._process_group)


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch ``ShardedTensor`` (torch.distributed._shard, private and deprecated in torch: its
    checkpoints still reach DCP's state dicts)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


# --- torch.compile (dynamo) --------------------------------------------------------------------------------------
# Importing torch._dynamo costs seconds of CPU (it loads torch.fx's symbolic shapes, sympy, DTensor and FSDP2), so
# none of these imports it: nothing can be compiling while it is not imported (torch.compile imports it first).
def _dynamo_loaded() -> bool:
    """Whether ``torch._dynamo`` was imported (``sys.modules``): while it was not, nothing is compiled."""
    return "torch._dynamo" in sys.modules


def eager_under_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly under torch.compile: through ``torch._dynamo.disable(fn)`` (made at the first call that
    finds dynamo imported), and called directly while dynamo is not imported. The wrapper's own frames are skipped
    (``skip_frames``), so dynamo never traces the check."""
    disabled: list[Callable[..., Any]] = []

    def eager(*args: Any, **kwargs: Any) -> Any:
        if not _dynamo_loaded():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch._dynamo.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    skip_frames(eager.__code__)
    return functools.update_wrapper(eager, fn)


def skip_frames(code: Any) -> None:
    """Marks the frames of ``code`` (a function's ``__code__``) for dynamo to skip; the frames they call are still
    compiled. What ``torch._dynamo.eval_frame.skip_code`` does (2.13, 2.14: ``set_code_exec_strategy(code,
    FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))``), called on torch._C's own functions so that dynamo
    is not imported; the mark lives on the code object and holds when dynamo is imported later. A torch without
    them gets ``skip_code`` itself (importing dynamo)."""
    frame_eval: Any = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    strategy = getattr(frame_eval, "_FrameExecStrategy", None)
    action = getattr(frame_eval, "_FrameAction", None)
    if strategy is None or action is None or not hasattr(frame_eval, "set_code_exec_strategy"):
        from torch._dynamo.eval_frame import skip_code

        skip_code(code)
        return
    frame_eval.set_code_exec_strategy(code, strategy(action.SKIP, action.DEFAULT))


def compiled_module_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(module)`` wrapped, where ``model`` is such a wrapper
    (``torch._dynamo.eval_frame.OptimizedModule._orig_mod``); None for any other module (without importing dynamo:
    while it is not imported, nothing was compiled)."""
    if _dynamo_loaded() and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return None


# --- torch DDP's and Join's private protocol: what shardkit DDP, a torch DDP subclass, answers ------------------------
def active_ddp_module() -> nn.Module | None:
    """The DDP module whose forward runs (``DistributedDataParallel._active_ddp_module``): torch.compile's
    DDPOptimizer reads it (through ``_get_active_ddp_module``) to split the graph at the module's bucket cap."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._active_ddp_module


def set_active_ddp_module(module: nn.Module | None) -> None:
    """Sets the DDP module whose forward runs (see ``active_ddp_module``)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_class: Any = DistributedDataParallel
    ddp_class._active_ddp_module = module


def present_as_torch_ddp(ddp: Any) -> None:
    """Gives ``ddp`` (a torch DDP subclass whose torch constructor does not run) the attributes torch DDP's own
    methods read that its constructor would have set: no Python reducer (``_use_python_reducer``), no delayed
    all-reduce of all parameters (``_delay_all_reduce_all_params``)."""
    ddp._use_python_reducer = False
    ddp._delay_all_reduce_all_params = False


def ddp_ignored_names(module: nn.Module) -> Iterable[str]:
    """The parameter and buffer names torch DDP leaves out of its broadcasts and reductions for ``module``
    (``module._ddp_params_and_buffers_to_ignore``, set by
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``); none where it was not set."""
    return getattr(module, "_ddp_params_and_buffers_to_ignore", ())


def join_enabled(joinable: Any) -> bool:
    """Whether ``joinable`` runs inside an enabled ``Join`` context (``Joinable._join_config.enable``, set by
    ``Joinable.__init__``, disabled, and by the ``Join`` context's constructor)."""
    return joinable._join_config.enable


def record_comm_hook(ddp_model: Any, name: str, state: Any) -> None:
    """Adds ``(name, state)`` to torch DDP's record of the comm hooks registered on ``ddp_model``
    (``DistributedDataParallel._comm_hooks``, the list torch's ``register_comm_hook`` appends each hook to) where
    it keeps one, so that record names shardkit's native hooks too."""
    if isinstance(getattr(ddp_model, "_comm_hooks", None), list):
        ddp_model._comm_hooks.append((name, state))


def track_steps_for_lr_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Wraps ``optimizer.step`` as torch's LRScheduler wraps the step of the optimizer it is built over (the wrapper
    is marked ``_wrapped_by_lr_sched`` and sets ``optimizer._opt_called``), for a scheduler moved to ``optimizer``
    after its construction: else the scheduler warns that ``optimizer.step()`` was overridden. Once per optimizer."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    optimizer_ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        owner: Any = optimizer_ref()
        owner._opt_called = True
        return type(owner).step(owner, *args, **kwargs)

    tracked.__dict__["_wrapped_by_lr_sched"] = True
    wrapped: Any = optimizer
    wrapped.step = tracked


def fused_adam_kernel(decoupled_weight_decay: bool) -> Callable[..., None]:
    """torch's fused Adam / AdamW update (``torch._fused_adam_`` / ``torch._fused_adamw_``, what
    ``torch.optim.Adam(W)(fused=True)`` runs; torch 2.11-2.14 take the same keywords: ``amsgrad, lr, beta1, beta2,
    weight_decay, eps, maximize, grad_scale, found_inf``). shardkit.optim's offloaded optimizers run it on each chunk of
    state streamed from disk, so their update is torch's, bit for bit."""
    return torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_

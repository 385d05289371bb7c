"""shardkit.FullyShardedDataParallel: fused flat-parameter sharding (ZeRO-3) with torch FSDP1's arguments.

Units. The auto-wrap policy (``shardkit.wrap``, FSDP1's signatures) picks modules as units; the wrapped
module itself is the root unit. Nothing is replaced in the module tree: units are ordinary modules with
forward hooks, so ``named_parameters()`` and ``state_dict()`` keys equal the unwrapped model's. Each
parameter belongs to exactly one unit: the closest unit enclosing every module that registers it (a tied
embedding and LM head are one parameter, owned once). A unit's parameters of one dtype and requires_grad
form one flat parameter, a C++ ``FlatParamHandle`` (csrc/fsdp/flat_param.h: layout, copy-in, all-gather,
views, reduce-scatter, mixed-precision casts). Frozen parameters therefore never get gradient memory.

Between steps every parameter is a view of this rank's piece of its flat shard (1-D, possibly empty; the
whole parameter under NO_SHARD), so an optimizer built from ``model.parameters()`` steps 1/N of the model.

Each forward and backward runs the hook schedule of _fsdp1_schedule.py (gather, prefetch, reduce-scatter,
reshard, end of backward; the class derives from its UnitSchedule). The module is laid out as torch FSDP2's
_fully_shard/ package: the configuration values in _fsdp1_api.py, construction's checks and choices in
_fsdp1_init.py, the units and flat groups in _fsdp1_units.py, the state-dict adapter in _state_dict.py; this file
keeps the class, its nn.Module surface, and the state-dict, no_sync, clip_grad_norm_ and summon_full_params calls.

``cpu_offload=CPUOffload(offload_params=True)`` (torch FSDP1's semantics; needs CUDA): the flat shards, and so the
parameters between steps, their ``.grad`` and the state of an optimizer built from ``model.parameters()``, live
in pinned host memory, and the optimizer steps on the CPU. Units compute on the compute device (``device_id``,
else the parameters' CUDA device, else ``torch.cuda.current_device()``): the module's parameters are not moved
there, its buffers and the root's forward inputs are. Each unshard copies this rank's shard host -> device on a
side stream (the all-gather follows it there), each reduction's result is copied device -> host on another and
waited for before it becomes ``.grad`` (csrc/fsdp/offload.h). ``summon_full_params`` and full state dicts give
compute-device tensors unless ``offload_to_cpu``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, _agreement
from ..checkpoint import _front_protocol as front_protocol
from ..checkpoint._front_protocol import FullStateDictConfig, ShardedStateDictConfig, StateDictSetting, StateDictType
from ..quantized import Quantized, check_group
from ..wrap import as_policy, assign_parameters, choose_units
from . import _fsdp1_init as _init
from . import _state_dict
from ._fsdp1_api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from ._fsdp1_schedule import UnitSchedule
from ._fsdp1_units import make_unit
from ._resident_memory import ResidentSharedMemory

__all__ = ["BackwardPrefetch", "CPUOffload", "FullStateDictConfig", "FullyShardedDataParallel", "MixedPrecision",
           "ShardedStateDictConfig", "ShardingStrategy", "StateDictType"]


class FullyShardedDataParallel(UnitSchedule, nn.Module):
    """ZeRO-3 data parallelism with torch FSDP1's arguments (``use_orig_params=True`` semantics, the only mode).

    See the module docstring for how it works and docs/fsdp1.md for what differs from torch. shardkit's one
    argument beyond FSDP1's, keyword-only: ``comm=shardkit.Quantized(...)`` quantizes the units' all-gathers and
    gradient reductions between hosts (docs/backend.md, "Quantized bytes between hosts").
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        auto_wrap_policy: Callable[..., bool] | set[type[nn.Module]] | None = None,
        mixed_precision: MixedPrecision | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        sync_module_states: bool = False,
        device_id: int | torch.device | None = None,
        ignored_modules: list[nn.Module] | None = None,
        cpu_offload: CPUOffload | None = None,
        use_orig_params: bool = True,
        *,
        comm: Quantized | None = None,
    ) -> None:
        super().__init__()
        _refuse_wrapped(module)
        if comm is not None and not isinstance(comm, Quantized):
            raise TypeError(f"shardkit FSDP: comm must be a shardkit.Quantized or None, got {comm!r}")
        self.cpu_offload = cpu_offload or CPUOffload()
        mixed_precision = mixed_precision or MixedPrecision()
        ignored = {id(p) for m in (ignored_modules or []) for p in m.parameters()}
        managed = [(n, p) for n, p in module.named_parameters() if id(p) not in ignored]
        unit_modules = choose_units(module, as_policy(auto_wrap_policy), {id(m) for m in ignored_modules or []})
        owners = assign_parameters(module, unit_modules, ignored)
        # The first collective, before any that depends on the arguments (HYBRID_SHARD's group creation included)
        # and before the refusals below: ranks that disagree all raise saying so, and ranks that agree refuse alike.
        _init.verify_same_arguments_and_layout_everywhere(
            {"sharding_strategy": getattr(sharding_strategy, "name", repr(sharding_strategy)),
             "process_group": _agreement.describe_groups(process_group),
             "mixed_precision": _agreement.non_default_fields(mixed_precision),
             "cpu_offload": _agreement.non_default_fields(self.cpu_offload),
             "use_orig_params": repr(use_orig_params),
             "backward_prefetch": getattr(backward_prefetch, "name", repr(backward_prefetch)),
             "forward_prefetch": repr(forward_prefetch),
             "limit_all_gathers": repr(limit_all_gathers),
             "sync_module_states": repr(sync_module_states),
             "comm": repr(comm),
             "the compute device type": _init.compute_device_type(device_id, self.cpu_offload, managed),
             # It decides whether FSDP checks each collective's identity before issuing it (_collective_identity).
             "TORCH_DISTRIBUTED_DEBUG": dist.get_debug_level().name},
            _init.layout(owners), _agreement.pair_members(process_group), process_group)
        if self.cpu_offload.offload_params:
            _init.refuse_offload_without_cuda()
            if comm is not None:
                raise ValueError("shardkit FSDP: comm=shardkit.Quantized(...) with CPUOffload(offload_params=True) is "
                                 "not available: the collectives then run on CUDA tensors, which are not quantized "
                                 "yet")
        if not use_orig_params:
            raise NotImplementedError("shardkit FSDP: use_orig_params=False is not supported: the original parameters "
                                      "are always what the model exposes (FSDP1's use_orig_params=True)")
        if not isinstance(sharding_strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy must be a shardkit.fsdp.ShardingStrategy, got {sharding_strategy!r}")
        if mixed_precision.keep_low_precision_grads:
            raise NotImplementedError("shardkit FSDP: MixedPrecision(keep_low_precision_grads=True) is not supported; "
                                      "gradients are returned in the parameters' dtype")
        self._fsdp_wrapped_module = module
        self.sharding_strategy = sharding_strategy
        self.mixed_precision = mixed_precision
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self._shard_group, self._replicate_group, self.process_group = _init.groups(sharding_strategy, process_group)
        self.comm = comm
        check_group(comm, self.process_group, "shardkit FSDP")
        self.rank = dist.get_rank(self.process_group)
        if device_id is not None and not self.cpu_offload.offload_params:
            _init.move_to_device_id(module, device_id, self.rank)  # in place: `managed` holds the same parameters
        devices = _init.check_one_device(module, managed, bool(ignored), self.rank)
        # Offloaded: where the units compute (the parameters themselves stay where they are until the handles
        # copy them into pinned shards).
        self._offload_device = (_init.offload_device(device_id, managed, self.rank) if self.cpu_offload.offload_params
                                else None)
        if sync_module_states:
            _init.broadcast_from_rank0(self._replicate_group, self._shard_group,
                                       [p.detach() for _, p in managed] + [b.detach() for b in module.buffers()])
        if mixed_precision.buffer_dtype is not None:
            for b in module.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(mixed_precision.buffer_dtype)
        if self._offload_device is not None:  # FSDP1: buffers on the compute device, parameters on the CPU
            ignored_buffers = {id(b) for m in (ignored_modules or []) for b in m.buffers()}
            for b in module.buffers():
                if id(b) not in ignored_buffers:
                    b.data = b.data.to(self._offload_device)
        wire = comm.wire() if comm is not None else None
        self._gathered_bytes = _C.GatheredBytes()  # the handles count their full buffers in it
        self._units = [make_unit(name, m, owners[name], mixed_precision, self._shard_group, self._replicate_group,
                                 self._offload_device, wire, self._gathered_bytes) for name, m in unit_modules]
        self._root = self._units[0]
        for u in self._units:
            u.module._shardkit_fsdp_unit = u  # type: ignore[assignment]  # nn.Module's __setattr__ is typed for tensors
            u.module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True)
            u.module.register_forward_hook(self._make_post_forward(u))
        memory = _init.zero_copy_memory(self._shard_group, self._offload_device is not None, managed, self._units)
        # Every unit but the largest fits in the second-largest unit's gradient size: only that much stays
        # resident between iterations (see _resident_memory.py).
        self._reduce_memory = None if memory is None else ResidentSharedMemory(memory, self._shard_group)
        if self._reduce_memory is not None:
            sizes = sorted(g.handle.reduce_input_bytes for u in self._units for g in u.groups if g.trainable)
            self._reduce_memory.set_kept(sizes[-2] if len(sizes) > 1 else 0)

        self._init_schedule(on_cpu=self._offload_device is None and devices == {"cpu"})
        # Set by state_dict_type() (checkpoint/_front_protocol.py: this front is a ModelFront).
        self.state_dict_setting = StateDictSetting(StateDictType.FULL_STATE_DICT, FullStateDictConfig())

    # --- nn.Module surface ----------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module (FSDP1's name)."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The unwrapped model's names (no wrapper prefix); values are the sharded parameters."""
        return self._fsdp_wrapped_module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self._fsdp_wrapped_module.named_buffers(prefix, recurse, remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    @staticmethod
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: FullStateDictConfig | ShardedStateDictConfig | None = None
                        ) -> contextlib.AbstractContextManager[None]:
        """FSDP1's context: inside it, state_dict() and load_state_dict() of every shardkit FSDP root and every
        shardkit DistributedDataParallel in ``module`` use ``state_dict_type`` (see fsdp/_state_dict.py and
        shardkit/_zero_state_dict.py), and so do optim_state_dict() and optim_state_dict_to_load()."""
        return front_protocol.state_dict_type(module, state_dict_type, state_dict_config)

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False):
        """By default the full state dict (FSDP1's FULL_STATE_DICT): the unwrapped model's keys and shapes, on
        every rank; see state_dict_type() for the others. A collective for full ones: call it on every rank."""
        if args:
            raise TypeError("state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        config = self.state_dict_setting.config  # state_dict_type() pairs each kind with its config class
        if isinstance(config, ShardedStateDictConfig):
            state = _state_dict.sharded_state_dict(self, config, prefix)
        else:
            state = _state_dict.full_state_dict(self, config, prefix)
        if destination is not None:
            destination.update(state)
            return destination
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Loads a full state dict (the unwrapped model's, from any world size) or a sharded one (DCP's, from
        any world size). Call it on every rank."""
        if assign:
            raise NotImplementedError("shardkit FSDP: load_state_dict(assign=True) is not supported; the parameters "
                                      "are views of the flat shards and are loaded by copy")
        return _state_dict.load(self, state_dict, strict)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None, group: Any = None) -> dict[str, Any]:
        """FSDP1's name-keyed optimizer state dict, full or sharded as the model's state_dict_type says: of an
        optimizer over a shardkit FSDP or DDP model (fsdp/_state_dict.py, shardkit/_zero_state_dict.py), or of a
        shardkit ZeroRedundancyOptimizer over any model (shardkit/_zero_state_dict.py), each front's through
        checkpoint/_front_protocol.py. A collective when full. An optimizer that never stepped gets its state
        tensors created first (a zero-learning-rate step), so a checkpoint can be loaded into them."""
        if optim_state_dict is not None or group is not None:
            raise NotImplementedError("shardkit FSDP optim_state_dict: the optim_state_dict= and group= arguments "
                                      "are not supported; the optimizer's own state is used")
        return front_protocol.optim_state_dict(model, optim, "FullyShardedDataParallel.optim_state_dict")

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict[str, Any], is_named_optimizer: bool = False,
                                 load_directly: bool = False, group: Any = None) -> dict[str, Any]:
        """A name-keyed optimizer state dict (from any world size, FSDP's or ZeRO's) as ``optim.load_state_dict``
        takes it; ``load_directly=True`` loads it too."""
        if is_named_optimizer or group is not None:
            raise NotImplementedError("shardkit FSDP optim_state_dict_to_load: is_named_optimizer= and group= are "
                                      "not supported")
        converted = front_protocol.optim_state_dict_to_load(model, optim, optim_state_dict,
                                                            "FullyShardedDataParallel.optim_state_dict_to_load")
        if load_directly:
            optim.load_state_dict(converted)
        return converted

    # checkpoint/_front_protocol.py's ModelFront: a plain optimizer over this model's sharded parameters.
    def name_keyed_optim_state_dict(self, optim: torch.optim.Optimizer) -> dict[str, Any]:
        return _state_dict.optim_state_dict(self, optim)

    def name_keyed_optim_state_dict_to_load(self, optim: torch.optim.Optimizer,
                                            optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        return _state_dict.optim_state_dict_to_load(self, optim, optim_state_dict)

    # --- training API -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full (unsharded) gradients locally; the first backward after it
        reduces them together with its own."""
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model, from the gradient shards (a collective:
        call on every rank). Returns the total norm (float32) and scales every gradient by
        ``max_norm / (total + 1e-6)`` when that is below 1."""
        norm_type = float(norm_type)
        grads = [p.grad for u in self._units for g in u.groups if g.trainable for p in g.params if p.grad is not None]
        device = next(self.parameters()).device
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads if g.numel()]).max().float() if any(
                g.numel() for g in grads) else torch.zeros((), device=device)
            local = local.reshape(1).clone()
            if self._shard_group is not None:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._shard_group)
            total = local[0]
        else:
            norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
            local = (torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)).reshape(1)
            if self._shard_group is not None:
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self._shard_group)
            total = local[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
        """Inside, every parameter of ``module``'s shardkit FSDP roots is whole (full precision, its own shape)
        on every rank: for evaluation, generation, inspection. ``writeback=True`` keeps what was changed
        (this rank's piece of each parameter goes back into its shard). A collective: call on every rank."""
        unsupported = [name for name, value in (("recurse=False", not recurse), ("rank0_only=True", rank0_only),
                                                 ("with_grads=True", with_grads)) if value]
        if unsupported:
            raise NotImplementedError(f"shardkit FSDP: summon_full_params({', '.join(unsupported)}) is not supported: "
                                      "every rank gathers every unit, without gradients")
        roots = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not roots:
            raise ValueError(f"summon_full_params: {type(module).__name__} holds no shardkit FullyShardedDataParallel")
        with contextlib.ExitStack() as stack:
            for root in roots:
                stack.enter_context(root._summon(writeback, offload_to_cpu))
            yield

    # --- summon ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _summon(self, writeback: bool, offload_to_cpu: bool) -> Iterator[None]:
        if self._summoned:
            raise RuntimeError(f"shardkit FSDP (rank {self.rank}): summon_full_params is already active")
        self._end_iteration()
        groups = [g for u in self._units for g in u.groups]
        for g in groups:  # every rank gathers the groups in the same order
            values = g.handle.gather_full_precision()
            for p, value in zip(g.params, values):
                p.data = value.cpu() if offload_to_cpu else value
        self._summoned = True
        try:
            yield
        finally:
            self._summoned = False
            for g in groups:
                if writeback:
                    g.handle.write_back([p.data for p in g.params])
                for p, view in zip(g.params, g.handle.shard_views()):
                    p.data = view


def _refuse_wrapped(module: nn.Module) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError("shardkit FSDP: the module is already a shardkit FullyShardedDataParallel")
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel) or hasattr(sub, "_shardkit_fsdp_unit"):
            raise ValueError(f"shardkit FSDP: submodule '{name or '(root)'}' is already wrapped by shardkit "
                             "FullyShardedDataParallel; wrap the unwrapped model once (use auto_wrap_policy for "
                             "nested units)")

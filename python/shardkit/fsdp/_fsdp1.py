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

One iteration, per unit (hooks run on the autograd/forward thread, in an order every rank shares, so the
collectives they issue match on every backend — DESIGN.md, "Collective order"):

  pre-forward    all-gather the flat parameter (or wait for the prefetched one); the module's parameters
                 become views of the full buffer; forward_prefetch issues the next unit's all-gather.
  post-forward   the sharded parameters come back; FULL_SHARD / HYBRID_SHARD free the full buffer (the
                 root keeps it: backward starts with it); a hook on the outputs marks the pre-backward.
  pre-backward   all-gather again if freed; the module's parameters are views of the full buffer again until the
                 post-backward (activation checkpointing recomputes from them: _use_backward_views); BACKWARD_PRE
                 prefetches the next unit in backward order. A unit's forward run while backward runs (a
                 recompute) gathers it if needed, issues no prefetch, and neither reshards nor hooks its outputs.
  post-backward  (every gradient of a flat group's parameters is in: the backward of _FullParameterViews)
                 the gradients are flattened — on a shardkit group on one host into shared memory, from
                 which the reduce-scatter reads the peers' gradients without copying them (zero-copy) —
                 cast/divided and reduce-scattered; the full buffer is freed.
  end            (an autograd callback) every reduction is finished in issue order and each parameter's
                 piece lands in its ``.grad``; every full buffer is freed.

Prefetch orders are those of the first iteration. ``limit_all_gathers``: a prefetch is issued only while
fewer than two non-root units hold full buffers, so at most the root and two units are gathered at once.
At most one reduction is in flight besides the one just issued.

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
import dataclasses
import enum
import math
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, _agreement, _profiling, _torch_compat
from .._collective_identity import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveLedger, backend_checks_identity
from ._resident_memory import ResidentSharedMemory
from ..backend import (compare_identities_across_hosts, host_groups, shared_buffer, warn_zero_copy_unavailable,
                      zero_copy_unavailable)
from ..checkpoint import _front_protocol as front_protocol
from ..checkpoint._front_protocol import FullStateDictConfig, ShardedStateDictConfig, StateDictSetting, StateDictType
from ..quantized import Quantized, check_group
from ..wrap import as_policy, assign_parameters, choose_units
from . import _state_dict

__all__ = ["BackwardPrefetch", "CPUOffload", "FullStateDictConfig", "FullyShardedDataParallel", "MixedPrecision",
           "ShardedStateDictConfig", "ShardingStrategy", "StateDictType"]

_BROADCAST_BUCKET_BYTES = 250 << 20


class ShardingStrategy(enum.Enum):
    FULL_SHARD = enum.auto()  # parameters, gradients and optimizer state sharded; full buffers freed after use
    SHARD_GRAD_OP = enum.auto()  # as FULL_SHARD, but the full buffers live from forward through backward
    NO_SHARD = enum.auto()  # replicated (DDP's memory), gradients all-reduced
    HYBRID_SHARD = enum.auto()  # FULL_SHARD inside each host, replicated across hosts


class BackwardPrefetch(enum.Enum):
    BACKWARD_PRE = enum.auto()  # the next unit's all-gather is issued when a unit's backward starts
    BACKWARD_POST = enum.auto()  # ... when a unit's backward ends


@dataclasses.dataclass
class MixedPrecision:
    """FSDP1's MixedPrecision: the full buffers (forward and backward compute) in ``param_dtype``, the gradient
    reduction in ``reduce_dtype`` (default: param_dtype), floating buffers in ``buffer_dtype`` (cast once, at
    wrapping). The shards, and so the optimizer, stay in the parameters' own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True


@dataclasses.dataclass
class CPUOffload:
    """FSDP1's CPUOffload. ``offload_params=True``: shards, gradients and optimizer state in (pinned) host memory,
    compute on a CUDA device (see the module docstring); without CUDA it is an error, never a silent no-op."""

    offload_params: bool = False


@dataclasses.dataclass(eq=False)
class _FlatGroup:
    """One FlatParamHandle and the user's parameters it holds, in handle order."""

    handle: Any  # _C.FlatParamHandle
    params: list[nn.Parameter]
    names: list[str]
    occurrences: list[list[tuple[nn.Module, str]]]  # every (module, attribute) registering each parameter
    shapes: list[torch.Size]  # the parameters' own shapes
    trainable: bool
    # This iteration's training views (_FullParameterViews: one backward node, shared by every forward of the unit
    # in the iteration).
    training_views: tuple[torch.Tensor, ...] | None = None
    # The views handed to the module while backward runs through the unit (pre-backward, or the pre-forward of an
    # activation-checkpointing recompute), until its post-backward: a _FullParameterViews node of their own.
    recompute_views: tuple[torch.Tensor, ...] | None = None
    # Gradients a reentrant recompute's backward gave to recompute_views while the training views' node is still
    # to run in this backward pass: reduced together with its gradients (handle order, None: none yet).
    deferred_grads: list[torch.Tensor | None] | None = None
    unit_name: str = "(root)"  # the FSDP unit's module name, in profiler labels


@dataclasses.dataclass(eq=False)
class _Unit:
    name: str
    module: nn.Module
    groups: list[_FlatGroup]
    is_root: bool


class FullyShardedDataParallel(nn.Module):
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
        _verify_same_arguments_and_layout_everywhere(
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
             "the compute device type": _compute_device_type(device_id, self.cpu_offload, managed),
             # It decides whether FSDP checks each collective's identity before issuing it (_collective_identity).
             "TORCH_DISTRIBUTED_DEBUG": dist.get_debug_level().name},
            _layout(owners), _agreement.pair_members(process_group), process_group)
        if self.cpu_offload.offload_params:
            _refuse_offload_without_cuda()
            if comm is not None:
                raise ValueError("shardkit FSDP: comm=shardkit.Quantized(...) with CPUOffload(offload_params=True) is not "
                                 "available: the collectives then run on CUDA tensors, which are not quantized yet")
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
        self._shard_group, self._replicate_group, self.process_group = _groups(sharding_strategy, process_group)
        self.comm = comm
        check_group(comm, self.process_group, "shardkit FSDP")
        self.rank = dist.get_rank(self.process_group)
        if device_id is not None and not self.cpu_offload.offload_params:
            target = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
            # FSDP1's rule: a CPU module moves to device_id; one already on another GPU is a mistake, not a move.
            elsewhere = next(((n, p.device) for n, p in module.named_parameters()
                              if p.device.type != "cpu" and p.device != target), None)
            if elsewhere is not None:
                raise ValueError(f"shardkit FSDP (rank {self.rank}): device_id={device_id!r} ({target}), but parameter "
                                 f"'{elsewhere[0]}' is on {elsewhere[1]}; pass the module's own device as device_id, "
                                 "or keep the module on the CPU and let FSDP move it")
            module.to(target)  # in place: `managed` holds the same parameters

        if not managed:
            raise ValueError(f"shardkit FSDP (rank {self.rank}): the module has no parameters to shard "
                             f"({type(module).__name__}{', all ignored' if ignored else ''})")
        devices = {str(p.device) for _, p in managed}
        if len(devices) > 1:
            raise ValueError(f"shardkit FSDP (rank {self.rank}): parameters on mixed devices {sorted(devices)}: "
                             + ", ".join(f"{n} on {p.device}" for n, p in managed[:8]))
        # Offloaded: where the units compute (the parameters themselves stay where they are until the handles
        # copy them into pinned shards).
        self._offload_device = (_offload_device(device_id, managed, self.rank) if self.cpu_offload.offload_params
                                else None)
        if sync_module_states:
            self._broadcast_from_rank0([p.detach() for _, p in managed] + [b.detach() for b in module.buffers()])
        if mixed_precision.buffer_dtype is not None:
            for b in module.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(mixed_precision.buffer_dtype)
        if self._offload_device is not None:  # FSDP1: buffers on the compute device, parameters on the CPU
            ignored_buffers = {id(b) for m in (ignored_modules or []) for b in m.buffers()}
            for b in module.buffers():
                if id(b) not in ignored_buffers:
                    b.data = b.data.to(self._offload_device)
        self._units = [self._make_unit(name, m, owners[name]) for name, m in unit_modules]
        self._root = self._units[0]
        for u in self._units:
            u.module._shardkit_fsdp_unit = u
            u.module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True)
            u.module.register_forward_hook(self._make_post_forward(u))
        memory = self._zero_copy_memory(managed)
        # Every unit but the largest fits in the second-largest unit's gradient size: only that much stays
        # resident between iterations (see _resident_memory.py).
        self._reduce_memory = None if memory is None else ResidentSharedMemory(memory, self._shard_group)
        if self._reduce_memory is not None:
            sizes = sorted(g.handle.reduce_input_bytes for u in self._units for g in u.groups if g.trainable)
            self._reduce_memory.set_kept(sizes[-2] if len(sizes) > 1 else 0)

        # Iteration state.
        self._require_backward_grad_sync = True
        self._forward_order: list[_Unit] = []
        self._backward_order: list[_Unit] = []
        self._orders_frozen = False
        self._backward_pending = False  # a forward with autograd ran; its backward has not ended yet
        self._callback_task: int | None = None  # the backward pass whose end-of-backward callback is queued
        self._pending: list[_FlatGroup] = []  # reductions in flight, in issue order
        self._summoned = False
        self._gathered_bytes = 0
        self.peak_gathered_bytes = 0  # the most bytes of full buffers (compute dtype) alive at once
        # "identity_checks": iterations that ended with FSDP's own identity check (where the backend compares none).
        self.collective_counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "identity_checks": 0}
        on_cpu = self._offload_device is None and devices == {"cpu"}
        for group in (self._shard_group, self._replicate_group):  # every rank, at the same point of each group
            if group is not None:
                compare_identities_across_hosts(group)
        self._shard_ledger, self._replicate_ledger = (
            CollectiveLedger(group, role, "shardkit FSDP")
            if group is not None and not backend_checks_identity(group, on_cpu) else None
            for group, role in ((self._shard_group, "shard group"), (self._replicate_group, "replicate group")))
        # Set by state_dict_type() (checkpoint/_front_protocol.py: this front is a ModelFront).
        self.state_dict_setting = StateDictSetting(StateDictType.FULL_STATE_DICT, FullStateDictConfig())

    # --- construction ---------------------------------------------------------------------------------
    def _make_unit(self, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> _Unit:
        occurrences: dict[int, list[tuple[nn.Module, str]]] = {}
        for sub in module.modules():
            for attr, p in _torch_compat.registered_parameters(sub).items():
                if p is not None:
                    occurrences.setdefault(id(p), []).append((sub, attr))
        keyed: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
        for fqn, p in params:
            keyed.setdefault((p.dtype, p.requires_grad), []).append((fqn, p))
        groups = []
        mp = self.mixed_precision
        for (dtype, trainable), members in keyed.items():
            floating = dtype.is_floating_point
            handle = _C.FlatParamHandle([p.detach() for _, p in members], self._shard_group, self._replicate_group,
                                        label=name or "(root)", param_dtype=mp.param_dtype if floating else None,
                                        reduce_dtype=(mp.reduce_dtype or mp.param_dtype) if floating else None,
                                        compute_device=self._offload_device)
            if self.comm is not None:
                handle.set_quantization(self.comm.wire())
            ps = [p for _, p in members]
            shapes = [p.shape for p in ps]
            for p, view in zip(ps, handle.shard_views()):
                p.data = view
            groups.append(_FlatGroup(handle, ps, [n for n, _ in members], [occurrences[id(p)] for p in ps], shapes,
                                     trainable, unit_name=name or "(root)"))
        return _Unit(name, module, groups, is_root=name == "")

    def _zero_copy_memory(self, managed: list[tuple[str, nn.Parameter]]) -> torch.Tensor | None:
        """Collective on the shard group: host memory every rank of it maps, big enough for the largest flat
        gradient it reduce-scatters, in which each backward makes the gradient it reduces next (one at a time:
        the previous reduction is finished first), so that the reduce-scatter reads the peers' gradients where
        they lie instead of copying them through the group's slots. Only on a shardkit group on one host, for
        host parameters and a shard group of several ranks; else None (ordinary memory, same results). Nobody
        asked for it, so only a refusal where it applies is worth a ZeroCopyUnavailableWarning: no room in
        /dev/shm (shardkit.backend.shared_buffer warns, on every rank)."""
        if self._shard_group is None or self._offload_device is not None:
            return None
        if any(p.device.type != "cpu" for _, p in managed):
            return None
        sizes = [g.handle.reduce_input_bytes for u in self._units for g in u.groups if g.trainable]
        if not sizes or zero_copy_unavailable(self._shard_group) is not None:  # gloo, or a group across hosts
            return None
        return shared_buffer(max(sizes), self._shard_group, who="shardkit FSDP", what="the flat gradients")

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        # Replicas first, then inside each shard group: every rank ends with global rank 0's values.
        for group in (self._replicate_group, self._shard_group):
            if group is not None and tensors:
                _torch_compat.broadcast_coalesced(group, tensors, _BROADCAST_BUCKET_BYTES, 0)

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
        if self.state_dict_setting.sharded:
            state = _state_dict.sharded_state_dict(self, self.state_dict_setting.config, prefix)
        else:
            state = _state_dict.full_state_dict(self, self.state_dict_setting.config, prefix)
        if destination is not None:
            destination.update(state)
            return destination
        return state

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
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

    # --- hooks --------------------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: _Unit):
        def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
            if self._summoned:
                return None
            if _torch_compat.current_graph_task() is not None:
                # A forward while backward runs: activation checkpointing recomputes the unit (or a module
                # around it). It needs the parameters whole again; its gradients reach the unit's post-backward.
                self._unshard(unit)
                self._use_backward_views(unit)
            else:
                if unit.is_root:
                    self._start_iteration()
                training = torch.is_grad_enabled()
                if training and not self._orders_frozen and unit not in self._forward_order:
                    self._forward_order.append(unit)
                self._unshard(unit)
                if self.forward_prefetch and self._orders_frozen:
                    self._prefetch_after(unit, self._forward_order)
                self._use_full_views(unit, training)
            inputs = None
            if unit.is_root and self._offload_device is not None:  # FSDP1: the root's inputs to the compute device
                inputs = _to_device((args, kwargs), self._offload_device)
            mp = self.mixed_precision
            if mp.param_dtype is not None and (mp.cast_forward_inputs or (unit.is_root and mp.cast_root_forward_inputs)):
                inputs = _cast_floating(inputs if inputs is not None else (args, kwargs), mp.param_dtype)
            return inputs

        return pre_forward

    def _make_post_forward(self, unit: _Unit):
        def post_forward(module: nn.Module, args: tuple, output: Any):
            if self._summoned:
                return None
            for g in unit.groups:
                _restore_parameters(g)
            if _torch_compat.current_graph_task() is not None:
                # The end of a recompute (pre_forward): its backward, or the one it serves, still reads the full
                # buffer; the unit's post-backward reshards it. No pre-backward: backward is already here.
                return None
            outputs = [t for t in _tensors_in(output) if t.requires_grad]
            will_backward = torch.is_grad_enabled() and bool(outputs)
            if will_backward:
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: self._pre_backward(unit), mode="any")
                self._backward_pending = True
            keep = unit.is_root or self.sharding_strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
            if not (keep and will_backward):
                self._reshard(unit)
            return None

        return post_forward

    def _pre_backward(self, unit: _Unit) -> None:
        # One end-of-backward callback per backward pass (graph task): a pass that raised never ran its
        # callback, and a flag left set by it would leave every later pass without one.
        task = _torch_compat.current_graph_task()
        if task != self._callback_task:
            self._callback_task = task
            _torch_compat.queue_end_of_backward(self._end_of_backward)
        if not self._orders_frozen and unit not in self._backward_order:
            self._backward_order.append(unit)
        self._unshard(unit)
        # The module sees its parameters whole until the unit's post-backward: a checkpointed part of it
        # (torch.utils.checkpoint inside the unit's forward) recomputes from them.
        self._use_backward_views(unit)
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_PRE and self._orders_frozen:
            self._prefetch_after(unit, self._backward_order)

    def _post_backward(self, unit: _Unit, group: _FlatGroup, grads: list[torch.Tensor | None],
                       prefetch: bool = True) -> None:
        """Runs (the backward of _FullParameterViews) when autograd has every gradient of `group`'s parameters
        for one backward pass (None: the parameter got none), in parameter order."""
        if group.deferred_grads is not None:
            grads = _add_gradients(grads, group.deferred_grads)
            group.deferred_grads = None
        sync = self._require_backward_grad_sync
        memory = self._reduce_memory.memory if sync and self._reduce_memory is not None else None
        made_in_memory = memory is not None and group.handle.flattens_into_memory
        if made_in_memory:
            self._finish_reductions()  # the one in flight reads the memory this gradient is about to be made in
            memory = self._resident_reduce_memory(group.handle.reduce_input_bytes, unit)
        with _profiling.span("shardkit::fsdp.flatten_gradients", unit.name or "(root)"):
            grad = group.handle.flatten_gradients(grads, memory)
        if sync:
            self._finish_reductions()  # at most one reduction in flight besides this one
            if memory is not None and not made_in_memory:  # reduce_start makes the reduce-dtype cast in it
                memory = self._resident_reduce_memory(group.handle.reduce_input_bytes, unit)
            if self._shard_ledger is not None:
                self._shard_ledger.record(REDUCE_SCATTER, group.handle.identity)
            if self._replicate_ledger is not None:
                self._replicate_ledger.record(ALL_REDUCE, group.handle.identity)
            with _profiling.span("shardkit::fsdp.reduce_scatter", unit.name or "(root)"):
                group.handle.reduce_start(grad, memory)
            self._pending.append(group)
            self.collective_counts["reduce_scatter"] += self._shard_group is not None
            self.collective_counts["all_reduce"] += self._replicate_group is not None
        else:
            group.handle.accumulate_unsynced(grad)
        # Every backward node that read this group's views has run (they are this node's inputs), so its full
        # buffer can go now. Frozen groups have no such node: later nodes may still read them; they are freed at
        # the end of backward.
        self._reshard_group(group)
        _restore_parameters(group)
        group.recompute_views = None
        if prefetch and self.backward_prefetch == BackwardPrefetch.BACKWARD_POST and self._orders_frozen:
            self._prefetch_after(unit, self._backward_order)

    def _defer_gradients(self, group: _FlatGroup, grads: list[torch.Tensor | None]) -> None:
        """A reentrant recompute's backward gave `group` these gradients; the training views' node, still to run
        in this backward pass, reduces them with its own."""
        group.deferred_grads = grads if group.deferred_grads is None else _add_gradients(group.deferred_grads, grads)

    def _end_of_backward(self) -> None:
        """The autograd callback queued by the first pre-backward hook: runs once backward has finished."""
        self._orders_frozen = True
        # Gradients a recompute deferred to a node that did not run after all (the unit ran twice, say): reduced
        # now, in unit order, the same on every rank.
        for u in self._units:
            for g in u.groups:
                if g.deferred_grads is not None:
                    self._post_backward(u, g, [None] * len(g.params), prefetch=False)
        self._end_iteration()

    def _start_iteration(self) -> None:
        if not self._backward_pending:
            self._end_iteration()

    def _end_iteration(self) -> None:
        """Finishes the reductions in flight (in issue order: every rank waits on the same collectives) and
        frees every full buffer. Also what a forward without backward (evaluation, an abandoned graph) left
        gathered is dropped here: the shards may change before the next forward (optimizer step, loading).
        First, where no backend compares the collectives' identities, their ledgers are (before the gradients are
        final, so that no optimizer steps with another unit's)."""
        ledgers = [ledger for ledger in (self._shard_ledger, self._replicate_ledger) if ledger and ledger.entries]
        for ledger in ledgers:
            ledger.verify()
        self.collective_counts["identity_checks"] += bool(ledgers)
        self._finish_reductions()
        if self._reduce_memory is not None:
            self._reduce_memory.release()
        for u in self._units:
            for g in u.groups:
                g.training_views = g.recompute_views = g.deferred_grads = None
                _restore_parameters(g)
            self._reshard(u)
        self._backward_pending = False

    def _resident_reduce_memory(self, needed: int, unit: _Unit) -> torch.Tensor | None:
        """The zero-copy memory with its first `needed` bytes allocated, or None: this unit is reduced from
        ordinary memory this iteration (a rank of the shard group had no room in /dev/shm: every rank warns).
        A collective on the shard group past the kept part (ResidentSharedMemory.ensure)."""
        why = self._reduce_memory.ensure(needed)
        if why is None:
            return self._reduce_memory.memory
        name = unit.name or "(root)"
        warn_zero_copy_unavailable("shardkit FSDP", f"the flat gradient of unit '{name}' ({needed} bytes) this "
                                   "iteration", why)
        return None

    def _finish_reductions(self) -> None:
        """Waits for the reductions in flight, in issue order (every rank waits on the same collectives), and
        hands each parameter its piece as .grad."""
        while self._pending:
            done = self._pending.pop(0)
            with _profiling.span("shardkit::fsdp.reduce_finish", done.unit_name):
                done.handle.reduce_finish(done.params)

    # --- gathering ------------------------------------------------------------------------------------
    def _start_gather(self, unit: _Unit) -> None:
        for g in unit.groups:
            if not g.handle.allocated:
                if self._shard_ledger is not None:
                    self._shard_ledger.record(ALL_GATHER, g.handle.identity)
                with _profiling.span("shardkit::fsdp.all_gather", unit.name or "(root)"):
                    g.handle.unshard_start()
                self._gathered_bytes += g.handle.full_bytes
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
                self.collective_counts["all_gather"] += self._shard_group is not None

    def _unshard(self, unit: _Unit) -> None:
        self._start_gather(unit)
        with _profiling.span("shardkit::fsdp.wait_all_gather", unit.name or "(root)"):
            for g in unit.groups:
                g.handle.unshard_wait()

    def _reshard(self, unit: _Unit) -> None:
        for g in unit.groups:
            self._reshard_group(g)

    def _reshard_group(self, group: _FlatGroup) -> None:
        if group.handle.allocated and not group.handle.full_is_shard:
            group.handle.reshard()
            self._gathered_bytes -= group.handle.full_bytes

    def _prefetch_after(self, unit: _Unit, order: list[_Unit]) -> None:
        try:
            following = order[order.index(unit) + 1]
        except (ValueError, IndexError):
            return
        if all(g.handle.allocated for g in following.groups):
            return
        if self.limit_all_gathers:
            held = sum(1 for u in self._units if not u.is_root and u is not following
                       and any(g.handle.allocated and not g.handle.full_is_shard for g in u.groups))
            if held >= 2:
                return
        self._start_gather(following)

    def _use_full_views(self, unit: _Unit, training: bool) -> None:
        for g in unit.groups:
            if g.trainable and training:
                if g.training_views is None:
                    leaf = g.handle.full_alias().requires_grad_(True)
                    views = _FullParameterViews.apply(leaf, g.handle, _PostBackward(self, unit, g))
                    # A Function that returns a one-tensor tuple gives back the tensor itself.
                    g.training_views = (views,) if isinstance(views, torch.Tensor) else views
                views = g.training_views
            else:
                views = g.handle.views(g.handle.full_alias())
            for places, view in zip(g.occurrences, views):
                for owner, attr in places:
                    _torch_compat.set_registered_parameter(owner, attr, view)

    def _use_backward_views(self, unit: _Unit) -> None:
        """While backward runs through `unit` (gathered): its module's parameters become views of the full buffer
        until the group's post-backward, so that a recompute (activation checkpointing) computes with them.

        They are views of a _FullParameterViews node of their own. A non-reentrant recompute only refills tensors
        saved by the training forward (its graph is never run), so its views need no gradient path. A reentrant
        one runs a backward of its own through them: if the training views' node is still to run in this backward
        pass (the unit used its parameters outside the checkpoint too), the recompute's gradients wait for it
        (one reduction per unit and backward pass, as without checkpointing); otherwise (the whole unit ran under
        reentrant checkpointing, so the training forward recorded nothing) this node is the unit's post-backward."""
        for g in unit.groups:
            if g.trainable:
                if g.recompute_views is None:
                    ordinary = g.training_views is not None and g.training_views[0].grad_fn is not None and \
                        _torch_compat.engine_will_run(g.training_views[0].grad_fn)
                    then = _DeferGradients(self, g) if ordinary else _PostBackward(self, unit, g)
                    with torch.enable_grad():  # backward hooks run without grad mode
                        leaf = g.handle.full_alias().requires_grad_(True)
                        views = _FullParameterViews.apply(leaf, g.handle, then)
                    g.recompute_views = (views,) if isinstance(views, torch.Tensor) else views
                views = g.recompute_views
            else:
                views = g.handle.views(g.handle.full_alias())
            for places, view in zip(g.occurrences, views):
                for owner, attr in places:
                    _torch_compat.set_registered_parameter(owner, attr, view)


class _FullParameterViews(torch.autograd.Function):
    """A trainable flat group's parameters as views of its full buffer, for training forwards. One node per group
    and iteration: FSDP hands the same views to every forward of the unit until the iteration ends, so a unit
    run twice still reduces once per backward pass. The backward runs once every node that read the views has
    given its gradients, receives them all at once and hands them to FSDP's post-backward, which flattens them
    where the reduction reads them (the shard group's shared memory, for a zero-copy reduce-scatter, else a new
    tensor) and issues it; `full` (the leaf that only makes the views differentiable) gets no gradient."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, handle: Any, post_backward: Callable[[list], None]):
        ctx.set_materialize_grads(False)  # a parameter without a gradient: None, zeros written by the flatten
        ctx.post_backward = post_backward
        return tuple(handle.views(full))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.post_backward(list(grads))
        return None, None, None


class _PostBackward:
    """FSDP's post-backward for one flat group, as a _FullParameterViews node calls it, holding the model weakly:
    the node is kept alive by the group's views (the model's, until the iteration ends), and a strong reference
    back would close a cycle through a C++ autograd node that Python's collector cannot follow — a model deleted
    after a forward without backward would never be freed."""

    def __init__(self, fsdp: FullyShardedDataParallel, unit: _Unit, group: _FlatGroup) -> None:
        self._refs = (weakref.ref(fsdp), weakref.ref(unit), weakref.ref(group))

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        fsdp, unit, group = (ref() for ref in self._refs)
        if fsdp is None or unit is None or group is None:
            raise RuntimeError("shardkit FSDP: backward through a forward of a model that has been deleted")
        fsdp._post_backward(unit, group, grads)


class _DeferGradients:
    """The backward of a reentrant recompute's _FullParameterViews when the training views' node is still to run:
    hands the gradients to FSDP, which adds them to that node's (held weakly, as _PostBackward)."""

    def __init__(self, fsdp: FullyShardedDataParallel, group: _FlatGroup) -> None:
        self._refs = (weakref.ref(fsdp), weakref.ref(group))

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        fsdp, group = (ref() for ref in self._refs)
        if fsdp is None or group is None:
            raise RuntimeError("shardkit FSDP: backward through a forward of a model that has been deleted")
        fsdp._defer_gradients(group, grads)


# --- helpers -----------------------------------------------------------------------------------------------
def _restore_parameters(group: _FlatGroup) -> None:
    """The module registers the sharded parameters again (where a forward or backward put views)."""
    for p, places in zip(group.params, group.occurrences):
        for owner, attr in places:
            _torch_compat.set_registered_parameter(owner, attr, p)


def _add_gradients(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


def _refuse_wrapped(module: nn.Module) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError("shardkit FSDP: the module is already a shardkit FullyShardedDataParallel")
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel) or hasattr(sub, "_shardkit_fsdp_unit"):
            raise ValueError(f"shardkit FSDP: submodule '{name or '(root)'}' is already wrapped by shardkit "
                             "FullyShardedDataParallel; wrap the unwrapped model once (use auto_wrap_policy for "
                             "nested units)")


def _groups(strategy: ShardingStrategy, process_group):
    """(shard group, replicate group, the group spanning both) for a strategy."""
    if strategy == ShardingStrategy.HYBRID_SHARD:
        if isinstance(process_group, tuple):
            if len(process_group) != 2 or any(g is None for g in process_group):
                raise ValueError("HYBRID_SHARD's process_group=(shard_group, replicate_group) needs both groups, "
                                 f"got {process_group!r}")
            shard, replicate = process_group
            return (shard if dist.get_world_size(shard) > 1 else None,
                    replicate if dist.get_world_size(replicate) > 1 else None, shard)
        return _hybrid_groups(process_group)
    if isinstance(process_group, tuple):
        raise ValueError(f"a (shard, replicate) process group pair is for HYBRID_SHARD, not {strategy.name}")
    group = process_group if process_group is not None else _torch_compat.default_group()
    if strategy == ShardingStrategy.NO_SHARD or dist.get_world_size(group) == 1:
        return None, (group if dist.get_world_size(group) > 1 else None), group
    return group, None, group


def _hybrid_groups(process_group):
    if process_group is not None and dist.get_process_group_ranks(process_group) != list(range(dist.get_world_size())):
        raise ValueError("HYBRID_SHARD over a subgroup: pass process_group=(shard_group, replicate_group)")
    on_host, across_hosts = host_groups("shardkit FSDP HYBRID_SHARD")
    shard = on_host if dist.get_world_size(on_host) > 1 else None
    replicate = across_hosts if dist.get_world_size(across_hosts) > 1 else None
    return shard, replicate, _torch_compat.default_group()


def _global_rank() -> str:
    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"


def _refuse_offload_without_cuda() -> None:
    """offload_params=True keeps the shards in pinned host memory and computes on a GPU: without one it would
    silently be plain CPU training, so it is refused, naming why."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("torch.cuda.is_available() is False")
    if not _C.with_cuda:
        reasons.append("this shardkit was built without CUDA (build it with SHARDKIT_CUDA=1)")
    if reasons:
        raise RuntimeError(f"shardkit FSDP (rank {_global_rank()}): cpu_offload=CPUOffload(offload_params=True) needs "
                           "a CUDA device (the shards live in pinned host memory, the units compute on the GPU), but "
                           + " and ".join(reasons))


def _offload_device(device_id: int | torch.device | None, managed: list[tuple[str, nn.Parameter]],
                    rank: int) -> torch.device:
    """The compute device of an offloaded model, as FSDP1 picks it: ``device_id``, else the parameters' CUDA
    device, else the current CUDA device. Parameters must be on the CPU or on that device."""
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if device.type != "cuda":
            raise ValueError(f"shardkit FSDP (rank {rank}): cpu_offload=CPUOffload(offload_params=True) computes on a "
                             f"CUDA device, but device_id={device_id!r}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = next((p.device for _, p in managed if p.device.type == "cuda"),
                      torch.device("cuda", torch.cuda.current_device()))
    elsewhere = [(n, p.device) for n, p in managed if p.device.type != "cpu" and p.device != device]
    if elsewhere:
        name, where = elsewhere[0]
        raise ValueError(f"shardkit FSDP (rank {rank}): cpu_offload=CPUOffload(offload_params=True) computes on "
                         f"{device} (device_id={device_id!r}), but parameter '{name}' is on {where}; keep the module "
                         "on the CPU (or on the compute device)")
    return device


def _verify_same_arguments_and_layout_everywhere(arguments: dict[str, str], layout: list, members: Any,
                                                  process_group: Any) -> None:
    """The wrapper's first collective: every rank's communication arguments (printable values), its groups'
    members (``members``: _agreement.pair_members) and its units' layout (_layout) go to every rank in one exchange
    (shardkit._agreement), issued alike whatever the arguments. Raises the same error on every rank, naming the
    ranks and the values, where any differ: ranks that went on would pair different collectives."""
    me = dist.get_rank()
    given = process_group if isinstance(process_group, tuple) else (process_group,)
    everyone = _agreement.gather((arguments, members, layout), _agreement.exchange_groups(given))
    problems = _agreement.disagreements({rank: theirs[0] for rank, theirs in everyone.items()})
    problems += _agreement.mismatched_pairs({rank: theirs[1] for rank, theirs in everyone.items()})
    if problems:
        raise RuntimeError(f"shardkit FSDP (rank {me}): {'; '.join(problems)}; pass the same arguments on every rank")
    layouts = {rank: theirs[2] for rank, theirs in everyone.items()}
    first = min(layouts)
    reference = layouts[first]
    differing = [rank for rank, theirs in sorted(layouts.items()) if theirs != reference]
    if not differing:
        return
    theirs = layouts[differing[0]]
    for position in range(max(len(reference), len(theirs))):
        a = reference[position] if position < len(reference) else None
        b = theirs[position] if position < len(theirs) else None
        if a != b:
            unit = (a or b)[0] or "(root)"
            raise RuntimeError(
                f"shardkit FSDP (rank {me}): unit '{unit}' differs between ranks: rank {first} has "
                f"{_describe_unit(a)}, {_agreement.name_ranks(differing)} {'have' if len(differing) > 1 else 'has'} "
                f"{_describe_unit(b)}; wrap the same model with the same policy on every rank")


def _layout(owners: dict[str, list[tuple[str, nn.Parameter]]]) -> list:
    """The units as ranks compare them: (unit, [(name, shape, dtype, requires_grad) of each parameter])."""
    return [(unit, [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in params])
            for unit, params in owners.items()]


def _compute_device_type(device_id: int | torch.device | None, cpu_offload: CPUOffload,
                         managed: list[tuple[str, nn.Parameter]]) -> str:
    """Where the units will compute, as ranks compare it ("cpu", "cuda"): ranks on different device types would
    run their collectives on different engines."""
    if cpu_offload.offload_params:
        return "cuda"
    if device_id is not None:
        return "cuda" if isinstance(device_id, int) else torch.device(device_id).type
    return managed[0][1].device.type if managed else "cpu"


def _describe_unit(entry) -> str:
    if entry is None:
        return "no such unit"
    _, params = entry
    shown = ", ".join(f"{n} {list(s)} {d.removeprefix('torch.')}{'' if g else ' frozen'}" for n, s, d, g in params[:4])
    return f"{len(params)} parameters ({shown}{', ...' if len(params) > 4 else ''})"


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors_in(getattr(obj, f.name))]
    return []


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(v, dtype) for v in obj)
    return obj

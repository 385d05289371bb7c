"""The FSDP1 front's hook schedule: when each unit gathers, prefetches, reduces and reshards, and the views its
module computes with. ``UnitSchedule`` is a base of shardkit.FullyShardedDataParallel (_fsdp1.py), which
builds the units (_fsdp1_units.py) and registers ``_make_pre_forward`` / ``_make_post_forward`` on each unit's
module; everything below runs from those hooks, from autograd, and from the front's state-dict, summon and clip
calls (``_end_iteration``). The flat parameters' own state (gathered, gathering, reduction pending) and the bytes
their full buffers hold are their C++ handles' (csrc/fsdp/flat_param.h); here is only the order of their calls.

One iteration, per unit (hooks run on the autograd/forward thread, in an order every rank shares, so the
collectives they issue match on every backend — docs/design.md, "Collective order"):

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

Offloaded (``CPUOffload(offload_params=True)``), the root's forward inputs go to the compute device in its
pre-forward; the copies between host shards and device buffers are the handles' (csrc/fsdp/offload.h).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, _profiling, _torch_compat
from .._collective_identity import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    CollectiveLedger,
    backend_checks_identity,
    compare_identities_across_hosts,
)
from .._nested_tensors import cast_floating, tensors_in, to_device
from .._zero_copy import warn_zero_copy_unavailable
from ._fsdp1_api import BackwardPrefetch, MixedPrecision, ShardingStrategy
from ._fsdp1_units import FlatGroup, Unit, register_parameters, restore_parameters
from ._resident_memory import ResidentSharedMemory


class UnitSchedule:
    """The hooks and the iteration state of shardkit.FullyShardedDataParallel. The front sets, before
    ``_init_schedule``: ``_units`` (root first), ``_shard_group`` / ``_replicate_group``, ``_reduce_memory``
    (ResidentSharedMemory or None), ``_offload_device``, ``_gathered_bytes`` (the _C.GatheredBytes its units'
    handles count their full buffers in) and its FSDP1 arguments (``sharding_strategy``, ``mixed_precision``,
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``)."""

    # What the front sets (annotations only: nn.Module keeps the values).
    _units: list[Unit]
    _shard_group: dist.ProcessGroup
    _replicate_group: dist.ProcessGroup | None
    _reduce_memory: ResidentSharedMemory | None
    _offload_device: torch.device | None
    _gathered_bytes: _C.GatheredBytes
    sharding_strategy: ShardingStrategy
    mixed_precision: MixedPrecision  # MixedPrecision() where none was given
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool

    @property
    def peak_gathered_bytes(self) -> int:
        """The most bytes of full buffers (compute dtype, beyond the shards) alive at once so far: the handles'
        count (csrc/fsdp/flat_param.h, GatheredBytes)."""
        return self._gathered_bytes.peak

    def _init_schedule(self, on_cpu: bool) -> None:
        """The iteration state, and the collective ledgers where the backend compares no identities (a
        collective on each group, at the same point on every rank). ``on_cpu``: the units compute on the CPU."""
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._summoned = False  # inside summon_full_params(): the hooks do nothing
        self._forward_order: list[Unit] = []
        self._backward_order: list[Unit] = []
        self._orders_frozen = False
        self._backward_pending = False  # a forward with autograd ran; its backward has not ended yet
        self._callback_task: int | None = None  # the backward pass whose end-of-backward callback is queued
        self._pending: list[FlatGroup] = []  # reductions in flight, in issue order
        # "identity_checks": iterations that ended with FSDP's own identity check (where the backend compares none).
        self.collective_counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "identity_checks": 0}
        for group in (self._shard_group, self._replicate_group):  # every rank, at the same point of each group
            if group is not None:
                compare_identities_across_hosts(group)
        self._shard_ledger, self._replicate_ledger = (
            CollectiveLedger(group, role, "shardkit FSDP")
            if group is not None and not backend_checks_identity(group, on_cpu) else None
            for group, role in ((self._shard_group, "shard group"), (self._replicate_group, "replicate group")))

    # --- hooks --------------------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
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
                inputs = to_device((args, kwargs), self._offload_device)
            mp = self.mixed_precision
            cast_here = mp.cast_forward_inputs or (unit.is_root and mp.cast_root_forward_inputs)
            if mp.param_dtype is not None and cast_here:
                inputs = cast_floating(inputs if inputs is not None else (args, kwargs), mp.param_dtype)
            return inputs

        return pre_forward

    def _make_post_forward(self, unit: Unit):
        def post_forward(module: nn.Module, args: tuple, output: Any):
            if self._summoned:
                return None
            for g in unit.groups:
                restore_parameters(g)
            if _torch_compat.current_graph_task() is not None:
                # The end of a recompute (pre_forward): its backward, or the one it serves, still reads the full
                # buffer; the unit's post-backward reshards it. No pre-backward: backward is already here.
                return None
            outputs = [t for t in tensors_in(output) if t.requires_grad]
            will_backward = torch.is_grad_enabled() and bool(outputs)
            if will_backward:
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: self._pre_backward(unit), mode="any")
                self._backward_pending = True
            keep = unit.is_root or self.sharding_strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
            if not (keep and will_backward):
                self._reshard(unit)
            return None

        return post_forward

    def _pre_backward(self, unit: Unit) -> None:
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

    def _post_backward(self, unit: Unit, group: FlatGroup, grads: list[torch.Tensor | None],
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
        restore_parameters(group)
        group.recompute_views = None
        if prefetch and self.backward_prefetch == BackwardPrefetch.BACKWARD_POST and self._orders_frozen:
            self._prefetch_after(unit, self._backward_order)

    def _defer_gradients(self, group: FlatGroup, grads: list[torch.Tensor | None]) -> None:
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
                restore_parameters(g)
            self._reshard(u)
        self._backward_pending = False

    def _resident_reduce_memory(self, needed: int, unit: Unit) -> torch.Tensor | None:
        """The zero-copy memory with its first `needed` bytes allocated, or None: this unit is reduced from
        ordinary memory this iteration (a rank of the shard group had no room in /dev/shm: every rank warns).
        A collective on the shard group past the kept part (ResidentSharedMemory.ensure)."""
        assert self._reduce_memory is not None, "called only where the front has zero-copy memory"
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
    def _start_gather(self, unit: Unit) -> None:
        for g in unit.groups:
            if not g.handle.allocated:
                if self._shard_ledger is not None:
                    self._shard_ledger.record(ALL_GATHER, g.handle.identity)
                with _profiling.span("shardkit::fsdp.all_gather", unit.name or "(root)"):
                    g.handle.unshard_start()
                self.collective_counts["all_gather"] += self._shard_group is not None

    def _unshard(self, unit: Unit) -> None:
        self._start_gather(unit)
        with _profiling.span("shardkit::fsdp.wait_all_gather", unit.name or "(root)"):
            for g in unit.groups:
                g.handle.unshard_wait()

    def _reshard(self, unit: Unit) -> None:
        for g in unit.groups:
            self._reshard_group(g)

    def _reshard_group(self, group: FlatGroup) -> None:
        group.handle.reshard()  # nothing where the handle holds no full buffer

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        try:
            following = order[order.index(unit) + 1]
        except (ValueError, IndexError):
            return
        if all(g.handle.allocated for g in following.groups):
            return
        if self.limit_all_gathers:
            held = sum(1 for u in self._units if not u.is_root and u is not following
                       and any(g.handle.holds_full_buffer for g in u.groups))
            if held >= 2:
                return
        self._start_gather(following)

    def _use_full_views(self, unit: Unit, training: bool) -> None:
        for g in unit.groups:
            if g.trainable and training:
                if g.training_views is None:
                    g.training_views = _differentiable_views(g, _PostBackward(self, unit, g))
                views = g.training_views
            else:
                views = g.handle.views(g.handle.full_alias())
            register_parameters(g, views)

    def _use_backward_views(self, unit: Unit) -> None:
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
                        g.recompute_views = _differentiable_views(g, then)
                views = g.recompute_views
            else:
                views = g.handle.views(g.handle.full_alias())
            register_parameters(g, views)


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


def _differentiable_views(group: FlatGroup, post_backward: Callable[[list], None]) -> tuple[torch.Tensor, ...]:
    """The group's parameters as views of its full buffer through a _FullParameterViews node of their own, whose
    backward hands their gradients to ``post_backward``."""
    leaf = group.handle.full_alias().requires_grad_(True)
    views = _FullParameterViews.apply(leaf, group.handle, post_backward)
    # A Function that returns a one-tensor tuple gives back the tensor itself.
    return (views,) if isinstance(views, torch.Tensor) else views


class _PostBackward:
    """FSDP's post-backward for one flat group, as a _FullParameterViews node calls it, holding the model weakly:
    the node is kept alive by the group's views (the model's, until the iteration ends), and a strong reference
    back would close a cycle through a C++ autograd node that Python's collector cannot follow — a model deleted
    after a forward without backward would never be freed."""

    def __init__(self, fsdp: UnitSchedule, unit: Unit, group: FlatGroup) -> None:
        self._refs = (weakref.ref(fsdp), weakref.ref(unit), weakref.ref(group))

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        fsdp_ref, unit_ref, group_ref = self._refs
        fsdp, unit, group = fsdp_ref(), unit_ref(), group_ref()
        if fsdp is None or unit is None or group is None:
            raise RuntimeError("shardkit FSDP: backward through a forward of a model that has been deleted")
        fsdp._post_backward(unit, group, grads)


class _DeferGradients:
    """The backward of a reentrant recompute's _FullParameterViews when the training views' node is still to run:
    hands the gradients to FSDP, which adds them to that node's (held weakly, as _PostBackward)."""

    def __init__(self, fsdp: UnitSchedule, group: FlatGroup) -> None:
        self._refs = (weakref.ref(fsdp), weakref.ref(group))

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        fsdp_ref, group_ref = self._refs
        fsdp, group = fsdp_ref(), group_ref()
        if fsdp is None or group is None:
            raise RuntimeError("shardkit FSDP: backward through a forward of a model that has been deleted")
        fsdp._defer_gradients(group, grads)


def _add_gradients(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]

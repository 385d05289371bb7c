"""shardkit.DistributedDataParallel: torch DDP's interface over shardkit's C++ reducer (csrc/ddp/).

Construction verifies that every rank holds the same parameters (names, shapes, dtypes) and broadcasts
parameters and buffers from rank 0. Each forward in training mode arms the reducer, whose autograd hooks
bucket the gradients, reduce them (overlapping backward) and write the averages back into ``.grad``.
Everything per parameter or per bucket during training happens in C++; this module is configuration.

The class derives from torch.nn.parallel.DistributedDataParallel without running its constructor (no torch
reducer, logger or hooks exist), so code that recognises DDP by ``isinstance`` (unwrapping ``.module``,
``no_sync``, torch.compile's DDPOptimizer) treats it as one. Every torch DDP method it does not implement is
replaced by one that raises NotImplementedError naming it (see the end of this file).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from . import _C, _agreement, _ddp_join, _flat, _profiling, _torch_compat
from . import _zero_state_dict as zero_state_dict
from ._collective_identity import compare_identities_across_hosts
from ._nested_tensors import to_device
from ._zero_copy import shared_buffer, warn_zero_copy_unavailable, zero_copy_unavailable
from .checkpoint._front_protocol import StateDictSetting
from .hooks import check_state_group
from .quantized import Quantized, check_group

_DEFAULT_BUCKET_CAP_MB = 25
_FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket so the first reduction starts early in backward


class DistributedDataParallel(_TorchDDP):
    """Data parallelism with torch DDP's arguments and semantics; see torch.nn.parallel.DistributedDataParallel.

    torch's arguments as of 2.13, with these differences: ``init_sync=False`` skips the initial check and
    broadcast, as torch's does; ``device_mesh`` (1-D) gives the group; ``check_reduction`` is ignored (torch
    deprecated it); ``batched_grad_copy`` is accepted and changes nothing (the reducer copies each gradient as
    it arrives either way). ``delay_all_reduce_named_params``/``param_to_hook_all_reduce``, ``mixed_precision``,
    ``skip_all_reduce_unused_params=True`` and ``bucket_cap_mb_list`` raise NotImplementedError. Parameters
    and buffers named in ``module._ddp_params_and_buffers_to_ignore`` are neither broadcast nor reduced.
    ``broadcast_buffers`` (deprecated by torch 2.13) and ``forward_sync_buffers`` mean what they mean in torch.

    ``join()`` (uneven inputs) works as torch's for ``zero_stage=0``: a rank whose inputs ran out matches the
    others' collectives with zero gradients, and the last rank to join broadcasts the final parameters. The
    buffers broadcast in each forward come from rank 0 (torch takes the highest rank still training).

    ``zero_stage`` (0, 1, 2) selects ZeRO partitioning of optimizer state (1) and gradients (2); both take
    ``shardkit.ZeroRedundancyOptimizer`` as the optimizer, built over this model's parameters.

    With 1 or 2 this module owns the partition, computed at construction: per dtype one flat layout
    (``shardkit._C.FlatLayout``) over the trainable parameters in ``module.named_parameters()`` order, padded
    to a multiple of the world size, rank r owning the r-th 1/N. Each of those parameters becomes a view of
    its dtype's flat buffer (``p.data`` is replaced once, here, before the reducer is built), so the
    optimizer's all-gather writes the updated parameters in place. A ``ZeroRedundancyOptimizer`` built
    later over these parameters reads this partition; its trainable parameters must come in the same order
    (``model.parameters()`` does), or it raises naming the first that differs.

    - 1: gradients are allreduced exactly as with 0 (every rank gets whole averaged ``.grad``); the optimizer
      keeps state for its 1/N slice and all-gathers the updated parameters. With a plain optimizer, 1 is 0.
    - 2: each bucket is reduced to the ranks that own its elements (one ``reduce`` per owner), each rank keeps
      only its slice of the averaged gradients, in this module's gradient shard (``gradient_shards``, allocated
      at construction), and ``.grad`` stays None. A forward and backward before the optimizer exists is fine:
      the gradients wait in the shard. They accumulate there across synchronised backwards until
      ``optimizer.zero_grad()`` (or this module's ``zero_grad()``), as ``.grad`` would; clip with
      ``optimizer.clip_grad_norm_`` (``torch.nn.utils.clip_grad_norm_`` sees no ``.grad`` here). A plain
      torch optimizer sees no gradients at all, so use ``ZeroRedundancyOptimizer`` (one per model);
      ``gradient_as_bucket_view`` does not apply and is refused.

    ``comm=shardkit.Quantized(weights=None, grads="int8")`` sends the buckets' allreduces (ZeRO-2: reduces to the
    owners) between hosts as block-quantized records (``shardkit.quantized``); inside a host they stay exact.
    ``weights`` has nothing to do without ZeRO and is refused with it (ZeRO's all-gather writes into the owners'
    master parameters, which it would round); not with a comm hook.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        zero_stage: int = 0,
        comm: Quantized | None = None,
    ) -> None:
        # torch DDP's constructor builds torch's reducer: only nn.Module's and Joinable's run here.
        nn.Module.__init__(self)
        _run_eagerly_under_torch_compile()
        Joinable.__init__(self)
        _refuse_unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                            skip_all_reduce_unused_params=skip_all_reduce_unused_params or None,
                            bucket_cap_mb_list=bucket_cap_mb_list)
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
        if comm is not None and not isinstance(comm, Quantized):
            raise TypeError(f"shardkit DDP: comm must be a shardkit.Quantized or None, got {comm!r}")
        if comm is not None and zero_stage and comm.weights is not None:
            raise ValueError(f"shardkit DDP: comm=shardkit.Quantized(weights={comm.weights!r}) with zero_stage="
                             f"{zero_stage} would round the parameters themselves: ZeRO's all-gather writes into the "
                             "owners' master copy. Use weights=None (gradients only, zero_stage=1), or "
                             "shardkit.fully_shard(..., comm=...), whose all-gathers fill a separate buffer")
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.module = module
        self.process_group = _group_of(process_group, device_mesh)
        self.device_mesh = device_mesh
        self.device_ids = self._check_devices(module, device_ids)
        self.device = next(module.parameters(), torch.empty(0)).device
        self.output_device = output_device  # type: ignore[assignment]  # as given (torch's DDP keeps an index)
        self.dim = dim
        # torch 2.13's rule: forward_sync_buffers wins; the deprecated broadcast_buffers=False also keeps the
        # buffers out of the initial broadcast.
        self.forward_sync_buffers = forward_sync_buffers if forward_sync_buffers is not None else \
            broadcast_buffers is not False
        init_sync_buffers = forward_sync_buffers is not None or broadcast_buffers is not False
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph  # accepted for torch compatibility: the reducer needs no hint
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = None
        self.zero_stage = zero_stage
        self.require_backward_grad_sync = True
        self._divide_by_initial_world_size = True  # join(): set by the join hook
        ignored = set(_torch_compat.ddp_ignored_names(module))
        self.parameters_to_ignore = ignored
        _torch_compat.present_as_torch_ddp(self)  # torch DDP attributes that torch's own helpers read

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad and name not in ignored]
        if not named:
            raise RuntimeError("shardkit DDP: the module has no parameter that requires a gradient (and is not in "
                               "_ddp_params_and_buffers_to_ignore): there is nothing to reduce")
        if init_sync:  # the first collective; with init_sync=False, as in torch, construction communicates nothing
            self._verify_same_arguments_and_parameters_everywhere(
                {"zero_stage": repr(zero_stage), "gradient_as_bucket_view": repr(gradient_as_bucket_view),
                 "bucket_cap_mb": repr(bucket_cap_mb), "find_unused_parameters": repr(find_unused_parameters),
                 "forward_sync_buffers": repr(self.forward_sync_buffers),
                 "the initial buffer broadcast": repr(init_sync_buffers),
                 "process_group": _agreement.describe_group(self.process_group),
                 "the parameters' device type": self.device.type},
                named)
        spaces = []
        if zero_stage:
            # The ZeRO partition: per dtype one FlatLayout over the trainable parameters in module order, each
            # parameter made a view of its space's flat buffer before the reducer is built (so the reducer and
            # its gradient hooks see the final storages), and the optimizer's all-gather lands in place.
            spaces = _flat.flat_spaces([p for _, p in named], dist.get_world_size(self.process_group))
            _flat.flatten_into_buffers(spaces)
        if init_sync:
            self._broadcast_from_rank0([p.detach() for n, p in module.named_parameters() if n not in ignored] +
                                       (self._synced_buffers() if init_sync_buffers else []))
        # Buckets carry their identity (csrc/core/collective_identity.h); across hosts too from here on, on every rank
        # at this same point of the group's collectives.
        compare_identities_across_hosts(self.process_group)
        # torch's rule: the small first bucket applies only when the cap is the default one.
        cap_bytes = max(1, int((bucket_cap_mb if bucket_cap_mb is not None else _DEFAULT_BUCKET_CAP_MB) * 1024 * 1024))
        self.bucket_bytes_cap = cap_bytes  # torch.compile's DDPOptimizer splits graphs at this size
        first_bytes = _FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap_bytes
        self.reducer = _C.Reducer([p for _, p in named], [name for name, _ in named], self.process_group,
                                  cap_bytes, first_bytes, find_unused_parameters, gradient_as_bucket_view,
                                  shard_gradients=zero_stage == 2,
                                  shared_buffer=self._zero_copy_buckets(gradient_as_bucket_view, zero_stage))
        self.comm = comm
        if comm is not None:  # the buckets' allreduces carry it (a sum of gradients: comm.grads)
            check_group(comm, self.process_group, "shardkit DDP")
            self.reducer.set_quantization(comm.wire())
        self._zero_partition: _flat.ZeroPartition | None = None
        if zero_stage:
            self._zero_partition = self._own_partition(named, spaces)
        # Buffers are broadcast before a forward that follows a synchronised training forward (torch's rule).
        self.require_forward_param_sync = True
        # Set by FullyShardedDataParallel.state_dict_type() (checkpoint/_front_protocol.py: a ModelFront); None:
        # nn.Module's state dicts (torch DDP's).
        self.state_dict_setting: StateDictSetting | None = None

    # --- construction ---------------------------------------------------------------------------------
    def _zero_copy_buckets(self, gradient_as_bucket_view: bool, zero_stage: int) -> Callable[[int], Any] | None:
        """Where the reducer takes its CPU buckets' memory from (``nbytes -> uint8 tensor or None``, a collective
        it calls whenever it builds buckets), or None: ordinary buckets. ``gradient_as_bucket_view=True`` is what
        asks for zero-copy buckets (docs/ddp.md), so there a ZeroCopyUnavailableWarning says why they cannot be had: the
        group's backend is not shardkit's, the group spans hosts (warned here, once), no room in /dev/shm (warned by
        shardkit.backend.shared_buffer at each refusal). Nothing is asked nor said for CUDA modules (the memory
        is the host's) or zero_stage=2 (which refuses the flag)."""
        if not gradient_as_bucket_view or zero_stage == 2 or self.device.type != "cpu":
            return None
        who, what = "shardkit DDP", "the gradient buckets gradient_as_bucket_view=True asked for"
        why = zero_copy_unavailable(self.process_group)
        if why is not None:
            warn_zero_copy_unavailable(who, what, why, stacklevel=2)  # attributed to the DDP's constructor call
            return None
        return functools.partial(shared_buffer, group=self.process_group, who=who, what=what)

    @staticmethod
    def _check_devices(module: nn.Module, device_ids):
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError("shardkit DDP drives one device per process; the module's parameters are on "
                             f"{sorted(map(str, devices))}")
        device = next(iter(devices), torch.device("cpu"))
        if device.type == "cpu":
            if device_ids is not None:
                raise ValueError(f"device_ids must be None for a CPU module, got {device_ids!r}")
            return None
        given = None if device_ids is None else [
            torch.device(device.type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
        if given is not None and given != [device]:
            raise ValueError(f"device_ids must be [the module's device] ({device}), got {device_ids!r}")
        return [device]

    def _verify_same_arguments_and_parameters_everywhere(self, arguments: dict[str, str],
                                                         named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Construction's first collective: every rank's communication arguments (printable values: they decide
        the buckets and which collectives reduce them) and its parameters (names, shapes, dtypes) go to every rank
        in one exchange (shardkit._agreement). Raises on every rank, naming the ranks and values, where any differ:
        ranks that went on would pair different collectives."""
        mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named]
        me = dist.get_rank()
        everyone = _agreement.gather((arguments, mine), _agreement.exchange_groups([self.process_group]))
        problems = _agreement.disagreements({rank: theirs[0] for rank, theirs in everyone.items()})
        if problems:
            raise RuntimeError(f"shardkit DDP (rank {me}): {'; '.join(problems)}; pass the same arguments on every "
                               "rank")
        for other_rank, (_, theirs) in sorted(everyone.items()):
            if theirs == mine:
                continue
            for position in range(max(len(mine), len(theirs))):
                a = mine[position] if position < len(mine) else None
                b = theirs[position] if position < len(theirs) else None
                if a != b:
                    raise RuntimeError(
                        f"shardkit DDP (rank {me}): parameters differ across ranks at position {position}: "
                        f"rank {me} has {_describe(a)} but rank {other_rank} has {_describe(b)}")

    def _verify_same_comm_hook_everywhere(self, hook: str) -> None:
        """A collective at registration (every rank registers its hook at the same point, as torch requires): ranks
        whose buckets a different hook reduces would pair different collectives, so where ``hook`` (the hook's
        printable name) differs every rank raises naming the ranks and hooks. A rank that registers none while the
        others do cannot be told here: its next collective meets their exchange, and the backend's own check of
        the op fails (on shardkit's backend, naming both ops)."""
        everyone = _agreement.gather({"the comm hook": hook}, _agreement.exchange_groups([self.process_group]))
        problems = _agreement.disagreements(everyone)
        if problems:
            raise RuntimeError(f"shardkit DDP (rank {dist.get_rank()}) register_comm_hook: {'; '.join(problems)}; "
                               "register the same hook on every rank")

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        if tensors:
            _torch_compat.broadcast_coalesced(self.process_group, tensors, src)

    def _synced_buffers(self) -> list[torch.Tensor]:
        return [b.detach() for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @property
    def broadcast_buffers(self) -> bool:
        """torch's deprecated name for ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # --- training -------------------------------------------------------------------------------------
    # torch.compile: __call__ and forward run eagerly (their frames are marked for dynamo to skip, see the end
    # of this file: the reducer and the collectives are C++ that dynamo cannot trace), while the wrapped module,
    # called from them, is compiled whole; torch's DDPOptimizer then splits its graph at bucket_bytes_cap
    # because this module is the active DDP module meanwhile. No graph break is left: torch DDP's own forward
    # is traced and breaks three times before it reaches the module.
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """nn.Module.__call__; without module hooks (or DistributedDataParallel.compile()) straight to forward."""
        if not _torch_compat.call_runs_forward_only(self):
            return nn.Module.__call__(self, *inputs, **kwargs)
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs, outer = self._before_forward(inputs, kwargs)
        try:
            return self.module(*inputs, **kwargs)
        finally:
            self._after_forward(outer)

    @_torch_compat.eager_under_compile  # everything it calls runs eagerly under torch.compile
    def _before_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, tuple[Any, Any]]:
        """Opens the forward's profiler span, runs the forward's collectives and makes this the active DDP module
        (torch's _inside_ddp_forward, which torch.compile's DDPOptimizer reads). Returns the inputs moved to this
        module's device and what _after_forward restores."""
        span = _profiling.span("shardkit::ddp.forward")
        span.__enter__()
        try:
            if self.device_ids:
                inputs, kwargs = to_device((inputs, kwargs), self.device_ids[0], non_blocking=True)
            self._prepare_forward()
        except BaseException:
            span.__exit__(None, None, None)
            raise
        outer = _torch_compat.active_ddp_module()  # a DDP nested in another restores the outer one afterwards
        _torch_compat.set_active_ddp_module(self)
        return inputs, kwargs, (span, outer)

    @staticmethod
    @_torch_compat.eager_under_compile
    def _after_forward(outer: tuple[Any, Any]) -> None:
        span, outer_ddp = outer
        _torch_compat.set_active_ddp_module(outer_ddp)
        span.__exit__(None, None, None)

    def _prepare_forward(self) -> None:
        """The collectives of a forward, in the order the join hook (_ddp_join.ShardkitJoinHook.main_hook) matches them
        on ranks whose inputs ran out: the join notification, the buffer broadcast, whether backward syncs;
        then the reducer's preparation (on the second iteration its bucket rebuild broadcasts)."""
        joined_count = Join.notify_join_context(self)  # None unless inside join() (torch's Join protocol)
        if self.forward_sync_buffers and self.require_forward_param_sync:
            self._broadcast_from_rank0(self._synced_buffers())
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if _torch_compat.join_enabled(self):
            _ddp_join.agree_on_backward_sync(self.process_group, self.device, synced)
        if synced:
            self.reducer.prepare_for_backward()
            if joined_count is not None and not self._divide_by_initial_world_size:
                joined_count.wait()
                self.reducer.set_divisor_for_this_backward(float(joined_count.result()[0].item()))
        self.require_forward_param_sync = synced

    # --- uneven inputs (torch.distributed.algorithms.join) ---------------------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's ``join()``: a context manager for training with a different number of inputs per rank.
        Ranks that run out keep matching the others' collectives (with zero gradients) until all are done;
        with ``divide_by_initial_world_size=False`` the average is over the ranks still training."""
        _ddp_join.check_joinable(self.zero_stage)
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The Joinable protocol's hook (``divide_by_initial_world_size``, default True, as torch's)."""
        _ddp_join.check_joinable(self.zero_stage)
        return _ddp_join.ShardkitJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._synced_buffers())

    def _set_static_graph(self) -> None:
        """torch DDP's private switch some trainers call; the shardkit reducer needs no static-graph hint."""
        self.static_graph = True

    def train(self, mode: bool = True) -> DistributedDataParallel:
        return nn.Module.train(self, mode)

    def __getattr__(self, name: str) -> Any:
        if name in _UNSUPPORTED_PROPERTIES:
            raise AttributeError(f"shardkit DDP does not implement torch DDP's {name}")
        return super().__getattr__(name)

    def __getstate__(self):
        raise TypeError("shardkit DDP holds a C++ reducer bound to a process group and cannot be pickled or "
                        "deep-copied; save .module or state_dict() instead")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after it synchronises."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def bucket_layout(self) -> list[list[int]]:
        """Parameter indices per gradient bucket, in launch order (after the second iteration: the rebuilt one)."""
        return self.reducer.bucket_indices()

    def load_bucket_layout(self, layout: list[list[int]]) -> None:
        """Adopts a bucket_layout() saved with a checkpoint, for good (no rebuild follows). A collective where the
        buckets are zero-copy (every rank calls it at the same point, as they load the same checkpoint). Needed for a
        bit-identical resume when a comm hook keeps state per bucket (PowerSGD's error feedback, P and Q):
        without it the first iteration after a restart reduces in the initial, one-bucket layout."""
        self.reducer.load_bucket_indices([list(map(int, bucket)) for bucket in layout])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module.zero_grad; with zero_stage=2 it also clears the gradient shards."""
        super().zero_grad(set_to_none)
        if self.zero_stage == 2:
            self.reducer.clear_gradient_shards(set_to_none)

    def _own_partition(self, named: Sequence[tuple[str, torch.Tensor]],
                       spaces: list[_flat.FlatSpace]) -> _flat.ZeroPartition:
        """zero_stage 1|2: the partition this DDP owns. Under 2 it allocates this rank's gradient shard of each
        space and installs them in the reducer now, so a backward before any optimizer exists lands there."""
        reducer_index = {id(p): i for i, (_, p) in enumerate(named)}
        partition = _flat.ZeroPartition(self.zero_stage, self.process_group, spaces,
                                        {id(p): name for name, p in named}, self.reducer, reducer_index)
        if self.zero_stage == 2:
            place: dict[int, tuple[int, int]] = {}  # id(param) -> (space, slot in its layout)
            for s, space in enumerate(spaces):
                space.grad_shard = torch.zeros(space.shard_numel, dtype=space.dtype, device=space.device)
                place.update({id(p): (s, k) for k, p in enumerate(space.params)})
            self.reducer.set_gradient_shards([space.layout for space in spaces],
                                             [space.grad_shard for space in spaces],
                                             [place[id(p)][0] for _, p in named], [place[id(p)][1] for _, p in named])
        partition.mark_parameters()
        return partition

    # --- checkpoints (shardkit/_zero_state_dict.py) --------------------------------------------------------
    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False):
        """nn.Module's (keys prefixed ``module.``, as torch DDP's); inside
        ``FullyShardedDataParallel.state_dict_type(self, ...)`` the full or sharded one it names, the same keys."""
        if self.state_dict_setting is None:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if args:
            raise TypeError("state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        state = zero_state_dict.model_state_dict(self, self.state_dict_setting, prefix)
        if destination is not None:
            destination.update(state)
            return destination
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """nn.Module's; inside ``FullyShardedDataParallel.state_dict_type(self, ...)`` it also takes a sharded
        state dict of any world size (loaded through torch.distributed.checkpoint), then a collective."""
        if self.state_dict_setting is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise NotImplementedError("shardkit DDP: load_state_dict(assign=True) inside state_dict_type() is not "
                                      "supported; the parameters are loaded by copy")
        return zero_state_dict.load_model_state_dict(self, self.state_dict_setting, state_dict, strict)

    # checkpoint/_front_protocol.py's ModelFront: a plain torch optimizer over this model (whole state on every rank).
    def name_keyed_optim_state_dict(self, optim: torch.optim.Optimizer) -> dict[str, Any]:
        return zero_state_dict.plain_optim_state_dict(self, optim)

    def name_keyed_optim_state_dict_to_load(self, optim: torch.optim.Optimizer,
                                            optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        return zero_state_dict.plain_optim_state_dict_to_load(self, optim, optim_state_dict)

    @property
    def gradient_shards(self) -> list[torch.Tensor]:
        """zero_stage=2: this rank's flat gradient shard of each dtype (empty otherwise)."""
        if self._zero_partition is None:
            return []
        return [space.grad_shard for space in self._zero_partition.spaces if space.grad_shard is not None]

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future]) -> None:
        """torch DDP's comm-hook API: ``hook(state, bucket) -> Future[Tensor]`` replaces the allreduce of each
        bucket (``bucket`` is a torch.distributed.GradBucket). The hook must do its own averaging."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        check_state_group(state, self.process_group, "shardkit DDP register_comm_hook")
        if self.comm is not None:
            raise ValueError("shardkit DDP register_comm_hook: this DDP was built with comm=shardkit.Quantized(...), "
                             "which quantizes the buckets' own allreduces; a comm hook replaces them. Use one or the "
                             "other")
        self._verify_same_comm_hook_everywhere(f"{_qualified_name(hook)} (state: {type(state).__name__})")
        self.reducer.register_comm_hook(state, hook)


def _group_of(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup:
    if device_mesh is None:
        return process_group if process_group is not None else _torch_compat.default_group()
    if process_group is not None:
        raise ValueError("shardkit DDP: pass process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise ValueError(f"shardkit DDP: only a 1-D device_mesh is supported, got {device_mesh.ndim} dimensions "
                         f"({device_mesh})")
    return device_mesh.get_group(mesh_dim=0)


def _refuse_unsupported(**arguments: Any) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(f"shardkit DDP does not support torch DDP's {name} (got {value!r})")


def _qualified_name(function: Any) -> str:
    """'module.qualname' of a function (a functools.partial by its function), else its repr."""
    function = getattr(function, "func", function)
    name = getattr(function, "__qualname__", None)
    return f"{getattr(function, '__module__', '?')}.{name}" if name else repr(function)


def _describe(entry) -> str:
    if entry is None:
        return "no parameter there"
    name, shape, dtype = entry
    return f"{name} of shape {list(shape)} ({dtype})"


_UNSUPPORTED_PROPERTIES: set[str] = set()


@functools.cache
def _run_eagerly_under_torch_compile() -> None:
    """Marks __call__'s and forward's frames for dynamo to skip (frames they call are still compiled). Done at
    the first construction, without importing torch._dynamo (it costs seconds; _torch_compat.skip_frames)."""
    _torch_compat.skip_frames(DistributedDataParallel.__call__.__code__)
    _torch_compat.skip_frames(DistributedDataParallel.forward.__code__)

# torch DDP's methods that shardkit DDP does not implement: each would reach for torch's reducer, logger or
# hooks, which do not exist here. They raise naming themselves instead of an AttributeError from deep inside
# torch; properties raise an AttributeError with that message (so hasattr() stays False).
_TORCH_DDP_KEPT = {
    "_get_active_ddp_module", "_inside_ddp_forward",  # torch.compile's DDPOptimizer: this module is a DDP
    "scatter", "to_kwargs", "gather", "_get_data_parallel_params", "_set_params_and_buffers_to_ignore_for_model",
}


def _unsupported_method(name: str) -> Callable[..., Any]:
    def unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"shardkit DDP does not implement torch DDP's {name}()")
    unsupported.__name__ = name
    return unsupported


def _unsupported_property(name: str) -> property:
    def unsupported(self) -> Any:
        raise AttributeError(name)  # nn.Module.__getattr__ runs next: DistributedDataParallel.__getattr__ names it
    _UNSUPPORTED_PROPERTIES.add(name)
    return property(unsupported)


for _name, _value in vars(_TorchDDP).items():
    if _name in vars(DistributedDataParallel) or _name in _TORCH_DDP_KEPT:
        continue
    if _name.startswith("__") and _name != "__setstate__":
        continue
    if isinstance(_value, property):
        setattr(DistributedDataParallel, _name, _unsupported_property(_name))
    elif callable(_value) or isinstance(_value, (staticmethod, classmethod)):
        setattr(DistributedDataParallel, _name, _unsupported_method(_name))
del _name, _value

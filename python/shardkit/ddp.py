"""shardkit.DistributedDataParallel: torch DDP's interface over shardkit's C++ reducer (csrc/ddp/).

Construction verifies that every rank holds the same parameters (names, shapes, dtypes) and broadcasts
parameters and buffers from rank 0. Each forward in training mode arms the reducer, whose autograd hooks
bucket the gradients, reduce them (overlapping backward) and write the averages back into ``.grad``.
Everything per parameter or per bucket during training happens in C++; this module is configuration.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import _C, _exchange, _flat, zero_state_dict
from .fsdp_state_dict import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from .hooks import check_state_group

_DEFAULT_BUCKET_CAP_MB = 25
_FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket so the first reduction starts early in backward
_BROADCAST_BUCKET_BYTES = 250 << 20


class DistributedDataParallel(nn.Module):
    """Data parallelism with torch DDP's arguments and semantics; see torch.nn.parallel.DistributedDataParallel.

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
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        zero_stage: int = 0,
    ) -> None:
        super().__init__()
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.device_ids = self._check_devices(module, device_ids)
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph  # accepted for torch compatibility: the reducer needs no hint
        self.zero_stage = zero_stage
        self.require_backward_grad_sync = True

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._verify_same_parameters_everywhere(named)
        spaces = []
        if zero_stage:
            # The ZeRO partition: per dtype one FlatLayout over the trainable parameters in module order, each
            # parameter made a view of its space's flat buffer before the reducer is built (so the reducer and
            # its gradient hooks see the final storages), and the optimizer's all-gather lands in place.
            spaces = _flat.flat_spaces([p for _, p in named], dist.get_world_size(self.process_group))
            _flat.flatten_into_buffers(spaces)
        self._broadcast_from_rank0([p.detach() for _, p in module.named_parameters()] +
                                   [b.detach() for b in module.buffers()])
        # torch's rule: the small first bucket applies only when the cap is the default one.
        cap_bytes = max(1, int((bucket_cap_mb if bucket_cap_mb is not None else _DEFAULT_BUCKET_CAP_MB) * 1024 * 1024))
        first_bytes = _FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap_bytes
        self.reducer = _C.Reducer([p for _, p in named], [name for name, _ in named], self.process_group,
                                  cap_bytes, first_bytes, find_unused_parameters, gradient_as_bucket_view,
                                  shard_gradients=zero_stage == 2)
        self._zero_partition: _flat.ZeroPartition | None = None
        if zero_stage:
            self._zero_partition = self._own_partition(named, spaces)
        # Buffers are broadcast before a forward that follows a synchronised training forward (torch's rule).
        self.require_forward_param_sync = True
        # Set by FullyShardedDataParallel.state_dict_type(); None: nn.Module's state dicts (torch DDP's).
        self._state_dict_type: StateDictType | None = None
        self._state_dict_config: FullStateDictConfig | ShardedStateDictConfig | None = None

    # --- construction ---------------------------------------------------------------------------------
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

    def _verify_same_parameters_everywhere(self, named: list[tuple[str, torch.Tensor]]) -> None:
        mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named]
        everyone = _exchange.all_gather_object(mine, self.process_group)
        rank = dist.get_rank(self.process_group)
        for other_rank, theirs in enumerate(everyone):
            if theirs == mine:
                continue
            for position in range(max(len(mine), len(theirs))):
                a = mine[position] if position < len(mine) else None
                b = theirs[position] if position < len(theirs) else None
                if a != b:
                    raise RuntimeError(
                        f"shardkit DDP (rank {rank}): parameters differ across ranks at position {position}: "
                        f"rank {rank} has {_describe(a)} but rank {other_rank} has {_describe(b)}")

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            dist._broadcast_coalesced(self.process_group, tensors, _BROADCAST_BUCKET_BYTES, 0)

    # --- training -------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), self.device_ids[0])
        if self.broadcast_buffers and self.require_forward_param_sync:
            self._broadcast_from_rank0([b.detach() for b in self.module.buffers()])
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synced:
            self.reducer.prepare_for_backward()
        self.require_forward_param_sync = synced
        return self.module(*inputs, **kwargs)

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
        """Adopts a bucket_layout() saved with a checkpoint, for good (no rebuild follows). Needed for a
        bit-identical resume when a comm hook keeps state per bucket (PowerSGD's error feedback, P and Q):
        without it the first iteration after a restart reduces in the initial, one-bucket layout."""
        self.reducer.load_bucket_indices([list(map(int, bucket)) for bucket in layout])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module.zero_grad; with zero_stage=2 it also clears the gradient shards."""
        super().zero_grad(set_to_none)
        if self.zero_stage == 2:
            self.reducer.clear_gradient_shards(set_to_none)

    def _own_partition(self, named: list[tuple[str, torch.Tensor]],
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

    # --- checkpoints (shardkit.zero_state_dict) --------------------------------------------------------
    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False):
        """nn.Module's (keys prefixed ``module.``, as torch DDP's); inside
        ``FullyShardedDataParallel.state_dict_type(self, ...)`` the full or sharded one it names, the same keys."""
        if self._state_dict_type is None:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if args:
            raise TypeError("state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        state = zero_state_dict.model_state_dict(self, self._state_dict_type, self._state_dict_config, prefix)
        if destination is not None:
            destination.update(state)
            return destination
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """nn.Module's; inside ``FullyShardedDataParallel.state_dict_type(self, ...)`` it also takes a sharded
        state dict of any world size (loaded through torch.distributed.checkpoint), then a collective."""
        if self._state_dict_type is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise NotImplementedError("shardkit DDP: load_state_dict(assign=True) inside state_dict_type() is not "
                                      "supported; the parameters are loaded by copy")
        return zero_state_dict.load_model_state_dict(self, self._state_dict_type, state_dict, strict)

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
        self.reducer.register_comm_hook(state, hook)


def _describe(entry) -> str:
    if entry is None:
        return "no parameter there"
    name, shape, dtype = entry
    return f"{name} of shape {list(shape)} ({dtype})"


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj

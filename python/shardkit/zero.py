"""shardkit.ZeroRedundancyOptimizer: optimizer state (ZeRO-1) and gradients (ZeRO-2) sharded across ranks.

torch's constructor (``ZeroRedundancyOptimizer(params, optimizer_class, process_group=None, **defaults)``)
and methods, DeepSpeed's partitioning. ZeRO-1 (a plain model or DDP, or shardkit's with zero_stage 0/1):
gradients are allreduced as usual; each rank then steps the optimizer only for its slice of the parameters,
and the updated slices are all-gathered. ZeRO-2 (over a ``shardkit.DistributedDataParallel(zero_stage=2)``
model): the DDP's reducer reduces each bucket straight into the owners' gradient shards (S elements per dtype,
allocated by the DDP); ``.grad`` stays None and the pieces step from their views of the shard.

Partitioning (DeepSpeed's flat layout, not torch's whole-parameter assignment) is ``_C.FlatLayout``'s, the
one flat layout of shardkit (csrc/core/flat_layout.h), with alignment 1::

    trainable params of one dtype, all groups, in order:   | a a a a a | b b b | c c c c c c c |pad|
    flat index space, padded to a multiple of N:            0                                 N*S
    rank r owns [r*S, (r+1)*S), S = ceil(numel / N):       |  rank 0  |  rank 1  |  rank 2  |

Who owns it: a shardkit DDP with zero_stage 1|2 computes the partition at construction (its trainable
parameters in module order) and owns it; the optimizer built over that model's parameters reads it (found
through a weak reference the DDP leaves on its parameters, see _flat.py), so the optimizer may be built at
any time, after a forward and backward too. It finds each of its parameters in the partition by identity, so
its param groups may order and interleave them as they like (the index in state_dict() is the optimizer's
own numbering, as the unsharded optimizer's). Over any other parameters (a plain model, torch's DDP) the
optimizer lays out its own partition the same way.

The local optimizer (``self.optim``) sees one leaf Parameter per (parameter, rank) overlap, a view of the
model's parameter itself (no copy of the parameters is kept) -- a parameter that lies inside the slice keeps
its shape, one that straddles a slice boundary is split into 1-D pieces. So the optimizer state is exactly the
owned elements (1/N of the unsharded state; the padding holds no state), and every piece keeps the
unsharded optimizer's per-parameter semantics: a parameter whose ``.grad`` is None is skipped (no weight
decay, no momentum, no state, no step count), and its step count stays its own.

step():
  1. point each piece's ``.grad`` at the owned part of ``param.grad`` (a view, no copy), or under ZeRO-2 at
     its view of the gradient shard (None if the reducer left that parameter without a gradient);
  2. ``self.optim.step()`` updates the owned parts of the parameters in place;
  3. one all-gather (``all_gather_into_tensor``) per dtype brings every rank's updated slice to all ranks
     (``_flat.all_gather_parameters``). Under a shardkit DDP with zero_stage 1|2 the parameters are views of
     the DDP's flat buffer of the dtype, so the step has updated this rank's slice of that buffer in place and
     the all-gather runs in place too (input: the slice; output: the buffer): no pack, no copy. Otherwise
     the pieces are packed into a transient shard, gathered into a transient flat buffer and copied into the
     parameters.
Parameters must keep their storage (``p.data = ...`` would detach them from the pieces and from the DDP's
flat buffer); in-place updates such as ``model.load_state_dict`` or DDP's broadcast are seen as they are.

Exactness: optimizers that update each element from that element's own gradient and state (SGD with
momentum/nesterov/weight decay, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, ASGD,
Rprop -- ``ELEMENTWISE_OPTIMIZERS``) give the unsharded optimizer's results. Optimizers that use
whole-parameter or whole-model statistics (LAMB's trust ratio, Adafactor's factored moments, Muon's
orthogonalisation, LBFGS, clipping by global norm inside the optimizer) would see split parameters and only
this rank's share; any other ``optimizer_class`` is accepted with a warning naming it. Clipping by the
global norm *before* ``step()`` (``clip_grad_norm_(model.parameters(), ...)``) is exact: under DDP every
rank holds the full averaged gradients.

Checkpoints: ``consolidate_state_dict(to)`` gathers the shards to rank ``to``, which then returns from
``state_dict()`` exactly what ``optimizer_class(params, **defaults).state_dict()`` would (per-parameter
state keyed by index, ``param_groups`` with ``params`` indices); ``load_state_dict()`` takes such a dict on
every rank (from this class, from the unsharded optimizer, at any world size) and keeps this rank's slice.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from . import _exchange, _flat, _profiling, _torch_compat
from . import _zero_state_dict as zero_state_dict
from ._zero_state_dict import LOCAL_PIECES_KEY
from .optim import OffloadedAdam, OffloadedAdamW

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ZeroRedundancyOptimizer"]

# Optimizers whose update of an element depends only on that element's gradient and state plus
# per-parameter scalars (step count, lr): sharding is exact for them. Checked against the unsharded
# optimizer in tests/python/test_zero.py.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                                            "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, name)) + (OffloadedAdam, OffloadedAdamW)

_warned_classes: set[type] = set()
_GROUP_ONLY_KEYS = ("params", "param_names")


@dataclasses.dataclass(eq=False)
class _Piece:
    """The part of one parameter that this rank owns (a FlatLayout piece), and the local optimizer's leaf for it."""

    param: torch.Tensor  # the model's parameter
    index: int  # its index in the unsharded optimizer's numbering (over all groups, frozen params included)
    group: int  # its param group
    start: int  # first owned element of the flattened parameter (the piece's param_begin)
    numel: int
    shard_begin: int  # first element in this rank's shard of the flat space
    leaf: nn.Parameter  # a view of the parameter's owned elements: its shape if whole, else 1-D
    grad_view: torch.Tensor | None = None  # ZeRO-2: the same elements of the space's gradient shard
    ddp_index: int = -1  # ZeRO-2: the parameter's index in the DDP reducer

    @property
    def whole(self) -> bool:
        return self.numel == self.param.numel()


class ZeroRedundancyOptimizer(Optimizer):
    """ZeRO-1: wraps ``optimizer_class`` and keeps its state only for this rank's 1/N of the parameters.

    Arguments follow torch.distributed.optim.ZeroRedundancyOptimizer: ``params`` (tensors, named tensors or
    param-group dicts), ``optimizer_class`` (e.g. torch.optim.AdamW), ``process_group`` (default: WORLD),
    ``**defaults`` forwarded to ``optimizer_class``. torch's ``parameters_as_bucket_view`` and
    ``overlap_with_ddp`` are not offered. Every rank must construct it with the same parameters (checked).

    The partition is fixed at construction: parameters that are frozen then (requires_grad=False) are never
    stepped, and ``add_param_group`` afterwards raises. ``self.optim`` is the local optimizer (torch's name).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer],
                 process_group: dist.ProcessGroup | None = None, **defaults: Any) -> None:
        self._initialized = False
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        super().__init__(params, defaults)  # param groups as the unsharded optimizer would hold them
        self.process_group = process_group if process_group is not None else _torch_compat.default_group()
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.optimizer_class = optimizer_class
        _warn_if_not_elementwise(optimizer_class)

        all_params = [p for group in self.param_groups for p in group["params"]]
        if len({id(p) for p in all_params}) != len(all_params):
            raise ValueError("ZeroRedundancyOptimizer: a parameter appears more than once in params; "
                             "each parameter may be given once")
        trainable = [p for p in all_params if p.requires_grad]
        devices = {p.device for p in trainable}
        if len(devices) > 1:
            raise ValueError(f"ZeroRedundancyOptimizer shards parameters of one device per process; "
                             f"got parameters on {sorted(map(str, devices))}")
        self._verify_same_parameters_everywhere()

        self._ddp_partition = self._partition_of_ddp(trainable)
        if self._ddp_partition is not None:
            self._spaces = self._ddp_partition.spaces
        else:
            self._spaces = _flat.flat_spaces(trainable, self.world_size)
        self._pieces = self._make_pieces()
        groups = [{**_options(group), "params": [piece.leaf for piece in self._pieces if piece.group == g]}
                  for g, group in enumerate(self.param_groups)]
        self.optim: Optimizer = optimizer_class(groups, **defaults)
        # The outer groups and defaults carry every option of optimizer_class, so state_dict() has the
        # unsharded optimizer's param_groups (betas, eps, foreach, ... included).
        self.defaults = dict(self.optim.defaults)
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in inner.items():
                if key not in _GROUP_ONLY_KEYS:
                    outer.setdefault(key, value)
        self._consolidated: dict[int, dict[str, Any]] | None = None  # per-parameter state, on rank `to`
        self._consolidated_to: int | None = None
        # Whether any rank may hold optimizer state (a step, or a load of a non-empty state): the same on every
        # rank. Until then state_dict() needs no consolidation, as libraries that call it right after
        # construction (accelerate's prepare) expect.
        self._may_hold_state = False
        if self._ddp_partition is not None and self._ddp_partition.stage == 2:
            self._ddp_partition.optimizer = weakref.ref(self)
        self._initialized = True

    def _partition_of_ddp(self, trainable: list[torch.Tensor]) -> _flat.ZeroPartition | None:
        """The partition of the shardkit DDP (zero_stage 1|2) that owns these parameters, checked against
        them; None for parameters of a plain model or torch's DDP (the optimizer then lays out its own).

        zero_stage=2 needs exactly the DDP's trainable parameters on the DDP's process group (the reducer
        writes their gradients into the DDP's shards, nowhere else) and one live optimizer per model.
        zero_stage=1 falls back to the optimizer's own partition when the parameters or the group differ
        (the all-gather then copies into the parameters instead of landing in place). The optimizer's order
        and groups are its own: each parameter is found in the partition by identity, and its index in the
        optimizer's numbering (state_dict's) is where the caller put it, so groups may interleave the model's
        order (transformers' weight-decay / no-decay groups do)."""
        partitions = _flat.partitions_of(trainable)
        if not partitions:
            return None
        if len(partitions) > 1:
            raise ValueError(f"ZeroRedundancyOptimizer (rank {self.rank}): the parameters belong to more than one "
                             "zero_stage=1|2 DistributedDataParallel; build one optimizer per model")
        partition = partitions[0]
        stage = partition.stage
        mine = dist.get_process_group_ranks(partition.process_group)
        theirs = dist.get_process_group_ranks(self.process_group)
        if mine != theirs:
            if stage == 1:
                return None
            raise ValueError(f"ZeroRedundancyOptimizer (rank {self.rank}): zero_stage=2 needs the optimizer on the "
                             f"DDP model's process group (ranks {mine}), got one over ranks {theirs}")
        held = {id(p) for space in partition.spaces for p in space.params}
        given = {id(p) for p in trainable}
        if held != given:
            if stage == 1:
                return None
            missing = [partition.names[i] for i in partition.names if i not in given]
            foreign = len(given - held)
            raise ValueError(f"ZeroRedundancyOptimizer (rank {self.rank}): with zero_stage=2 the optimizer must hold "
                             f"exactly the DDP model's trainable parameters; missing: {missing or 'none'}, "
                             f"{foreign} not the model's")
        if stage == 2:
            attached = partition.optimizer() if partition.optimizer is not None else None
            if attached is not None:
                raise RuntimeError(f"ZeroRedundancyOptimizer (rank {self.rank}): zero_stage=2: a "
                                   "ZeroRedundancyOptimizer is already attached to this model's gradient shards; "
                                   "build one optimizer per model")
        return partition

    @property
    def gradient_shards(self) -> list[torch.Tensor]:
        """ZeRO-2: this rank's flat gradient shard of each dtype, the DDP's (empty under ZeRO-1, where grads are
        ``.grad``)."""
        return [space.grad_shard for space in self._spaces if space.grad_shard is not None]

    @property
    def _zero2(self) -> _flat.ZeroPartition | None:
        partition = self._ddp_partition
        return partition if partition is not None and partition.stage == 2 else None

    # --- partition ------------------------------------------------------------------------------------
    def _make_pieces(self) -> list[_Piece]:
        """This rank's pieces of every space (the layout's), each with a leaf viewing the parameter, in index
        order (the unsharded optimizer's numbering)."""
        numbering: dict[int, tuple[int, int]] = {}  # id(param) -> (index, group)
        index = 0
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                numbering[id(p)] = (index, g)
                index += 1
        zero2 = self._zero2
        pieces: list[_Piece] = []
        self._space_pieces: list[list[_Piece]] = []  # per space, in flat order (the order of this rank's shard)
        for space in self._spaces:
            self._space_pieces.append([])
            for flat_piece in space.layout.pieces_of_rank(self.rank):
                p = space.params[flat_piece.param]
                begin, numel = flat_piece.param_begin, flat_piece.numel
                whole = numel == p.numel()
                view = p.detach() if whole else p.detach().view(-1)[begin:begin + numel]
                piece = _Piece(p, *numbering[id(p)], begin, numel, flat_piece.shard_begin,
                               nn.Parameter(view, requires_grad=True))
                if zero2 is not None:
                    assert space.grad_shard is not None, "a ZeRO-2 partition allocates every space's gradient shard"
                    piece.grad_view = space.grad_shard[piece.shard_begin:piece.shard_begin + numel].view(view.shape)
                    piece.ddp_index = zero2.reducer_index[id(p)]
                pieces.append(piece)
                self._space_pieces[-1].append(piece)
        pieces.sort(key=lambda piece: piece.index)
        return pieces

    def _verify_same_parameters_everywhere(self) -> None:
        mine = [[(tuple(p.shape), str(p.dtype), p.requires_grad) for p in group["params"]]
                for group in self.param_groups]
        everyone = _exchange.all_gather_object(mine, self.process_group)
        for other, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(f"ZeroRedundancyOptimizer (rank {self.rank}): ranks were given different "
                                   f"parameters: {_first_difference(mine, theirs, self.rank, other)}")

    # --- training -------------------------------------------------------------------------------------
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's GradScaler hands itself to ``step`` (instead of unscaling ``.grad`` and asserting that it saw
        some) when this is True: under ZeRO-2, so that ``step`` can refuse it by name (see ``step``)."""
        return self._zero2 is not None

    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """Steps this rank's slice, then all-gathers the updated parameters (a collective: call on every rank).

        ``closure`` is called once, before the step (as SGD/Adam do); the returned loss is passed through.
        ``grad_scaler``: passed by ``torch.amp.GradScaler.step`` under ZeRO-2 only, and refused there: fp16 loss
        scaling would have to unscale, check and agree on the gradient shards, which GradScaler cannot see (its
        ``unscale_`` reads ``.grad``, None under ZeRO-2). Not built; ZeRO-1 and bf16 need no such support.
        """
        if grad_scaler is not None:
            raise NotImplementedError(
                f"ZeroRedundancyOptimizer (rank {self.rank}): zero_stage=2 with torch.amp.GradScaler (fp16 loss "
                "scaling) is not supported: the gradients live in the shards (optimizer.gradient_shards), which "
                "GradScaler cannot unscale or check; use bf16 without a scaler, or zero_stage=1")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = None  # a consolidated state is stale once the optimizer has stepped
        self._may_hold_state = True
        with torch.no_grad(), _profiling.span("shardkit::zero.step"):
            self._sync_options()
            for piece, grad in zip(self._pieces, self._owned_grads()):
                piece.leaf.grad = grad
            try:
                self.optim.step()
            finally:
                for piece in self._pieces:
                    piece.leaf.grad = None
            with _profiling.span("shardkit::zero.all_gather"):
                _flat.all_gather_parameters(self._spaces, self.process_group)
        return loss

    def _owned_grads(self) -> list[torch.Tensor | None]:
        """Per piece, its gradient with the leaf's shape: a view of ``param.grad`` (ZeRO-1) or of the gradient
        shard (ZeRO-2); None where the parameter has no gradient."""
        if self._zero2 is not None:
            defined = self._zero2.reducer.shard_gradient_defined()
            return [piece.grad_view if defined[piece.ddp_index] else None for piece in self._pieces]
        grads = []
        for piece in self._pieces:
            grad = piece.param.grad
            if grad is not None and grad.is_sparse:
                raise RuntimeError(f"ZeroRedundancyOptimizer (rank {self.rank}): parameter {piece.index} "
                                   "has a sparse gradient; only dense gradients can be sharded")
            grads.append(grad if grad is None or piece.whole else
                         grad.reshape(-1)[piece.start:piece.start + piece.numel])
        return grads

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Optimizer.zero_grad on the model's parameters; under ZeRO-2 it also clears the gradient shards."""
        super().zero_grad(set_to_none)
        if self._zero2 is not None:
            self._zero2.reducer.clear_gradient_shards(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every parameter this optimizer steps, computed from the shards
        (a collective: call on every rank). Returns the total norm; scales the gradients by
        ``max_norm / (total + 1e-6)`` when that is below 1. Under ZeRO-1 the whole ``.grad`` tensors are
        scaled (every rank holds them); under ZeRO-2 the gradient shards."""
        norm_type = float(norm_type)
        owned = [g for g in self._owned_grads() if g is not None]
        device = self._spaces[0].device if self._spaces else torch.device("cpu")
        if norm_type == math.inf:
            local = max((g.abs().max().float() for g in owned), default=torch.zeros((), device=device))
            local = local.reshape(1).clone()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
            total = local[0]
        else:
            local = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type for g in owned),
                        torch.zeros((), device=device)).reshape(1)
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.process_group)
            total = local[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self._zero2 is not None:
            targets = self.gradient_shards
        else:
            targets = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        for g in targets:
            g.mul_(coef.to(g.dtype))
        return total

    def _sync_options(self) -> None:
        """Options changed on self.param_groups (an LR scheduler, the user) reach the local optimizer."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key not in _GROUP_ONLY_KEYS:
                    inner[key] = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError(
                "ZeroRedundancyOptimizer.add_param_group after construction is not supported: the partition "
                "is fixed when the optimizer is built; pass every param group to the constructor")
        super().add_param_group(param_group)

    # --- checkpoints ----------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers every rank's optimizer state to rank ``to`` (a collective: call on every rank), for
        state_dict(). The gathered tensors are CPU copies: later steps do not change them."""
        if not (isinstance(to, int) and 0 <= to < self.world_size):
            raise ValueError(f"consolidate_state_dict: to must be a rank of the process group "
                             f"(0..{self.world_size - 1}), got {to!r}")
        # parameter_state(): the whole state of an optimizer that keeps part of it outside `state` (shardkit.optim's
        # offloaded optimizers: the moments are in a file)
        state_of = getattr(self.optim, "parameter_state", lambda leaf: self.optim.state[leaf])
        mine = [(piece.index, piece.start, piece.numel,
                 {key: _detached_cpu_copy(value) for key, value in state_of(piece.leaf).items()})
                for piece in self._pieces if piece.leaf in self.optim.state]
        everyone = _exchange.gather_object(mine, to, self.process_group)
        self._consolidated_to = to
        self._consolidated = None
        if self.rank != to or everyone is None:  # everyone: None on every rank but `to`
            return
        parts: dict[int, list[tuple[int, int, dict[str, Any]]]] = defaultdict(list)
        for rank_pieces in everyone:
            for index, start, numel, state in rank_pieces:
                parts[index].append((start, numel, state))
        params = [p for group in self.param_groups for p in group["params"]]
        self._consolidated = {index: _merge_pieces(index, params[index], sorted(parts[index], key=lambda t: t[0]))
                              for index in sorted(parts)}

    def state_dict(self) -> dict[str, Any]:
        """On the rank given to the last consolidate_state_dict(): the unsharded optimizer's state_dict.

        Before any step() (and any load of a non-empty state) there is no state to consolidate: every rank returns
        the param_groups with an empty ``state``, as the unsharded optimizer would. Otherwise raises RuntimeError
        elsewhere, before consolidate_state_dict() and after a step() that followed it.
        """
        if self._consolidated is None and not self._may_hold_state:
            packed = super().state_dict()
            packed["state"] = {}
            return packed
        if self._consolidated is None:
            if self._consolidated_to is not None and self._consolidated_to != self.rank:
                where = f"the state was consolidated to rank {self._consolidated_to}, not this one"
            elif self._consolidated_to is not None:
                where = "the optimizer has stepped since the last consolidate_state_dict()"
            else:
                where = "consolidate_state_dict() has not been called"
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: the optimizer state is sharded across "
                f"ranks and {where}; call consolidate_state_dict(to={self.rank}) on all ranks first")
        packed = super().state_dict()  # param_groups with the unsharded numbering; self.state is empty
        packed["state"] = dict(self._consolidated)
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads an unsharded-format state dict (from state_dict() or from ``optimizer_class`` itself, any
        world size); call on every rank with the same dict. Each rank keeps only its slice of the state.

        Also takes what ``FullyShardedDataParallel.optim_state_dict_to_load(model, this, name_keyed)`` returns:
        this rank's pieces' state already cut (see _zero_state_dict.py), marked with ``LOCAL_PIECES_KEY``."""
        # A rank's cut pieces may be empty where another's are not: only the whole dict says "no state anywhere".
        self._may_hold_state = LOCAL_PIECES_KEY in state_dict or bool(state_dict.get("state"))
        if LOCAL_PIECES_KEY in state_dict:
            mark = {"world": self.world_size, "rank": self.rank}
            if state_dict[LOCAL_PIECES_KEY] != mark:
                raise ValueError(f"ZeroRedundancyOptimizer (rank {self.rank}) load_state_dict: the state was cut for "
                                 f"{state_dict[LOCAL_PIECES_KEY]}, this optimizer is {mark}")
            for saved, group in zip(state_dict["param_groups"], self.param_groups):
                group.update(_options(saved))
            self._load_local_state(state_dict["state"])
            return
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has "
                             f"{len(self.param_groups)}")
        saved_index_of: dict[int, Any] = {}
        index = 0
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"loaded state dict's parameter group {g} has {len(saved['params'])} parameters, "
                                 f"the optimizer's has {len(group['params'])}")
            for saved_id in saved["params"]:
                saved_index_of[index] = saved_id
                index += 1
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k not in _GROUP_ONLY_KEYS})

        local_state: dict[int, dict[str, Any]] = {}
        for local_index, piece in enumerate(self._pieces):  # the local optimizer's order: by index, so by group
            full = state_dict["state"].get(saved_index_of[piece.index])
            if full is not None:
                local_state[local_index] = {key: _slice_state(piece, key, value) for key, value in full.items()}
        self._load_local_state(local_state)

    def _load_local_state(self, local_state: dict[int, dict[str, Any]]) -> None:
        """Loads this rank's pieces' state (keyed by position in ``self._pieces``, the local optimizer's order)
        with the options of ``self.param_groups``."""
        local_groups, local_index = [], 0
        for g, group in enumerate(self.param_groups):
            count = sum(1 for piece in self._pieces if piece.group == g)
            local_groups.append({**_options(group), "params": list(range(local_index, local_index + count))})
            local_index += count
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._consolidated, self._consolidated_to = None, None

    # checkpoint/_front_protocol.py's OptimizerFront: the name-keyed state dict of this rank's pieces.
    def name_keyed_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return zero_state_dict.optim_state_dict(model, self)

    def name_keyed_state_dict_to_load(self, model: nn.Module, optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        return zero_state_dict.optim_state_dict_to_load(model, self, optim_state_dict)


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _GROUP_ONLY_KEYS}


def _warn_if_not_elementwise(optimizer_class: type[Optimizer]) -> None:
    if optimizer_class in ELEMENTWISE_OPTIMIZERS or optimizer_class in _warned_classes:
        return
    _warned_classes.add(optimizer_class)
    warnings.warn(
        f"ZeroRedundancyOptimizer: {optimizer_class.__module__}.{optimizer_class.__qualname__} is not a known "
        "elementwise optimizer; each rank steps only its slice of the parameters (parameters on a slice "
        "boundary are split), so an update that uses whole-parameter or whole-model statistics (LAMB, "
        "Adafactor, Muon, LBFGS, clipping inside the optimizer) will differ from the unsharded optimizer. "
        f"Known exact: {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}",
        stacklevel=3)


def _detached_cpu_copy(value: Any) -> Any:
    """A copy that later steps cannot change (the consolidated state must not alias the live state)."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _merge_pieces(index: int, param: torch.Tensor, parts: list[tuple[int, int, dict[str, Any]]]) -> dict[str, Any]:
    """One parameter's state from its pieces (sorted by start): elementwise tensors are concatenated and
    take the parameter's shape; scalars (step counts, ...) are the first piece's."""
    if len(parts) == 1 and parts[0][1] == param.numel():
        return parts[0][2]
    if sum(numel for _, numel, _ in parts) != param.numel():
        raise RuntimeError(f"consolidate_state_dict: parameter {index} has optimizer state for only part of its "
                           "elements (its gradient was None on some ranks but not others?)")
    keys = list(parts[0][2])
    merged: dict[str, Any] = {}
    for key in keys:
        values = [state.get(key) for _, _, state in parts]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() == 1 and all(
                isinstance(v, torch.Tensor) and v.shape == (numel,) for v, (_, numel, _) in zip(values, parts)):
            merged[key] = torch.cat(cast(list[torch.Tensor], values)).view(param.shape)
        else:
            merged[key] = first
    return merged


def _slice_state(piece: _Piece, key: str, value: Any) -> Any:
    """This piece's share of one parameter's state value (copied, so the caller's dict is not aliased)."""
    if not isinstance(value, torch.Tensor):
        return value
    if piece.whole or value.dim() == 0:
        return value.detach().clone()
    if value.shape != piece.param.shape:
        raise ValueError(f"load_state_dict: state {key!r} of parameter {piece.index} has shape {list(value.shape)}; "
                         f"expected the parameter's shape {list(piece.param.shape)} or a scalar")
    return value.detach().reshape(-1)[piece.start:piece.start + piece.numel].clone()


def _first_difference(mine: list[list[tuple]], theirs: list[list[tuple]], rank: int, other: int) -> str:
    if len(mine) != len(theirs):
        return f"rank {rank} has {len(mine)} param groups but rank {other} has {len(theirs)}"
    for g, (a, b) in enumerate(zip(mine, theirs)):
        for position in range(max(len(a), len(b))):
            x = a[position] if position < len(a) else None
            y = b[position] if position < len(b) else None
            if x != y:
                return (f"param group {g}, parameter {position}: rank {rank} has {_describe(x)} but rank {other} "
                        f"has {_describe(y)}")
    return "unknown difference"


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "no parameter there"
    shape, dtype, requires_grad = entry
    return f"shape {list(shape)} {dtype.removeprefix('torch.')}{'' if requires_grad else ' (frozen)'}"

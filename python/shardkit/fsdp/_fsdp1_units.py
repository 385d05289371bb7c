"""The FSDP1 front's units and their flat groups: what shardkit.FullyShardedDataParallel builds at construction
and its hook schedule (_fsdp1_schedule.py) drives.

A ``Unit`` is one module the wrap policy chose (the root is the wrapped module itself); its ``FlatGroup`` s are its
parameters of one dtype and requires_grad each, held by one C++ ``FlatParamHandle`` (csrc/fsdp/flat_param.h).
Whether a group is gathered, and the bytes that takes, are the handle's state, asked of it (``allocated``,
``holds_full_buffer``, the model's ``GatheredBytes``); a group keeps in Python only what autograd needs of it
during an iteration (its views and the gradients a recompute deferred).

``make_unit`` builds a unit and makes its parameters views of the shards; ``register_parameters`` puts views in
the modules' parameter slots for a forward or backward, and ``restore_parameters`` the sharded parameters back."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import _C, _torch_compat
from ._fsdp1_api import MixedPrecision


@dataclasses.dataclass(eq=False)
class FlatGroup:
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
class Unit:
    name: str
    module: nn.Module
    groups: list[FlatGroup]
    is_root: bool


def make_unit(name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]], mixed_precision: MixedPrecision,
              shard_group: Any, replicate_group: Any, compute_device: torch.device | None,
              wire: Any | None, gathered_bytes: Any) -> Unit:
    """The unit of ``module`` (``name``: its path, "" for the root) over ``params`` (the ones it owns), one handle
    per (dtype, requires_grad), in order of first appearance; the parameters become views of their shards.
    ``wire``: the inter-host quantization (shardkit.Quantized.wire()), or None; ``gathered_bytes``: the
    _C.GatheredBytes every handle of the model counts its full buffer in."""
    occurrences: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, p in _torch_compat.registered_parameters(sub).items():
            if p is not None:
                occurrences.setdefault(id(p), []).append((sub, attr))
    keyed: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
    for fqn, p in params:
        keyed.setdefault((p.dtype, p.requires_grad), []).append((fqn, p))
    groups = []
    mp = mixed_precision
    for (dtype, trainable), members in keyed.items():
        floating = dtype.is_floating_point
        handle = _C.FlatParamHandle([p.detach() for _, p in members], shard_group, replicate_group,
                                    label=name or "(root)", param_dtype=mp.param_dtype if floating else None,
                                    reduce_dtype=(mp.reduce_dtype or mp.param_dtype) if floating else None,
                                    compute_device=compute_device, gathered_bytes=gathered_bytes)
        if wire is not None:
            handle.set_quantization(wire)
        ps = [p for _, p in members]
        shapes = [p.shape for p in ps]
        for p, view in zip(ps, handle.shard_views()):
            p.data = view
        groups.append(FlatGroup(handle, ps, [n for n, _ in members], [occurrences[id(p)] for p in ps], shapes,
                                trainable, unit_name=name or "(root)"))
    return Unit(name, module, groups, is_root=name == "")


def register_parameters(group: FlatGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Every module slot that registers one of the group's parameters holds ``tensors[i]`` for parameter i (views
    of the full buffer for a forward or backward, or the sharded parameters themselves)."""
    for places, tensor in zip(group.occurrences, tensors):
        for owner, attr in places:
            _torch_compat.set_registered_parameter(owner, attr, tensor)


def restore_parameters(group: FlatGroup) -> None:
    """The module registers the sharded parameters again (where a forward or backward put views)."""
    register_parameters(group, group.params)

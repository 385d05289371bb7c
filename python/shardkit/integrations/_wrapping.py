"""What every integration does with a model, whatever the training library: one piece of code for accelerate,
the Hugging Face Trainer and Lightning. It imports torch and shardkit only (no training library), so an
integration imports it without pulling in another's dependencies.

- ``WrapSpec``: the user's choice (strategy, comm hook, auto_wrap, mixed precision, memory budget for ``auto``),
  validated once (``check``), with the errors naming the integration's class.
- ``resolve``: ``strategy="auto"`` made concrete with shardkit's memory math (``shardkit.strategy.agreed_plan``:
  every rank's budget, the smallest wins, so all ranks choose alike), once, at the first wrap; the front for the
  estimate's choice is ``shardkit.strategy.front_for``'s, as ``shardkit.auto``'s is.
- ``wrap``: the model wrapped by shardkit's fronts, and which parameters were replaced (fully_shard swaps each
  parameter for a sharded DTensor one; an optimizer built before must be pointed at them: ``swap_parameters``).
- ``as_zero``: the optimizer rebuilt as a ``ZeroRedundancyOptimizer`` with its class, groups and options.
- ``sharded_clip`` / ``plain_norm``: clipping by the global norm, from the shards where the gradients are sharded.
- ``no_gradient_sync``: gradient accumulation without reduction, for every front.
- checkpoint helpers: ``current_state`` / ``load_into`` (``shardkit.checkpoint``'s sharded state of model/optimizer
  pairs), ``own_storage`` / ``share_tied`` (a gathered state dict that savers keeping shared storage once accept).

Errors name the rank where one is known, the feature and the offending value; ``owner`` is the integration's
class or call as its users write it (``"ShardkitPlugin"``, ``"shardkit Accelerator.prepare"``,
``"ShardkitStrategy"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from .. import _torch_compat
from .. import estimate as _estimate
from .. import hooks as _hooks
from .. import state_dict as _state_dict
from .. import strategy as _strategy
from ..checkpoint import load as _checkpoint_load
from ..ddp import DistributedDataParallel
from ..fsdp import FullyShardedDataParallel, fully_shard
from ..zero import ZeroRedundancyOptimizer

STRATEGIES = ("ddp", "zero1", "zero2", "fully_shard", "fsdp")
AUTO = "auto"
COMM_HOOKS = (None, "fp16", "bf16", "powersgd")
ZERO_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2}  # the strategies that are shardkit's DDP
UNIT_STRATEGIES = ("fully_shard", "fsdp")  # the strategies that shard modules as units (auto_wrap)
SHARDED_STATE = ("zero1", "zero2", "fully_shard", "fsdp")  # whose optimizer (and model) state lies in shards


@dataclasses.dataclass
class WrapSpec:
    """How a model is wrapped. An integration's own class (accelerate's ``ShardkitPlugin``) is a subclass; the
    field meanings are documented there.

    ``resolved_strategy`` is the concrete strategy: ``strategy`` itself, or, for ``"auto"``, what ``resolve``
    chose (None until then); ``auto_plan`` is the ``shardkit.strategy.AutoPlan`` behind that choice."""

    strategy: str = "ddp"
    comm_hook: str | None = None
    powersgd_rank: int = 1
    auto_wrap: Iterable[type[nn.Module] | str] | None = None
    mixed_precision: Any = None
    reshard_after_forward: bool | int = True
    memory_budget_gb: float | None = None
    resolved_strategy: str | None = dataclasses.field(default=None, init=False, compare=False)
    auto_plan: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def check(self, owner: str, strategies: tuple[str, ...] = STRATEGIES) -> None:
        """Raises ValueError naming ``owner`` for a combination that cannot work; ``strategies``: those the
        integration offers (besides ``"auto"``)."""
        if self.strategy != AUTO and self.strategy not in strategies:
            raise ValueError(f"{owner}: strategy must be one of {', '.join(strategies)} or auto, got {self.strategy!r}")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"{owner}: comm_hook must be one of {COMM_HOOKS}, got {self.comm_hook!r}")
        if self.comm_hook is not None and self.strategy not in ZERO_STAGES:
            why = ("auto may choose fully_shard" if self.strategy == AUTO
                   else "its gradients are reduce-scattered")
            raise ValueError(f"{owner}: comm_hook={self.comm_hook!r} applies to ddp, zero1 and zero2, not to "
                             f"strategy={self.strategy!r} ({why})")
        if self.auto_wrap is not None and self.strategy not in (*UNIT_STRATEGIES, AUTO):
            raise ValueError(f"{owner}: auto_wrap applies to fully_shard and fsdp (and auto, when it chooses "
                             f"fully_shard), not to strategy={self.strategy!r}")
        if self.memory_budget_gb is not None:
            if self.strategy != AUTO:
                raise ValueError(f"{owner}: memory_budget_gb applies to strategy='auto', not to "
                                 f"strategy={self.strategy!r}")
            if not (isinstance(self.memory_budget_gb, (int, float)) and self.memory_budget_gb > 0):
                raise ValueError(f"{owner}: memory_budget_gb must be a positive number of GB, got "
                                 f"{self.memory_budget_gb!r}")
        if self.auto_wrap is not None:
            self.auto_wrap = tuple(self.auto_wrap)
        if self.strategy != AUTO:
            self.resolved_strategy = self.strategy


# --- strategy="auto" ------------------------------------------------------------------------------------------
def resolve(spec: WrapSpec, model: nn.Module, optimizer_classes: Iterable[type], owner: str) -> str:
    """The concrete strategy for ``spec``; for ``"auto"``, decided by shardkit's memory math the first time (a
    collective over the default group: call it on every rank, at the same point) and kept in ``spec``.

    The estimate counts the model's trainable parameters, their precision and the optimizer's state (Adam-like if
    any optimizer class is, or none is known yet; else SGD with momentum), against ``spec.memory_budget_gb`` (None:
    the device's free memory, or the host's available memory over its ranks), the smallest over the ranks."""
    if spec.resolved_strategy is not None:
        return spec.resolved_strategy
    group = _torch_compat.default_group()
    rank = dist.get_rank(group)
    kinds = {_strategy._optimizer_kind(cls) for cls in optimizer_classes}
    optimizer = "sgd" if kinds == {"sgd"} else "adam"
    decided = _strategy.agreed_plan([p for p in model.parameters() if p.requires_grad], optimizer,
                                    spec.memory_budget_gb, group, who=f"{owner}(strategy='auto')")
    # ZeRO-3 + CPU offload has no integration strategy: the integrations wrap with the front front_for names for
    # every other choice, and none of them offloads.
    if decided.strategy == "zero3_offload":
        raise RuntimeError(f"{owner}(strategy='auto') (rank {rank}): only {_estimate.STRATEGIES[decided.strategy]} "
                           f"fits in {decided.budget_gb:g} GB per rank, and the integrations do not offload to the "
                           "CPU (shardkit.auto does, for a model on a CUDA device); give more memory_budget_gb or "
                           f"ranks:\n{decided.report}")
    spec.resolved_strategy, spec.auto_plan = decided.front, decided
    _strategy.log_decision(decided, f"{spec.resolved_strategy} ({_estimate.STRATEGIES[decided.strategy]}) for "
                           f"{owner}", rank)
    return spec.resolved_strategy


# --- wrapping ---------------------------------------------------------------------------------------------------
def refuse_wrapped(model: nn.Module, owner: str, how: str) -> None:
    """Raises if ``model`` or a submodule already holds a torch or shardkit wrapper: shardkit never wraps twice.
    ``how`` says where the wrapping is chosen (``"ShardkitPlugin(strategy=...)"``)."""
    wrappers = (TorchDDP, FullyShardedDataParallel, FSDPModule)
    found = next((m for m in model.modules() if isinstance(m, wrappers)), None)
    if found is not None:
        where = "the model is" if found is model else "a submodule is"
        rank = f" (rank {dist.get_rank()})" if dist.is_initialized() else ""
        raise ValueError(f"{owner}{rank}: {where} already wrapped ({type(found).__name__}); pass the plain model and "
                         f"choose the wrapping with {how}")


def block_classes(model: nn.Module, auto_wrap: tuple[type[nn.Module] | str, ...] | None,
                  owner: str) -> tuple[type, ...]:
    """``auto_wrap`` as classes: names are looked up among the model's modules' classes."""
    if not auto_wrap:
        return ()
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [c for c in auto_wrap if isinstance(c, str) and c not in present]
    if missing:
        raise ValueError(f"{owner}(auto_wrap=...): no module of the {type(model).__name__} is a {missing}; its "
                         f"module classes are {sorted(present)}")
    return tuple(present[c] if isinstance(c, str) else c for c in auto_wrap)


def register_comm_hook(model: DistributedDataParallel, spec: WrapSpec) -> None:
    if spec.comm_hook == "fp16":
        model.register_comm_hook(None, _hooks.fp16_compress_hook)
    elif spec.comm_hook == "bf16":
        model.register_comm_hook(None, _hooks.bf16_compress_hook)
    elif spec.comm_hook == "powersgd":
        state = _hooks.PowerSGDState(process_group=None, matrix_approximation_rank=spec.powersgd_rank)
        model.register_comm_hook(state, _hooks.powerSGD_hook)


def unwrapped(model: nn.Module) -> nn.Module:
    """The module inside shardkit's DDP or FSDP1 front (fully_shard wraps in place: the model itself)."""
    return model.module if isinstance(model, (TorchDDP, FullyShardedDataParallel)) else model


def wrap(model: nn.Module, spec: WrapSpec, owner: str, device: torch.device,
         ddp_options: dict[str, Any] | None = None) -> tuple[nn.Module, dict[int, tuple[nn.Parameter, nn.Parameter]]]:
    """(the model wrapped as ``spec.resolved_strategy`` says, the parameters it replaced: id(old) -> (old, new)).

    ddp / zero1 / zero2: shardkit's DDP (``zero_stage``, ``ddp_options``, the comm hook); fsdp: the FSDP1 front
    over the ``auto_wrap`` classes; fully_shard: ``shardkit.fully_shard`` on every module of the ``auto_wrap``
    classes (for ``auto`` without auto_wrap: the classes held in the model's ModuleLists, as ``shardkit.auto``
    shards), then on the root. ``device``: the rank's device (CUDA: DDP's device_ids, the FSDP1 front's device)."""
    strategy = spec.resolved_strategy
    if strategy is None:
        raise RuntimeError(f"{owner}: strategy='auto' must be resolved before wrapping (shardkit bug)")
    before = dict(model.named_parameters(remove_duplicate=False))
    on_cuda = device.type == "cuda"
    if strategy in ZERO_STAGES:
        options = dict(ddp_options or {})
        if on_cuda:
            options.setdefault("device_ids", [device.index or 0])
        ddp = DistributedDataParallel(model, zero_stage=ZERO_STAGES[strategy], **options)
        register_comm_hook(ddp, spec)
        wrapped: nn.Module = ddp
    else:
        auto_wrap = tuple(spec.auto_wrap) if spec.auto_wrap is not None else None
        if auto_wrap is None and spec.strategy == AUTO:
            auto_wrap = tuple(_strategy.module_list_blocks(model)) or None
        blocks = block_classes(model, auto_wrap, owner)
        if strategy == "fsdp":
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=set(blocks) or None,
                                               mixed_precision=spec.mixed_precision,
                                               device_id=device if on_cuda else None)
        else:
            options = {"reshard_after_forward": spec.reshard_after_forward}
            if spec.mixed_precision is not None:
                options["mp_policy"] = spec.mixed_precision
            for block in [m for m in model.modules() if blocks and isinstance(m, blocks) and m is not model]:
                fully_shard(block, **options)
            wrapped = fully_shard(model, **options)
    replaced = {}
    for name, new in unwrapped(wrapped).named_parameters(remove_duplicate=False):
        old = before.get(name)
        if old is not None and old is not new:
            replaced[id(old)] = (old, new)
    return wrapped, replaced


def as_zero(optimizer: torch.optim.Optimizer, owner: str) -> ZeroRedundancyOptimizer:
    """A ZeroRedundancyOptimizer over ``optimizer``'s parameters, with its class, groups and options."""
    if optimizer.state:
        raise ValueError(f"{owner}: the {type(optimizer).__name__} already holds state; under ZeRO it is rebuilt "
                         "sharded, so prepare it before its first step")
    # Only the options the class's constructor takes (torch's AdamW keeps a `decoupled_weight_decay` default it
    # does not accept back); the groups keep every option, as the unsharded optimizer's would.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer([dict(group) for group in optimizer.param_groups], type(optimizer), **defaults)


def swap_parameters(optimizer: torch.optim.Optimizer, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]],
                    owner: str) -> None:
    """Points ``optimizer`` at the parameters that replaced the ones it was built over (fully_shard's DTensors)."""
    holds_old = any(id(p) in replaced for group in optimizer.param_groups for p in group["params"])
    if holds_old and optimizer.state:
        raise ValueError(f"{owner}: the {type(optimizer).__name__} already holds state for parameters that "
                         "fully_shard replaced; prepare it before its first step")
    for group in optimizer.param_groups:
        group["params"] = [replaced[id(p)][1] if id(p) in replaced else p for p in group["params"]]


# --- training ---------------------------------------------------------------------------------------------------
def sharded_clip(parameters: Iterable[torch.Tensor], models: Iterable[nn.Module],
                 optimizers: Iterable[torch.optim.Optimizer]) -> Callable[..., torch.Tensor] | None:
    """The clip for ``parameters`` where their gradients are sharded: the FSDP1 front's ``clip_grad_norm_`` (when
    ``parameters`` are one such model's trainable ones) or a ZeroRedundancyOptimizer's (when it steps them), both
    computing the global norm from the shards (collectives); None where ``torch.nn.utils.clip_grad_norm_`` is
    already global (DDP's full gradients, fully_shard's DTensors: see ``plain_norm``)."""
    wanted = {id(p) for p in parameters if p.requires_grad}
    for model in models:
        if isinstance(model, FullyShardedDataParallel) and wanted == trainable_ids(model):
            return model.clip_grad_norm_
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, ZeroRedundancyOptimizer) and wanted and wanted <= optimizer_ids(inner):
            return inner.clip_grad_norm_
    return None


def plain_norm(norm: torch.Tensor) -> torch.Tensor:
    """fully_shard's total norm is a DTensor: its value as a plain tensor (the same on every rank)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients local (accumulation): ``set_requires_gradient_sync(False)`` for
    fully_shard, ``no_sync()`` for DDP (shardkit's, ZeRO's, torch's) and the FSDP1 front."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, (TorchDDP, FullyShardedDataParallel)):
        with model.no_sync():
            yield
    else:
        yield


def trainable_ids(model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters() if p.requires_grad}


def optimizer_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


# --- checkpoints ------------------------------------------------------------------------------------------------
def current_state(pairs: list[tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict[str, Any]:
    """The models' and optimizers' sharded state dicts, keyed model_i / optimizer_i (DCP's input)."""
    state: dict[str, Any] = {}
    for i, (model, optimizer) in enumerate(pairs):
        if optimizer is None:
            state[f"model_{i}"] = _state_dict.get_model_state_dict(model)
        else:
            state[f"model_{i}"], state[f"optimizer_{i}"] = _state_dict.get_state_dict(model, [optimizer])
    return state


def load_into(pairs: list[tuple[nn.Module, torch.optim.Optimizer | None]], directory: str) -> None:
    """Loads what ``current_state(pairs)`` saved in ``directory`` (at any world size) into the models and
    optimizers."""
    state = current_state(pairs)
    _checkpoint_load(state, directory)
    for i, (model, optimizer) in enumerate(pairs):
        if optimizer is None:
            _state_dict.set_model_state_dict(model, state[f"model_{i}"])
        else:
            _state_dict.set_state_dict(model, [optimizer], model_state_dict=state[f"model_{i}"],
                                       optim_state_dict=state[f"optimizer_{i}"])


def own_storage(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an OrderedDict, as torch's) with every tensor that is a view into a larger buffer copied out."""
    out: Any = type(state)()
    for name, value in state.items():
        shares = isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes
        out[name] = value.detach().clone() if shares else value
    if hasattr(state, "_metadata"):
        out._metadata = state._metadata
    return out


def share_tied(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` with every name of one tied parameter holding the same tensor (as ``model.state_dict()`` would),
    so savers that keep shared storage once (safetensors, accelerate's save_model) do."""
    if not state:
        return state
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state and id(param) in first_name:
            state[name] = state[first_name[id(param)]]
        first_name.setdefault(id(param), name)
    return state

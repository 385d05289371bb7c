"""shardkit in Hugging Face accelerate: ``Accelerator`` (a subclass of accelerate's) and ``ShardkitPlugin``.

    from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

    accelerator = Accelerator(shardkit_plugin=ShardkitPlugin(strategy="fully_shard", auto_wrap={Block}))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

The training loop is accelerate's, unchanged. What the subclass changes, and why:

- **The process group is shardkit's**, on CPU and CUDA alike, under any launcher that sets torchrun's variables
  (``torchrun``, ``accelerate launch``). accelerate itself accepts only gloo/mpi on CPU (``backend="shardkit"``
  is refused) and, without ``cpu=True``, silently runs a CPU job undistributed; here the backend is chosen in
  ``_ShardkitPartialState._prepare_backend`` and ``accelerator.state.backend`` says ``"shardkit"``.
- **prepare wraps with shardkit's fronts** instead of torch's DDP (``ShardkitPlugin.strategy``): ``ddp``,
  ``zero1`` / ``zero2`` (shardkit's DDP with ``zero_stage``; the optimizer becomes a ``ZeroRedundancyOptimizer``
  over the same parameters and options), ``fully_shard`` (``shardkit.fully_shard`` on every module of the
  ``auto_wrap`` classes, then on the root), ``fsdp`` (the FSDP1 front). The rest of accelerate's model
  preparation (device placement, autocast) runs as it would; a model already wrapped by shardkit or torch is
  refused, never wrapped twice.
- **clip_grad_norm_ returns the global norm** for every strategy: the FSDP1 front and ZeRO clip from their
  shards (their ``clip_grad_norm_``), ``fully_shard``'s DTensor norm is returned as a plain tensor.
- **no_sync / accumulate** skip the gradient reduction on every strategy (``set_requires_gradient_sync`` for
  ``fully_shard``, as accelerate does for torch FSDP2).
- **get_state_dict / save_model** give the whole model on the main process (the others get ``{}``), with the
  unwrapped model's names and tied weights sharing storage, so ``save_model`` writes a plain Hugging Face
  checkpoint (each tied weight once) that ``from_pretrained`` loads.
- **save_state / load_state** write the sharded strategies' model and optimizer state with
  ``shardkit.checkpoint.save`` (torch's DCP format, one ``shardkit`` directory inside accelerate's checkpoint
  directory), so a run resumes at another world size; schedulers, RNG states, samplers and registered objects
  are accelerate's as always. ``ddp`` (replicated state) uses accelerate's own files.

Unsupported combinations raise, naming the feature: ``strategy="auto"`` (not built yet), DeepSpeed / FSDP /
Megatron plugins alongside a ShardkitPlugin, an optimizer with state at ``prepare`` under ZeRO.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs
except ImportError as error:  # shardkit does not depend on accelerate
    raise ImportError("shardkit.integrations.accelerate needs Hugging Face accelerate (pip install accelerate; "
                      f"tested with 1.15.0): {error}") from error

from .. import hooks as _hooks
from .. import state_dict as _state_dict
from ..checkpoint import load as _checkpoint_load
from ..checkpoint import save as _checkpoint_save
from ..ddp import DistributedDataParallel
from ..fsdp import FullyShardedDataParallel, fully_shard
from ..zero import ZeroRedundancyOptimizer

__all__ = ["Accelerator", "ShardkitPlugin", "STRATEGIES", "SHARDED_STATE"]

STRATEGIES = ("ddp", "zero1", "zero2", "fully_shard", "fsdp")
_COMM_HOOKS = (None, "fp16", "bf16", "powersgd")
SHARDED_STATE = ("zero1", "zero2", "fully_shard", "fsdp")  # whose save_state goes through shardkit.checkpoint
CHECKPOINT_SUBDIR = "shardkit"  # inside accelerate's checkpoint directory


@dataclasses.dataclass
class ShardkitPlugin:
    """How ``Accelerator.prepare`` wraps models.

    strategy: ``"ddp"`` (default), ``"zero1"``, ``"zero2"``, ``"fully_shard"`` or ``"fsdp"`` (the FSDP1 front).
    comm_hook: ddp / zero1 / zero2 only: ``"fp16"``, ``"bf16"`` (shardkit's C++ compress hooks) or
        ``"powersgd"`` (rank ``powersgd_rank``); None: plain allreduce.
    auto_wrap: fully_shard / fsdp: the block classes sharded as units of their own, as classes or class names
        (``{GPT2Block}`` or ``["GPT2Block"]``; a name that no module of the model has raises); None: the whole model
        is one unit.
    mixed_precision: fully_shard: a ``torch.distributed.fsdp.MixedPrecisionPolicy``; fsdp: a
        ``shardkit.fsdp.MixedPrecision``. None: the parameters' dtype throughout.
    reshard_after_forward: fully_shard's argument (torch's default, True).
    """

    strategy: str = "ddp"
    comm_hook: str | None = None
    powersgd_rank: int = 1
    auto_wrap: Iterable[type[nn.Module] | str] | None = None
    mixed_precision: Any = None
    reshard_after_forward: bool | int = True

    def __post_init__(self) -> None:
        if self.strategy == "auto":
            raise NotImplementedError("ShardkitPlugin(strategy='auto') is not built yet: pick one of "
                                      f"{', '.join(STRATEGIES)} (python -m shardkit estimate suggests one)")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"ShardkitPlugin: strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.comm_hook not in _COMM_HOOKS:
            raise ValueError(f"ShardkitPlugin: comm_hook must be one of {_COMM_HOOKS}, got {self.comm_hook!r}")
        if self.comm_hook is not None and self.strategy not in ("ddp", "zero1", "zero2"):
            raise ValueError(f"ShardkitPlugin: comm_hook={self.comm_hook!r} applies to ddp, zero1 and zero2, not to "
                             f"strategy={self.strategy!r} (its gradients are reduce-scattered)")
        if self.auto_wrap is not None and self.strategy not in ("fully_shard", "fsdp"):
            raise ValueError(f"ShardkitPlugin: auto_wrap applies to fully_shard and fsdp, not to "
                             f"strategy={self.strategy!r}")
        if self.auto_wrap is not None:
            self.auto_wrap = tuple(self.auto_wrap)


class _ShardkitPartialState(PartialState):
    """accelerate's process state with the ``shardkit`` backend wherever the job is launched distributed.

    accelerate keeps one shared state per process; the first constructed initialises it, so
    ``Accelerator.__init__`` builds this one before accelerate builds its own (which then finds it initialised).
    """

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        if backend not in (None, "shardkit"):
            raise ValueError(f"shardkit.integrations.accelerate.Accelerator runs on the 'shardkit' backend; "
                             f"InitProcessGroupKwargs(backend={backend!r}) asks for another (use accelerate's own "
                             "Accelerator for it)")
        launched = int(os.environ.get("LOCAL_RANK", -1)) != -1 or int(os.environ.get("WORLD_SIZE", 1)) > 1
        if not launched:
            return super()._prepare_backend(cpu, sagemaker_dp, None)
        if torch.cuda.is_available() and not cpu:
            return "shardkit", DistributedType.MULTI_GPU
        return "shardkit", DistributedType.MULTI_CPU


class Accelerator(accelerate.Accelerator):
    """accelerate's ``Accelerator`` on shardkit (see the module docstring). Takes accelerate's arguments, plus
    ``shardkit_plugin`` (default: ``ShardkitPlugin()``, shardkit's DDP)."""

    def __init__(self, *args: Any, shardkit_plugin: ShardkitPlugin | None = None, **kwargs: Any) -> None:
        for name in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(name) is not None:
                raise ValueError(f"shardkit Accelerator: {name} cannot be combined with shardkit's wrapping; "
                                 "choose the strategy with ShardkitPlugin")
        self.shardkit_plugin = shardkit_plugin or ShardkitPlugin()
        init = next((h for h in kwargs.get("kwargs_handlers") or () if isinstance(h, InitProcessGroupKwargs)), None)
        _ShardkitPartialState(cpu=bool(kwargs.get("cpu", False)), **(init.to_kwargs() if init else {}))
        super().__init__(*args, **kwargs)
        self._state_dict_placeholder = False  # inside save_state: the models' state is saved by shardkit
        # fully_shard replaces each parameter by a sharded DTensor one; an optimizer built before prepare still
        # holds the old objects, so prepare_optimizer swaps them: id(old) -> (old, new), old kept alive.
        self._replaced_parameters: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    # --- preparation -------------------------------------------------------------------------------------
    @property
    def _wraps(self) -> bool:
        return self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if getattr(model, "_is_accelerate_prepared", False) or evaluation_mode or not self._wraps:
            return super().prepare_model(model, device_placement, evaluation_mode)
        _refuse_wrapped(model)
        with self._as_one_process():  # accelerate's placement and autocast, without its torch DDP
            model = super().prepare_model(model, device_placement, evaluation_mode)
        before = dict(model.named_parameters(remove_duplicate=False))
        wrapped = self._wrap(model)
        for name, new in self.unwrap_model(wrapped).named_parameters(remove_duplicate=False):
            old = before.get(name)
            if old is not None and old is not new:
                self._replaced_parameters[id(old)] = (old, new)
        wrapped._is_accelerate_prepared = True
        self._models[[m is model for m in self._models].index(True)] = wrapped
        return wrapped

    @contextlib.contextmanager
    def _as_one_process(self) -> Iterator[None]:
        """accelerate's prepare_model wraps every model in torch's DDP when the job is distributed; the rest of
        it is wanted. So that step sees a single-process job; shardkit wraps what it returns."""
        kind = self.state.distributed_type
        self.state.distributed_type = DistributedType.NO
        try:
            yield
        finally:
            self.state.distributed_type = kind

    def _wrap(self, model: nn.Module) -> nn.Module:
        plugin = self.shardkit_plugin
        on_cuda = self.device.type == "cuda"
        if plugin.strategy in ("ddp", "zero1", "zero2"):
            options = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
            if on_cuda:
                options.setdefault("device_ids", [self.device.index or 0])
            stage = {"ddp": 0, "zero1": 1, "zero2": 2}[plugin.strategy]
            wrapped = DistributedDataParallel(model, zero_stage=stage, **options)
            _register_comm_hook(wrapped, plugin)
            return wrapped
        block_classes = _block_classes(model, plugin.auto_wrap)
        if plugin.strategy == "fsdp":
            return FullyShardedDataParallel(model, auto_wrap_policy=set(block_classes) or None,
                                            mixed_precision=plugin.mixed_precision,
                                            device_id=self.device if on_cuda else None)
        options = {"reshard_after_forward": plugin.reshard_after_forward}
        if plugin.mixed_precision is not None:
            options["mp_policy"] = plugin.mixed_precision
        blocks = [m for m in model.modules() if block_classes and isinstance(m, block_classes) and m is not model]
        for block in blocks:
            fully_shard(block, **options)
        return fully_shard(model, **options)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        if (self._wraps and self.shardkit_plugin.strategy in ("zero1", "zero2")
                and not isinstance(optimizer, (ZeroRedundancyOptimizer, AcceleratedOptimizer))):
            optimizer = _as_zero(optimizer)
        if self._replaced_parameters and not isinstance(optimizer, AcceleratedOptimizer):
            _swap_parameters(optimizer, self._replaced_parameters)
        return super().prepare_optimizer(optimizer, device_placement)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, FullyShardedDataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    # --- training ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if self._wraps and self.shardkit_plugin.strategy == "fully_shard":
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
            return
        with super().no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        parameters = list(parameters)
        if self._wraps:
            wanted = {id(p) for p in parameters if p.requires_grad}
            for model in self._models:
                if isinstance(model, FullyShardedDataParallel) and wanted == _trainable_ids(model):
                    self.unscale_gradients()
                    return model.clip_grad_norm_(max_norm, norm_type)
            for optimizer in self._optimizers:
                inner = getattr(optimizer, "optimizer", optimizer)
                if isinstance(inner, ZeroRedundancyOptimizer) and wanted and wanted <= _optimizer_ids(inner):
                    self.unscale_gradients()
                    return inner.clip_grad_norm_(max_norm, norm_type)
        norm = super().clip_grad_norm_(parameters, max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # fully_shard's DTensor norm

    # --- state -------------------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True):
        if self._state_dict_placeholder:
            return {}
        if not self._wraps:
            return super().get_state_dict(model, unwrap)
        if self.shardkit_plugin.strategy in ("fully_shard", "fsdp"):
            options = _state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = _state_dict.get_model_state_dict(model, options=options)
        else:
            state = super().get_state_dict(model, unwrap)
        if unwrap:
            # Gathered parameters are views of one unit's buffer, ZeRO's of one flat buffer per dtype: savers that
            # keep each storage once (safetensors, save_model) would keep one parameter of them. Each gets its
            # own storage; the names of one tied parameter share one.
            state = _share_tied(_own_storage(state), self.unwrap_model(model))
        return state

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any):
        if not (self._wraps and self.shardkit_plugin.strategy in SHARDED_STATE):
            return super().save_state(output_dir, safe_serialization, **kwargs)
        pairs = self._models_and_optimizers()

        def save_sharded(models: list, weights: list, directory: str) -> None:
            _checkpoint_save(_current_state(pairs), os.path.join(directory, CHECKPOINT_SUBDIR))
            weights.clear()  # accelerate writes no model files of its own

        with self._shardkit_handles_models_and_optimizers(self._save_model_state_pre_hook, save_sharded):
            return super().save_state(output_dir, safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any):
        if not (self._wraps and self.shardkit_plugin.strategy in SHARDED_STATE):
            return super().load_state(input_dir, load_kwargs, **kwargs)
        pairs = self._models_and_optimizers()

        def load_sharded(models: list, directory: str) -> None:
            _load_into(pairs, os.path.join(directory, CHECKPOINT_SUBDIR))
            models.clear()  # accelerate loads no model files of its own

        with self._shardkit_handles_models_and_optimizers(self._load_model_state_pre_hook, load_sharded):
            return super().load_state(input_dir, load_kwargs, **kwargs)

    @contextlib.contextmanager
    def _shardkit_handles_models_and_optimizers(self, hook_registry: dict, hook: Any) -> Iterator[None]:
        """Around accelerate's save_state / load_state: ``hook`` runs first among the model-state pre-hooks
        (accelerate passes it the resolved directory) and saves or loads the models and optimizers; accelerate
        sees no optimizers and no model weights, and does the rest (schedulers, RNG, samplers, objects)."""
        key = object()
        hook_registry[key] = hook
        hook_registry.move_to_end(key, last=False)
        optimizers, self._optimizers = self._optimizers, []
        self._state_dict_placeholder = True
        try:
            yield
        finally:
            hook_registry.pop(key, None)
            self._optimizers = optimizers
            self._state_dict_placeholder = False

    def _models_and_optimizers(self) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
        """Each prepared model with the prepared optimizer over its parameters (or None)."""
        optimizers = [(o, _optimizer_ids(o)) for o in (getattr(o, "optimizer", o) for o in self._optimizers)]
        pairs = []
        for model in self._models:
            params = {id(p) for p in model.parameters()}
            found = [o for o, ids in optimizers if ids and ids <= params]
            if len(found) > 1:
                raise NotImplementedError(f"shardkit Accelerator.save_state: {len(found)} optimizers over one model "
                                          f"({type(model).__name__}); one per model is supported")
            pairs.append((model, found[0] if found else None))
        return pairs


# --- helpers -------------------------------------------------------------------------------------------------
def _refuse_wrapped(model: nn.Module) -> None:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    wrappers = (TorchDDP, FullyShardedDataParallel, FSDPModule)
    found = next((m for m in model.modules() if isinstance(m, wrappers)), None)
    if found is not None:
        where = "the model is" if found is model else "a submodule is"
        raise ValueError(f"shardkit Accelerator.prepare: {where} already wrapped ({type(found).__name__}); pass the "
                         "plain model and choose the wrapping with ShardkitPlugin(strategy=...)")


def _block_classes(model: nn.Module, auto_wrap: tuple[type[nn.Module] | str, ...] | None) -> tuple[type, ...]:
    """``auto_wrap`` as classes: names are looked up among the model's modules' classes."""
    if not auto_wrap:
        return ()
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [c for c in auto_wrap if isinstance(c, str) and c not in present]
    if missing:
        raise ValueError(f"ShardkitPlugin(auto_wrap=...): no module of the {type(model).__name__} is a {missing}; its "
                         f"module classes are {sorted(present)}")
    return tuple(present[c] if isinstance(c, str) else c for c in auto_wrap)


def _register_comm_hook(model: DistributedDataParallel, plugin: ShardkitPlugin) -> None:
    if plugin.comm_hook == "fp16":
        model.register_comm_hook(None, _hooks.fp16_compress_hook)
    elif plugin.comm_hook == "bf16":
        model.register_comm_hook(None, _hooks.bf16_compress_hook)
    elif plugin.comm_hook == "powersgd":
        state = _hooks.PowerSGDState(process_group=None, matrix_approximation_rank=plugin.powersgd_rank)
        model.register_comm_hook(state, _hooks.powerSGD_hook)


def _as_zero(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """A ZeroRedundancyOptimizer over ``optimizer``'s parameters, with its class, groups and options."""
    if optimizer.state:
        raise ValueError(f"shardkit Accelerator.prepare: the {type(optimizer).__name__} already holds state; under "
                         "ZeRO it is rebuilt sharded, so prepare it before its first step")
    # Only the options the class's constructor takes (torch's AdamW keeps a `decoupled_weight_decay` default it
    # does not accept back); the groups keep every option, as the unsharded optimizer's would.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer([dict(group) for group in optimizer.param_groups], type(optimizer), **defaults)


def _swap_parameters(optimizer: torch.optim.Optimizer, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Points ``optimizer`` at the parameters that replaced the ones it was built over (fully_shard's DTensors)."""
    holds_old = any(id(p) in replaced for group in optimizer.param_groups for p in group["params"])
    if holds_old and optimizer.state:
        raise ValueError(f"shardkit Accelerator.prepare: the {type(optimizer).__name__} already holds state for "
                         "parameters that fully_shard replaced; prepare it before its first step")
    for group in optimizer.param_groups:
        group["params"] = [replaced[id(p)][1] if id(p) in replaced else p for p in group["params"]]


def _trainable_ids(model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters() if p.requires_grad}


def _optimizer_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _current_state(pairs: list[tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict[str, Any]:
    """The models' and optimizers' sharded state dicts, keyed model_i / optimizer_i (DCP's input)."""
    state: dict[str, Any] = {}
    for i, (model, optimizer) in enumerate(pairs):
        if optimizer is None:
            state[f"model_{i}"] = _state_dict.get_model_state_dict(model)
        else:
            state[f"model_{i}"], state[f"optimizer_{i}"] = _state_dict.get_state_dict(model, [optimizer])
    return state


def _load_into(pairs: list[tuple[nn.Module, torch.optim.Optimizer | None]], directory: str) -> None:
    """Loads what ``_current_state(pairs)`` saved in ``directory`` (at any world size) into the models and
    optimizers."""
    state = _current_state(pairs)
    _checkpoint_load(state, directory)
    for i, (model, optimizer) in enumerate(pairs):
        if optimizer is None:
            _state_dict.set_model_state_dict(model, state[f"model_{i}"])
        else:
            _state_dict.set_state_dict(model, [optimizer], model_state_dict=state[f"model_{i}"],
                                       optim_state_dict=state[f"optimizer_{i}"])


def _own_storage(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an OrderedDict, as torch's) with every tensor that is a view into a larger buffer copied out."""
    out = type(state)()
    for name, value in state.items():
        shares = isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes
        out[name] = value.detach().clone() if shares else value
    if hasattr(state, "_metadata"):
        out._metadata = state._metadata
    return out


def _share_tied(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
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


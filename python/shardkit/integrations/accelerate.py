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
  ``auto_wrap`` classes, then on the root), ``fsdp`` (the FSDP1 front), ``auto`` (one of ddp, zero2 and
  fully_shard, chosen by shardkit's memory math at the first ``prepare`` of a model: ``resolved_strategy``). The
  wrapping itself is ``shardkit.integrations._wrapping``'s, shared with the other integrations. The rest of
  accelerate's model preparation (device placement, autocast) runs as it would; a model already wrapped by
  shardkit or torch is refused, never wrapped twice.
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
  are accelerate's as always. ``ddp`` (replicated state) uses accelerate's own files. ``save_state(...,
  async_save=True)`` saves that state asynchronously (``accelerator.pending_checkpoint``, waited for by the next
  save_state / load_state or ``wait_for_checkpoint()``); accelerate's own files are written at once, as always.
- **accelerate's config file** chooses the strategy when no ``shardkit_plugin`` is given (an FSDP config: fully_shard
  or the FSDP1 front, its wrapping classes, ``reshard_after_forward``; see _launch_config.py), and a MULTI_CPU
  launch that started one process alone is refused with the command that starts N. Where ``accelerate launch
  --multi_gpu`` overrode an FSDP config file (accelerate then exports no FSDP setting), rank 0 warns that shardkit
  runs DDP.
- **mixed_precision** (``"bf16"`` / ``"fp16"``) as accelerate's own Accelerator takes it: ddp / zero1 / zero2 run the
  forward under accelerate's autocast (as its DDP); fully_shard casts through a ``MixedPrecisionPolicy`` in that
  dtype and adds no autocast (as its FSDP2 plugin); fsdp has both, autocast and the FSDP1 front's
  ``MixedPrecision`` (as its FSDP1 plugin); a ``mixed_precision`` given in the ShardkitPlugin wins. accelerate's
  autocast and placement come from its own ``prepare_model(evaluation_mode=True)``: everything but its wrapping.
  fp16 on a CPU is what accelerate makes of it: no autocast and no scaler (fully_shard / fsdp: the policy's casts).

Unsupported combinations raise, naming the feature: DeepSpeed / FSDP / Megatron plugins alongside a
ShardkitPlugin, an optimizer with state at ``prepare`` under ZeRO, ``strategy="auto"`` where only ZeRO-3 + CPU
offload would fit.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs
except ImportError as error:  # shardkit does not depend on accelerate
    raise ImportError("shardkit.integrations.accelerate needs Hugging Face accelerate (pip install accelerate; "
                      f"tested with 1.15.0): {error}") from error

from .. import _torch_compat
from .. import state_dict as _state_dict
from ..checkpoint import AsyncSave
from ..checkpoint import save as _checkpoint_save
from ..fsdp import FullyShardedDataParallel, MixedPrecision
from ..zero import ZeroRedundancyOptimizer
from . import _launch_config, _wrapping
from ._wrapping import SHARDED_STATE, STRATEGIES

__all__ = ["Accelerator", "ShardkitPlugin", "STRATEGIES", "SHARDED_STATE"]

CHECKPOINT_SUBDIR = "shardkit"  # inside accelerate's checkpoint directory
# What accelerate's own prepare_model would have wrapped the model in (shardkit wraps instead).
_TORCH_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.distributed.fsdp.FullyShardedDataParallel)
# accelerate's mixed_precision -> the dtype its FSDP plugins cast to (FullyShardedDataParallelPlugin's
# set_mixed_precision).
_MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclasses.dataclass
class ShardkitPlugin(_wrapping.WrapSpec):
    """How ``Accelerator.prepare`` wraps models.

    strategy: ``"ddp"`` (default), ``"zero1"``, ``"zero2"``, ``"fully_shard"``, ``"fsdp"`` (the FSDP1 front) or
        ``"auto"``: one of ddp, zero2 and fully_shard, chosen by shardkit's memory math (``shardkit.auto``'s) at the
        first ``prepare`` of a model, from the model's trainable parameters, their dtype and the optimizer's class
        (Adam-like, or SGD; Adam-like when no optimizer is prepared with the model) against ``memory_budget_gb``.
        The choice is ``resolved_strategy`` (None until then; the strategy itself otherwise), ``auto_plan`` the
        estimate behind it, and rank 0 logs both (logger ``shardkit.auto``). When only ZeRO-3 + CPU offload would
        fit, prepare raises: the integrations do not offload.
    comm_hook: ddp / zero1 / zero2 only: ``"fp16"``, ``"bf16"`` (shardkit's C++ compress hooks) or
        ``"powersgd"`` (rank ``powersgd_rank``); None: plain allreduce.
    auto_wrap: fully_shard / fsdp (and auto, if it chooses fully_shard): the block classes sharded as units of their
        own, as classes or class names (``{GPT2Block}`` or ``["GPT2Block"]``; a name that no module of the model has
        raises); None: the whole model is one unit (for auto: the classes held in the model's ModuleLists, as
        ``shardkit.auto``).
    mixed_precision: fully_shard: a ``torch.distributed.fsdp.MixedPrecisionPolicy``; fsdp: a
        ``shardkit.fsdp.MixedPrecision``. None: the parameters' dtype throughout.
    reshard_after_forward: fully_shard's argument (torch's default, True).
    memory_budget_gb: auto only: the memory per rank, in GB (10**9 bytes), the model states must fit
        (``shardkit.auto``'s argument); None: the device's free memory (CUDA), else the host's available memory
        divided by its ranks. Every rank uses the smallest of all ranks' budgets.
    """

    def __post_init__(self) -> None:
        self.check(type(self).__name__)


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

    # accelerate's attributes as this class uses them (accelerate's own types are not read by the type check).
    native_amp: bool
    _optimizers: list[Any]

    def __init__(self, *args: Any, shardkit_plugin: ShardkitPlugin | None = None, **kwargs: Any) -> None:
        for name in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(name) is not None:
                raise ValueError(f"shardkit Accelerator: {name} cannot be combined with shardkit's wrapping; "
                                 "choose the strategy with ShardkitPlugin")
        problem = _launch_config.launch_problem()
        if problem is not None:
            raise RuntimeError(f"shardkit Accelerator: {problem}")
        if shardkit_plugin is None:  # accelerate's config file, as `accelerate launch` exported it
            options = _launch_config.plugin_options()
            shardkit_plugin = ShardkitPlugin(**options) if options else None
            ignored = _launch_config.ignored_fsdp_config() if options is None else None
            if ignored is not None and os.environ.get("RANK", "0") == "0":  # once per job
                warnings.warn(ignored, UserWarning, stacklevel=2)
        for name in _launch_config.consumed():  # shardkit shards; accelerate must not build its own FSDP plugin
            os.environ[name] = "false"
        self.shardkit_plugin = shardkit_plugin or ShardkitPlugin()
        init = next((h for h in kwargs.get("kwargs_handlers") or () if isinstance(h, InitProcessGroupKwargs)), None)
        _ShardkitPartialState(cpu=bool(kwargs.get("cpu", False)), **(init.to_kwargs() if init else {}))
        super().__init__(*args, **kwargs)
        self._state_dict_placeholder = False  # inside save_state: the models' state is saved by shardkit
        self.pending_checkpoint: AsyncSave | None = None  # save_state(async_save=True)'s save, until waited for
        # fully_shard replaces each parameter by a sharded DTensor one; an optimizer built before prepare still
        # holds the old objects, so prepare_optimizer swaps them: id(old) -> (old, new), old kept alive.
        self._replaced_parameters: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self._optimizer_classes: list[type] = []  # of the optimizers prepared with the model: what auto counts

    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        self._optimizer_classes = [type(getattr(o, "optimizer", o)) for o in args
                                   if isinstance(o, torch.optim.Optimizer)]
        return super().prepare(*args, device_placement=device_placement)

    # --- preparation -------------------------------------------------------------------------------------
    @property
    def _wraps(self) -> bool:
        return self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if getattr(model, "_is_accelerate_prepared", False) or evaluation_mode or not self._wraps:
            return super().prepare_model(model, device_placement, evaluation_mode)
        _wrapping.refuse_wrapped(model, "shardkit Accelerator.prepare", "ShardkitPlugin(strategy=...)")
        strategy = _wrapping.resolve(self.shardkit_plugin, model, self._optimizer_classes, "ShardkitPlugin")
        # accelerate's placement, autocast and compile, without its wrapping: evaluation_mode is accelerate's own
        # switch for "everything but the distributed wrapper". (Making prepare_model see a one-process job does not
        # hold: under mixed precision it rebuilds AcceleratorState(), which copies the shared process state back.)
        # fully_shard is accelerate's FSDP2 path, which casts through the MixedPrecisionPolicy and adds no autocast.
        registered = len(self._models)  # accelerate registers the model it prepares there
        with self._without_autocast(strategy == "fully_shard"):
            model = super().prepare_model(model, device_placement, evaluation_mode=True)
        if isinstance(model, _TORCH_WRAPPERS) or len(self._models) != registered + 1:
            raise RuntimeError(f"shardkit Accelerator.prepare (rank {self.process_index}): accelerate "
                               f"{accelerate.__version__}'s prepare_model(evaluation_mode=True) wrapped or registered "
                               f"the model otherwise than 1.15 does ({type(model).__name__}); shardkit cannot wrap it")
        self._set_mixed_precision_policy(strategy)
        options = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        wrapped: Any
        wrapped, replaced = _wrapping.wrap(model, self.shardkit_plugin, "ShardkitPlugin", self.device, options)
        self._replaced_parameters.update(replaced)
        wrapped._is_accelerate_prepared = True
        self._models[registered] = wrapped
        return wrapped

    @contextlib.contextmanager
    def _without_autocast(self, skip: bool) -> Iterator[None]:
        """accelerate's prepare_model wraps the forward in autocast where ``native_amp`` is on; its FSDP2 path
        does not (the policy casts), so for fully_shard that step is skipped."""
        native_amp = self.native_amp
        self.native_amp = native_amp and not skip
        try:
            yield
        finally:
            self.native_amp = native_amp

    def _set_mixed_precision_policy(self, strategy: str) -> None:
        """``mixed_precision="bf16"`` / ``"fp16"`` on the sharding strategies, as accelerate's FSDP plugins take it:
        where the plugin has no ``mixed_precision`` of its own, parameters and gradient reductions in that dtype
        (fully_shard: torch's ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype)``; fsdp: the FSDP1
        front's ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``, besides accelerate's autocast, as
        accelerate's FSDP1 path has both). ddp / zero1 / zero2 get accelerate's autocast, as its DDP does."""
        dtype = _MIXED_PRECISION_DTYPES.get(self.state.mixed_precision)
        plugin = self.shardkit_plugin
        if dtype is None or plugin.mixed_precision is not None or strategy not in _wrapping.UNIT_STRATEGIES:
            return
        if strategy == "fully_shard":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            plugin.mixed_precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
        else:
            plugin.mixed_precision = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        if (self._wraps and self.shardkit_plugin.resolved_strategy in ("zero1", "zero2")
                and not isinstance(optimizer, (ZeroRedundancyOptimizer, AcceleratedOptimizer))):
            optimizer = _wrapping.as_zero(optimizer, "shardkit Accelerator.prepare")
        if self._replaced_parameters and not isinstance(optimizer, AcceleratedOptimizer):
            _wrapping.swap_parameters(optimizer, self._replaced_parameters, "shardkit Accelerator.prepare")
        return super().prepare_optimizer(optimizer, device_placement)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, FullyShardedDataParallel):
            model = model.module
        model = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        # With dynamo_backend, accelerate compiles the model before shardkit wraps it (accelerate's own DDP compiles
        # its wrapper), so the compiled module lies inside the wrapper, where accelerate's unwrapping does not look.
        original = None if keep_torch_compile else _torch_compat.compiled_module_original(model)
        if original is not None:
            model = original
        return model

    # --- training ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        context = _wrapping.no_gradient_sync if self._wraps else super().no_sync
        with context(model):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        parameters = list(parameters)
        clip = _wrapping.sharded_clip(parameters, self._models, self._optimizers) if self._wraps else None
        if clip is not None:
            self.unscale_gradients()
            return clip(max_norm, norm_type)
        return _wrapping.plain_norm(super().clip_grad_norm_(parameters, max_norm, norm_type))

    # --- state -------------------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True):
        if self._state_dict_placeholder:
            return {}
        if not self._wraps:
            return super().get_state_dict(model, unwrap)
        if self.shardkit_plugin.resolved_strategy in _wrapping.UNIT_STRATEGIES:
            options = _state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = _state_dict.get_model_state_dict(model, options=options)
        else:
            state = super().get_state_dict(model, unwrap)
        if unwrap and state:
            # Gathered parameters are views of one unit's buffer, ZeRO's of one flat buffer per dtype: savers that
            # keep each storage once (safetensors, save_model) would keep one parameter of them. On the main
            # process, which saves, each gets its own storage (the others keep the views: a whole copy of the
            # model per rank for nothing); the names of one tied parameter share one.
            if self.is_main_process:
                state = _wrapping.own_storage(state)
            state = _wrapping.share_tied(state, self.unwrap_model(model))
        return state

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, *, async_save: bool = False,
                   **kwargs: Any):
        """accelerate's save_state; the sharded strategies' models and optimizers through shardkit.checkpoint.
        ``async_save=True`` (sharded strategies): their state is staged and saved by shardkit's checkpoint writer
        while training goes on; the handle is ``pending_checkpoint`` (``result()`` waits for it). The next
        save_state or load_state waits for it first (raising its CheckpointSaveError), so accelerate's clean-up of
        old checkpoint directories never meets a save in flight. Other strategies ignore ``async_save``."""
        self.wait_for_checkpoint()
        if not (self._wraps and self.shardkit_plugin.resolved_strategy in SHARDED_STATE):
            return super().save_state(output_dir, safe_serialization, **kwargs)
        pairs = self._models_and_optimizers()

        def save_sharded(models: list, weights: list, directory: str) -> None:
            target = os.path.join(directory, CHECKPOINT_SUBDIR)
            if async_save:
                self.pending_checkpoint = _checkpoint_save(_wrapping.current_state(pairs), target, async_save=True)
            else:
                _checkpoint_save(_wrapping.current_state(pairs), target)
            weights.clear()  # accelerate writes no model files of its own

        with self._shardkit_handles_models_and_optimizers(self._save_model_state_pre_hook, save_sharded):
            return super().save_state(output_dir, safe_serialization, **kwargs)

    def wait_for_checkpoint(self, timeout: float | None = None) -> None:
        """Waits for ``save_state(async_save=True)``'s save (if any), raising its CheckpointSaveError (or
        TimeoutError after ``timeout`` seconds, the save going on; a failed save is raised once)."""
        pending, self.pending_checkpoint = self.pending_checkpoint, None
        if pending is None:
            return
        try:
            pending.result(timeout)
        except TimeoutError:
            self.pending_checkpoint = pending  # still in flight
            raise

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any):
        self.wait_for_checkpoint()
        if not (self._wraps and self.shardkit_plugin.resolved_strategy in SHARDED_STATE):
            return super().load_state(input_dir, load_kwargs, **kwargs)
        pairs = self._models_and_optimizers()

        def load_sharded(models: list, directory: str) -> None:
            _wrapping.load_into(pairs, os.path.join(directory, CHECKPOINT_SUBDIR))
            models.clear()  # accelerate loads no model files of its own

        with self._shardkit_handles_models_and_optimizers(self._load_model_state_pre_hook, load_sharded):
            return super().load_state(input_dir, load_kwargs, **kwargs)

    @contextlib.contextmanager
    def _shardkit_handles_models_and_optimizers(self, hook_registry: collections.OrderedDict,
                                                hook: Any) -> Iterator[None]:
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
        optimizers = [(o, _wrapping.optimizer_ids(o)) for o in (getattr(o, "optimizer", o) for o in self._optimizers)]
        pairs = []
        for model in self._models:
            params = {id(p) for p in model.parameters()}
            found = [o for o, ids in optimizers if ids and ids <= params]
            if len(found) > 1:
                raise NotImplementedError(f"shardkit Accelerator.save_state: {len(found)} optimizers over one model "
                                          f"({type(model).__name__}); one per model is supported")
            pairs.append((model, found[0] if found else None))
        return pairs

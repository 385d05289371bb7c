"""shardkit in Lightning: ``ShardkitStrategy``, a Lightning strategy that wraps with shardkit's fronts.

    from shardkit.integrations.lightning import ShardkitStrategy

    trainer = lightning.pytorch.Trainer(strategy=ShardkitStrategy("fully_shard", auto_wrap={Block}), devices=4)
    trainer.fit(model, loader)

``ShardkitStrategy(strategy, comm_hook=None, powersgd_rank=1, auto_wrap=None, mixed_precision=None,
reshard_after_forward=True, memory_budget_gb=None, **ddp_options)`` is Lightning's ``DDPStrategy`` (a subclass,
tested with lightning 2.6.6) on the ``shardkit`` process group, with the model wrapped by shardkit's fronts as
accelerate's ``ShardkitPlugin`` wraps it (the same code: ``shardkit.integrations._wrapping``):

- ``"ddp"`` (default), ``"zero1"`` / ``"zero2"``: shardkit's DDP with ``zero_stage``; under ZeRO the optimizers
  ``configure_optimizers`` returns become ``ZeroRedundancyOptimizer``s of the same class, groups and options, and
  their LR schedulers are pointed at them. ``comm_hook`` (``"fp16"``, ``"bf16"``, ``"powersgd"``) is shardkit's;
  the remaining keyword arguments are DDP's (``find_unused_parameters``, ``bucket_cap_mb``, ...) and Lightning's
  (``timeout``, ``start_method``, ``cluster_environment``, ...).
- ``"fully_shard"``: ``shardkit.fully_shard`` on every module of the ``auto_wrap`` classes (classes or class
  names), then on the LightningModule itself; ``mixed_precision`` is a ``MixedPrecisionPolicy``. Each step goes
  through the LightningModule's ``forward`` hooks (Lightning's forward redirection), so the root unit gathers and
  frees its parameters as FSDP2 expects.
- ``"auto"``: ddp, zero2 or fully_shard, chosen by shardkit's memory math (``shardkit.auto``'s) when fit sets the
  model up, from its trainable parameters, their dtype and the classes of the optimizers ``configure_optimizers``
  returns, against ``memory_budget_gb`` (GB per rank; None: the device's free memory, or the host's available
  memory over its ranks; the smallest over the ranks wins, so every rank chooses alike). ``resolved_strategy``
  says what it chose; rank 0 logs why (logger ``shardkit.auto``). Where only ZeRO-3 + CPU offload would fit, fit
  raises.
- ``"fsdp"`` (the FSDP1 front) is refused: Lightning's own FSDP2 strategy (``ModelParallelStrategy``) and this one
  lead with ``fully_shard``.

Where Lightning's API leaves the choice to the strategy:

- **Set-up order.** ``configure_optimizers`` runs on the plain LightningModule, then the model is wrapped and the
  optimizers converted (ZeRO) or pointed at fully_shard's sharded parameters, as accelerate's ``prepare`` does with
  an optimizer built before it: ``auto`` needs the optimizer's class before it can choose.
- **Gradient clipping** (``gradient_clip_val``) clips by the global norm on every strategy. Lightning clips in the
  precision plugin over ``optimizer.param_groups`` with ``torch.nn.utils.clip_grad_norm_``, which under ZeRO-2
  would see no gradients (they live in shards) and under ZeRO-1 would do redundant work; the strategy's precision
  plugin (whichever Lightning chose) therefore clips through the ZeroRedundancyOptimizer's ``clip_grad_norm_``
  (the norm from the shards). fully_shard's DTensor gradients give torch's function the global norm as they are.
  ``gradient_clip_algorithm="value"`` under zero2 is refused (its gradients are not in ``.grad``).
- **Accumulation** (``accumulate_grad_batches``): Lightning's ``block_backward_sync`` keeps the gradients local
  (``no_sync`` for DDP and ZeRO, ``set_requires_gradient_sync(False)`` for fully_shard).
- **Checkpoints are Lightning's single ``.ckpt`` file, the whole state gathered on rank 0** (what ``DDPStrategy``
  writes): ``state_dict`` holds the LightningModule's full weights under its own names, ``optimizer_states`` each
  optimizer's unsharded state keyed by parameter index (torch's own format; ZeRO consolidates its shards to rank
  0, fully_shard's are gathered with ``get_optimizer_state_dict(full_state_dict=True)``). Chosen over a sharded
  directory because it is what Lightning users and tools expect (``LightningModule.load_from_checkpoint``,
  ``Trainer.fit(ckpt_path=...)``, ``ModelCheckpoint``'s files), and because it is independent of the world size
  and of the strategy: a checkpoint resumes at any world size, under any of the strategies (ZeRO and fully_shard
  keep their share of it on load). The cost: the whole model and optimizer state pass through rank 0's host
  memory; for models that do not fit there, save with ``shardkit.checkpoint`` (sharded, as the accelerate
  integration's ``save_state`` does). Asynchronous saves are Lightning's own ``AsyncCheckpointIO`` plugin, which
  needs nothing from the strategy: in lightning 2.6.6 it clones every tensor of the checkpoint on the calling
  thread (after the gathering above) and its thread only runs the wrapped CheckpointIO's ``save_checkpoint``
  on rank 0 (no collective there), so the file holds the state of its step (tests/python/test_lightning.py).
- **After fit** the LightningModule holds the trained weights: plain tensors for ddp and ZeRO, DTensor shards
  for fully_shard (FSDP2 cannot be undone in place; ``.full_tensor()`` or ``lightning_module_state_dict()`` gives
  them whole).
- **validate / test / predict** run on the model fit left. ddp and ZeRO (and auto before a fit has chosen) do as
  ``DDPStrategy`` does: the plain module (fit's DDP is unwrapped at teardown), rank 0's state broadcast.
  fully_shard evaluates the sharded module as it is (no broadcast, no re-wrapping); a fresh module is sharded as
  fit would shard it (ModelParallelStrategy's ``configure_model`` shards in every stage) and stays sharded, so a
  later ``fit`` with the same strategy trains it on. Under fully_shard the loops run under ``torch.no_grad``, not
  ``inference_mode`` (Lightning does the same for its FSDPStrategy). ``ckpt_path=`` ("best", a file) loads the
  file's whole weights into the shards.

Registers nothing global: pass the instance, ``Trainer(strategy=ShardkitStrategy(...))``. Refused, naming the
feature: an unknown strategy, ``"fsdp"``, Lightning's DDP comm-hook arguments (``ddp_comm_hook`` & co.: use
``comm_hook``), another ``process_group_backend``, a LightningModule already wrapped by torch or shardkit.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as error:  # shardkit does not depend on Lightning
    raise ImportError("shardkit.integrations.lightning needs Lightning (pip install lightning; tested with 2.6.6): "
                      f"{error}") from error

from .. import _torch_compat
from .. import state_dict as _state_dict
from ..ddp import DistributedDataParallel
from ..zero import ZeroRedundancyOptimizer
from . import _wrapping

__all__ = ["ShardkitStrategy", "STRATEGIES"]

STRATEGIES = ("ddp", "zero1", "zero2", "fully_shard")  # and "auto"
_OWNER = "ShardkitStrategy"
_LIGHTNING_COMM_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class ShardkitStrategy(DDPStrategy):
    """Lightning's DDPStrategy on shardkit's process group, wrapping with shardkit's fronts (see the module
    docstring). ``strategy``: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"fully_shard"`` or ``"auto"``."""

    strategy_name = "shardkit"
    # Lightning's Strategy attributes as this class uses them (Lightning's own types are not read by the type check).
    model: Any
    optimizers: list[Any]
    _precision_plugin: Precision | None

    def __init__(self, strategy: str = "ddp", comm_hook: str | None = None, powersgd_rank: int = 1,
                 auto_wrap: Any = None, mixed_precision: Any = None, reshard_after_forward: bool | int = True,
                 memory_budget_gb: float | None = None, **kwargs: Any) -> None:
        if strategy == "fsdp":
            raise ValueError(f"{_OWNER}: strategy='fsdp' (shardkit's FSDP1 front) is not offered under Lightning; use "
                             "strategy='fully_shard' (FSDP2's API, as Lightning's ModelParallelStrategy)")
        given = [name for name in _LIGHTNING_COMM_HOOK_ARGUMENTS if kwargs.get(name) is not None]
        if given:
            raise ValueError(f"{_OWNER}: {given[0]}={kwargs[given[0]]!r} is Lightning's torch-DDP comm hook; choose "
                             "shardkit's with comm_hook='fp16' | 'bf16' | 'powersgd'")
        backend = kwargs.pop("process_group_backend", "shardkit")
        if backend != "shardkit":
            raise ValueError(f"{_OWNER}: process_group_backend must be 'shardkit', got {backend!r} (for another "
                             "backend use Lightning's DDPStrategy)")
        self.spec = _wrapping.WrapSpec(strategy, comm_hook, powersgd_rank, auto_wrap, mixed_precision,
                                       reshard_after_forward, memory_budget_gb)
        self.spec.check(_OWNER, STRATEGIES)
        self._sharded: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the LightningModules fully_shard sharded
        super().__init__(process_group_backend="shardkit", **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Nothing: no name in Lightning's strategy registry (``DDPStrategy`` registers its own names)."""

    @property
    def resolved_strategy(self) -> str | None:
        """The strategy the model is wrapped with: ``strategy``, or what ``"auto"`` chose (None before fit)."""
        return self.spec.resolved_strategy

    # --- the precision plugin clips --------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = _clipping_from_shards(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _clipping_from_shards(plugin)

    # --- set-up ------------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return self._setup_for_evaluation(trainer)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)  # over the plain module's parameters: auto counts the optimizers' classes
        self._wrap()
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)
        _evaluate_under_no_grad(trainer, self.model)

    def _setup_for_evaluation(self, trainer: pl.Trainer) -> None:
        """validate / test / predict. fully_shard: on the sharded model a fit left (no re-wrapping, no broadcast of
        its shards), or a fresh model sharded as fit shards it (what ModelParallelStrategy's ``configure_model`` does
        in every stage), and kept sharded for a later fit. ddp, zero1, zero2, and auto before any fit has chosen
        (auto needs the optimizers): DDPStrategy's way, the plain module (fit's DDP is unwrapped at teardown) with
        rank 0's state broadcast."""
        assert self.accelerator is not None and self.model is not None
        fresh = not self._sharded_here(self.model)
        if fresh and self.spec.resolved_strategy != "fully_shard":
            return super().setup(trainer)
        self.accelerator.setup(trainer)
        if fresh:
            _wrapping.refuse_wrapped(self.model, _OWNER, "ShardkitStrategy(strategy=...)")
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.model, _ = _wrapping.wrap(self.model, self.spec, _OWNER, self.root_device, self._ddp_kwargs)
            self._sharded.add(self.model)
        self.model_to_device()
        self.setup_precision_plugin()
        _evaluate_under_no_grad(trainer, self.model)
        return None

    def _sharded_here(self, model: nn.Module) -> bool:
        """Whether ``model`` is a LightningModule this strategy sharded (fully_shard wraps in place: after fit, and
        after an evaluation that sharded it, the module Lightning hands back is the sharded one)."""
        return _fully_sharded(model) and model in self._sharded

    def _wrap(self) -> None:
        """Wraps the model as the (resolved) strategy says; the optimizers follow (ZeRO, fully_shard's
        parameters), and their LR schedulers with them. A module this strategy already sharded (an earlier fit or
        evaluation) stays as it is: the optimizers were built over its sharded parameters."""
        if self._sharded_here(self.model):
            return
        _wrapping.refuse_wrapped(self.model, _OWNER, "ShardkitStrategy(strategy=...)")
        _wrapping.resolve(self.spec, self.model, [type(o) for o in self.optimizers], _OWNER)
        self.model, replaced = _wrapping.wrap(self.model, self.spec, _OWNER, self.root_device, self._ddp_kwargs)
        if _fully_sharded(self.model):
            self._sharded.add(self.model)
        optimizers = []
        for optimizer in self.optimizers:
            if self.spec.resolved_strategy in ("zero1", "zero2"):
                zero = _wrapping.as_zero(optimizer, _OWNER)
                for config in self.lr_scheduler_configs:
                    if getattr(config.scheduler, "optimizer", None) is optimizer:
                        _point_scheduler_at(config.scheduler, zero)
                optimizer = zero
            elif replaced:
                _wrapping.swap_parameters(optimizer, replaced, _OWNER)
            optimizers.append(optimizer)
        self.optimizers = optimizers

    # --- steps: fully_shard's root unit runs its hooks ----------------------------------------------------------
    def _step(self, name: str, context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """Under fully_shard the LightningModule is itself the root unit, so a step that called ``training_step``
        directly (Strategy's way when the model is not wrapped in another module) would skip the root's
        forward hooks (lazy init, gathering the root's parameters): the step goes through ``forward``."""
        with context():
            return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _fully_sharded(self.model):
            return super().training_step(*args, **kwargs)
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _fully_sharded(self.model):
            return super().validation_step(*args, **kwargs)
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _fully_sharded(self.model):
            return super().test_step(*args, **kwargs)
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _fully_sharded(self.model):
            return super().predict_step(*args, **kwargs)
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with _wrapping.no_gradient_sync(self.model):
            yield

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            # Unwrapped here: DDPStrategy's teardown would first ask torch's reducer about static graphs, which
            # shardkit's DDP (a torch DDP subclass with its own reducer) does not have.
            self.model = self.lightning_module
        super().teardown()

    # --- checkpoints: one file, the whole state on rank 0 ------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's whole weights on rank 0 (a collective under fully_shard: every rank calls it, as
        Lightning's ``save_checkpoint`` does)."""
        if _fully_sharded(self.model):
            options = _state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
            return _state_dict.get_model_state_dict(self.model, options=options)
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The checkpoint's whole weights into the LightningModule; a sharded one (``ckpt_path`` after a fully_shard
        fit: Lightning restores before ``setup``) keeps its share of each (a collective: every rank restores)."""
        module = self.lightning_module
        if not _fully_sharded(module) and self.spec.resolved_strategy != "fully_shard":
            return super().load_model_state_dict(checkpoint, strict)
        # fully_shard's files hold torch's canonical names (get_model_state_dict's: a compiled submodule's without
        # ``_orig_mod.``), so a module not sharded yet (Lightning restores before setup) loads them by that mapping.
        options = _state_dict.StateDictOptions(full_state_dict=True, strict=strict)
        _state_dict.set_model_state_dict(module, checkpoint["state_dict"], options=options)
        return None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's unsharded state keyed by parameter index, on rank 0 (``{}`` elsewhere for the sharded
        strategies; a collective for them)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if not _fully_sharded(self.model):
            return super().optimizer_state(optimizer)  # ZeRO: consolidate_state_dict to rank 0 (Lightning's way)
        options = _state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = _state_dict.get_optimizer_state_dict(self.model, optimizer, options=options)
        return _keyed_by_index(state) if self.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer keeps its share of the unsharded state (any world size, any strategy's checkpoint)."""
        if not _fully_sharded(self.model):
            return super().load_optimizer_state_dict(checkpoint)  # ZeroRedundancyOptimizer.load_state_dict cuts it
        options = _state_dict.StateDictOptions(full_state_dict=True)
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            _state_dict.set_optimizer_state_dict(self.model, optimizer, _keyed_by_name(saved, self.model, optimizer),
                                                 options=options)
        return None


# --- helpers ---------------------------------------------------------------------------------------------------

def _fully_sharded(model: Any) -> bool:
    """Whether ``model`` is sharded with fully_shard (an FSDPModule)."""
    return isinstance(model, FSDPModule)

def _evaluate_under_no_grad(trainer: pl.Trainer, model: nn.Module) -> None:
    """Under fully_shard, validate / test / predict run under ``torch.no_grad`` instead of ``torch.inference_mode``
    (Lightning's default, ``Trainer(inference_mode=True)``), as Lightning does for its FSDPStrategy (torch issue
    95957): FSDP2 allocates the unsharded parameters at the first forward, and if that forward runs under inference
    mode they are inference tensors, which the next training step's all-gather cannot write into (``Inplace update
    to inference tensor outside InferenceMode``)."""
    if isinstance(model, FSDPModule):
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False


class _ClippingFromShards(Precision):
    """Mixed into the strategy's precision plugin (whichever Lightning chose), where Lightning clips: by norm through
    ``_wrapping.sharded_clip`` (a ZeroRedundancyOptimizer's global norm from its shards) or torch's function."""

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        # Lightning's MixedPrecision refuses to clip for an optimizer whose step unscales ("fused"), which it reads
        # from _step_supports_amp_scaling: ZeRO-2 sets it only to refuse a GradScaler by name in step. Without a
        # scaler ("bf16-mixed") there is nothing to unscale: clip as the base plugin does (found by the matrix).
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, ZeroRedundancyOptimizer) and getattr(self, "scaler", None) is None:
            return Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        parameters = list(self.main_params(optimizer))
        clip = _wrapping.sharded_clip(parameters, (), (optimizer,))
        if clip is not None:
            clip(clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, ZeroRedundancyOptimizer) and inner.gradient_shards:
            raise ValueError(f"{_OWNER}(strategy='zero2') (rank {inner.rank}): gradient_clip_algorithm='value' "
                             f"(gradient_clip_val={clip_val!r}) is not supported: ZeRO-2's gradients live in shards, "
                             "not in .grad; clip by norm, or use zero1")
        super().clip_grad_by_value(optimizer, clip_val)


@functools.cache
def _with_clipping(cls: Any) -> type:
    return type(cls.__name__, (_ClippingFromShards, cls), {"__module__": cls.__module__,
                                                            "__qualname__": cls.__qualname__})


def _clipping_from_shards(plugin: Any) -> Any:
    """``plugin``, its class given the clipping above (Lightning builds the plugin; the strategy only receives
    it, so its class is extended in place rather than the plugin rebuilt)."""
    if not isinstance(plugin, _ClippingFromShards):
        plugin_class: Any = type(plugin)
        plugin.__class__ = _with_clipping(plugin_class)
    return plugin


def _point_scheduler_at(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Moves an LR scheduler built over the unsharded optimizer to ``optimizer`` (the ZeroRedundancyOptimizer that
    replaced it), and marks ``optimizer.step`` as torch's LRScheduler marks the optimizer it is built over (else it
    warns that ``optimizer.step()`` was overridden)."""
    scheduler.optimizer = optimizer
    _torch_compat.track_steps_for_lr_scheduler(optimizer)


def _keyed_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (torch's ``get_optimizer_state_dict``) keyed by parameter index in
    param-group order, as ``optimizer.state_dict()`` keys it."""
    if not state:
        return state
    index = {name: i for i, name in enumerate(n for group in state["param_groups"] for n in group["params"])}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                             for group in state["param_groups"]]}


_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module")  # torch.compile's, checkpoint_wrapper's


def _keyed_by_name(state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The reverse of ``_keyed_by_index`` for ``optimizer`` over ``model``'s parameters, by torch's canonical names
    (as ``get_optimizer_state_dict`` gives them: without a compiled submodule's ``_orig_mod`` or a checkpoint
    wrapper's ``_checkpoint_wrapped_module``)."""
    name_of = {id(p): ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)
               for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in state["param_groups"] for i in group["params"]]
    if len(saved) != len(names):
        raise ValueError(f"{_OWNER}: the checkpoint's optimizer state has {len(saved)} parameters, the "
                         f"{type(optimizer).__name__} has {len(names)}")
    name = dict(zip(saved, names))
    return {"state": {name[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [name[i] for i in group["params"]]}
                             for group in state["param_groups"]]}

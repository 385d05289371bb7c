"""shardkit in the Hugging Face Trainer: ``ShardkitTrainingArguments`` and ``Trainer`` (subclasses of transformers').

    from shardkit.integrations.transformers import ShardkitTrainingArguments, Trainer

    args = ShardkitTrainingArguments(output_dir="out", shardkit_strategy="fully_shard")
    Trainer(model=model, args=args, train_dataset=dataset).train()

On the command line (``HfArgumentParser``) the fields are ``--shardkit_strategy``, ``--shardkit_comm_hook``,
``--shardkit_powersgd_rank``, ``--shardkit_auto_wrap``, ``--shardkit_reshard_after_forward``,
``--shardkit_memory_budget_gb`` (``auto``'s budget per rank); ``--ddp_backend`` takes ``shardkit`` (its default
here). ``--shardkit_strategy auto`` chooses ddp, zero2 or fully_shard with shardkit's memory math when the Trainer
prepares the model (with its optimizer's class); ``trainer.accelerator.shardkit_plugin.resolved_strategy`` says
which, and rank 0 logs why (logger ``shardkit.auto``).

The Trainer runs on ``shardkit.integrations.accelerate.Accelerator``, so everything said there holds (the
process group, the wrapping, the global ``clip_grad_norm_``, ``no_sync`` during gradient accumulation). What the
Trainer itself needed:

- **The process state.** ``TrainingArguments`` builds accelerate's process state itself, with a backend accelerate
  refuses on CPU; ``ShardkitTrainingArguments`` builds shardkit's first and has transformers use it.
- **save_model** (and every checkpoint's model files) writes the whole model gathered from its shards, with the
  model's own names and tied weights once: a plain Hugging Face model directory that ``from_pretrained`` loads.
  transformers' own ``_save`` would save ``self.model.state_dict()``: fully_shard's DTensor shards, or ZeRO's
  parameters, which are views of one flat buffer and so look "shared" to safetensors. A collective for the
  sharded strategies: call it on every rank, as the Trainer does.
- **Checkpoints** of zero1, zero2, fully_shard and fsdp hold the optimizer state (and the model's, sharded) in
  ``shardkit/`` (``shardkit.checkpoint``, torch's DCP format), so ``resume_from_checkpoint`` works at another
  world size; the scheduler, RNG states and trainer state are transformers' files as always. ``ddp``'s replicated
  optimizer state keeps transformers' ``optimizer.pt``. The model files are read back by transformers before the
  model is wrapped (the whole model, at any world size).
- **auto_wrap.** fully_shard and fsdp (and auto, when it chooses fully_shard) shard the blocks named by
  ``shardkit_auto_wrap``, by default the model's ``_no_split_modules`` (as transformers' own FSDP does).

Refused, naming the feature: ``ddp_backend`` other than shardkit, ``fsdp`` / ``deepspeed`` arguments alongside the
shardkit fields, an unknown strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch

try:
    import transformers
    import transformers.trainer as _hf_trainer
    from accelerate.state import AcceleratorState
except ImportError as error:  # shardkit does not depend on transformers
    raise ImportError("shardkit.integrations.transformers needs Hugging Face transformers and accelerate "
                      f"(pip install transformers accelerate; tested with 5.23.0 and 1.15.0): {error}") from error

from .. import state_dict as _state_dict
from ..checkpoint import save as _checkpoint_save
from . import _wrapping
from . import accelerate as _accelerate

__all__ = ["ShardkitTrainingArguments", "Trainer"]

_SCHEDULER_NAME = "scheduler.pt"  # transformers' file names (trainer.py), which it does not export
_OPTIMIZER_NAME = "optimizer.pt"
_COMPILED_PREFIX = "_orig_mod."  # torch.compile's module: the compiled model's parameters are under it


@dataclasses.dataclass
class ShardkitTrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments`` with the shardkit backend and ``ShardkitPlugin``'s choices as fields."""

    ddp_backend: str | None = dataclasses.field(
        default="shardkit", metadata={"help": "The process group's backend: shardkit (CPU and CUDA).",
                                      "choices": ["shardkit"]})
    shardkit_strategy: str = dataclasses.field(
        default="ddp", metadata={"help": "How the model is wrapped: shardkit's DDP, ZeRO-1/2 (shardkit's DDP with "
                                         "a sharded optimizer), fully_shard, the FSDP1 front, or auto (ddp, zero2 or "
                                         "fully_shard, chosen by shardkit's memory math when the model is prepared).",
                                 "choices": [*_wrapping.STRATEGIES, _wrapping.AUTO]})
    shardkit_comm_hook: str | None = dataclasses.field(
        default=None, metadata={"help": "ddp / zero1 / zero2: compress gradients with shardkit's C++ hooks.",
                                "choices": ["fp16", "bf16", "powersgd"]})
    shardkit_powersgd_rank: int = dataclasses.field(
        default=1, metadata={"help": "PowerSGD's matrix approximation rank (shardkit_comm_hook=powersgd)."})
    shardkit_auto_wrap: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "fully_shard / fsdp: class names of the blocks sharded as units of their own "
                                        "(default: the model's _no_split_modules)."})
    shardkit_reshard_after_forward: bool = dataclasses.field(
        default=True, metadata={"help": "fully_shard: free each unit's gathered parameters after its forward."})
    shardkit_memory_budget_gb: float | None = dataclasses.field(
        default=None, metadata={"help": "auto: the memory per rank in GB (10**9 bytes) the model states must fit "
                                        "(default: the device's free memory, or the host's available memory over "
                                        "its ranks)."})

    def __post_init__(self) -> None:
        if self.ddp_backend not in (None, "shardkit"):
            raise ValueError(f"ShardkitTrainingArguments: ddp_backend must be 'shardkit', got {self.ddp_backend!r} "
                             "(use transformers' TrainingArguments for another backend)")
        super().__post_init__()
        for feature in ("fsdp", "deepspeed"):
            if getattr(self, feature, None):
                raise ValueError(f"ShardkitTrainingArguments: {feature}={getattr(self, feature)!r} cannot be combined "
                                 "with shardkit's wrapping; choose shardkit_strategy instead")
        self.shardkit_plugin(None)  # validates the shardkit fields now, not at train()

    def shardkit_plugin(self, model: torch.nn.Module | None) -> _accelerate.ShardkitPlugin:
        """The plugin these arguments describe, for ``model`` (whose ``_no_split_modules`` is auto_wrap's default)."""
        auto_wrap = self.shardkit_auto_wrap
        if auto_wrap is None and self.shardkit_strategy in (*_wrapping.UNIT_STRATEGIES, _wrapping.AUTO):
            auto_wrap = list(getattr(model, "_no_split_modules", None) or []) or None
        return _accelerate.ShardkitPlugin(strategy=self.shardkit_strategy, comm_hook=self.shardkit_comm_hook,
                                          powersgd_rank=self.shardkit_powersgd_rank, auto_wrap=auto_wrap,
                                          reshard_after_forward=self.shardkit_reshard_after_forward,
                                          memory_budget_gb=self.shardkit_memory_budget_gb)

    @cached_property
    def _setup_devices(self) -> torch.device:
        # transformers resets accelerate's process state and builds its own, with ddp_backend as the backend, which
        # accelerate refuses on CPU. shardkit's is built first, and transformers told to use the configured state.
        AcceleratorState._reset_state(reset_partial_state=True)
        _accelerate._ShardkitPartialState(cpu=self.use_cpu, timeout=timedelta(seconds=self.ddp_timeout))
        self.accelerator_config.use_configured_state = True  # transformers pops it while it reads it
        return transformers.TrainingArguments._setup_devices.func(self)


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` on shardkit (see the module docstring). Takes ``ShardkitTrainingArguments``."""

    def __init__(self, model: Any = None, args: ShardkitTrainingArguments | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        if args is None:
            args = ShardkitTrainingArguments(output_dir="tmp_trainer")  # transformers' default directory
        if not isinstance(args, ShardkitTrainingArguments):
            raise TypeError(f"shardkit Trainer: args must be ShardkitTrainingArguments, got {type(args).__name__} "
                            "(it carries the shardkit fields and builds shardkit's process group)")
        super().__init__(model, args, *rest, **kwargs)

    @property
    def _sharded_state(self) -> bool:
        plugin = self.accelerator.shardkit_plugin
        return self.accelerator._wraps and plugin.resolved_strategy in _wrapping.SHARDED_STATE

    def create_accelerator_and_postprocess(self) -> None:
        # transformers builds accelerate's Accelerator by its module-level name; shardkit's is built in its place,
        # with the arguments transformers chose.
        shardkit_accelerator = functools.partial(_accelerate.Accelerator,
                                                 shardkit_plugin=self.args.shardkit_plugin(self.model))
        with _module_attribute(_hf_trainer, "Accelerator", shardkit_accelerator):
            super().create_accelerator_and_postprocess()

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        # Evaluation runs self.model unwrapped (transformers: "no point in wrapping" under no_grad). fully_shard's
        # root hooks, under torch_compile, lie on the compiled module around it (accelerate compiles, then shardkit
        # shards), so the bare model would meet its root's sharded DTensor parameters; it evaluates the prepared
        # model instead, as transformers' own FSDP does.
        if (not training and model is self.model and self.model_wrapped is not model and self.accelerator._wraps
                and self.accelerator.shardkit_plugin.resolved_strategy == "fully_shard"):
            return self.model_wrapped
        return super()._wrap_model(model, training, dataloader)

    # --- the model's files ----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.accelerator.get_state_dict(self.model_wrapped)  # every rank: a collective when sharded
        # Under torch_compile the accelerator's model is the compiled module (names "_orig_mod.*"); the files hold
        # the model's own names, as transformers' _save of the uncompiled self.model writes them.
        state = {name.removeprefix(_COMPILED_PREFIX): value for name, value in state.items()}
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # --- the best model, at the end of training ----------------------------------------------------------------
    def _load_best_model(self) -> None:
        # transformers' own loads the best checkpoint's files with model.load_state_dict, which cannot copy plain
        # tensors into fully_shard's DTensors (and gives the wrapper's names to DDP / the FSDP1 front). The files
        # hold the whole model with the unwrapped model's names (save_model above); they are loaded through
        # shardkit.state_dict's set_model_state_dict, a full state dict, which every strategy takes. Every rank
        # reads the files, as transformers' own does.
        if not self.accelerator._wraps:
            return super()._load_best_model()
        checkpoint = self.state.best_model_checkpoint
        state = _read_model_files(checkpoint)
        if state is None:
            raise FileNotFoundError(f"shardkit Trainer (rank {self.args.process_index}): load_best_model_at_end: no "
                                    f"model files ({_hf_trainer.SAFE_WEIGHTS_NAME}, "
                                    f"{_hf_trainer.SAFE_WEIGHTS_INDEX_NAME} or {_hf_trainer.WEIGHTS_NAME}) in the best "
                                    f"checkpoint {checkpoint}")
        _hf_trainer.logger.info(f"Loading best model from {checkpoint} (score: {self.state.best_metric}).")
        state = _with_tied_names(state, self.accelerator.unwrap_model(self.model_wrapped))
        options = _state_dict.StateDictOptions(full_state_dict=True, strict=False)
        result = _state_dict.set_model_state_dict(self.model_wrapped, state, options=options)
        self._issue_warnings_after_load(result)

    # --- optimizer state --------------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._sharded_state:
            return super()._save_optimizer_and_scheduler(output_dir)
        pairs = self.accelerator._models_and_optimizers()
        _checkpoint_save(_wrapping.current_state(pairs), os.path.join(output_dir, _accelerate.CHECKPOINT_SUBDIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._sharded_state:
            return super()._load_optimizer_and_scheduler(checkpoint)
        directory = os.path.join(checkpoint, _accelerate.CHECKPOINT_SUBDIR)
        if not os.path.isdir(directory):
            has_optimizer_file = os.path.isfile(os.path.join(checkpoint, _OPTIMIZER_NAME))
            found = "an optimizer.pt" if has_optimizer_file else "no optimizer state"
            raise ValueError(f"shardkit Trainer (rank {self.args.process_index}): resuming "
                             f"shardkit_strategy={self.accelerator.shardkit_plugin.resolved_strategy!r} needs the "
                             f"sharded state in "
                             f"{directory}; {checkpoint} holds {found} (saved with another strategy?)")
        _wrapping.load_into(self.accelerator._models_and_optimizers(), directory)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER_NAME), weights_only=True))


def _read_model_files(directory: str) -> dict[str, torch.Tensor] | None:
    """The model state a checkpoint directory's Hugging Face model files hold (safetensors, one file or an index of
    several; else pytorch_model.bin, read with weights_only), on the CPU; None where it has none."""
    import json

    from safetensors.torch import load_file

    single = os.path.join(directory, _hf_trainer.SAFE_WEIGHTS_NAME)
    index = os.path.join(directory, _hf_trainer.SAFE_WEIGHTS_INDEX_NAME)
    pickled = os.path.join(directory, _hf_trainer.WEIGHTS_NAME)
    if os.path.isfile(single):
        return load_file(single, device="cpu")
    if os.path.isfile(index):
        with open(index) as file:
            files = sorted(set(json.load(file)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(os.path.join(directory, name), device="cpu"))
        return state
    if os.path.isfile(pickled):
        return torch.load(pickled, map_location="cpu", weights_only=True)
    return None


def _with_tied_names(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with every name of a tied parameter present (the files keep a tied weight once, under one of its
    names), so a strict full-state-dict load finds each."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for tied in names.values():
        present = next((n for n in tied if n in state), None)
        for name in tied:
            if present is not None and name not in state:
                state[name] = state[present]
    return state


@contextlib.contextmanager
def _module_attribute(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block (not thread-safe: the Trainer is built on one thread)."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)

"""The matrix's accelerate entry point: accelerate's training loop, on each front.

Sides: ``"torch"`` is accelerate's own ``Accelerator`` with torch's wrapper for the front, on the gloo default group:
its DDP (``cpu=True``) for ddp / zero1 / zero2, its ``FullyShardedDataParallelPlugin(fsdp_version=2)`` for
fully_shard and ``fsdp_version=1`` for fsdp (accelerate builds FSDP only on its MULTI_GPU path: a process state that
names gloo and MULTI_GPU, with ACCELERATE_TORCH_DEVICE=cpu, takes it on the CPU, as tests/python/test_accelerate.py
does). ``"shardkit"`` is ``shardkit.integrations.accelerate.Accelerator(shardkit_plugin=ShardkitPlugin(strategy=...))``
on shardkit's default group, as docs/integrations.md tells users. Both use the default group ``run_launch`` made.

Dimensions (each spelled as an accelerate user turns it on):
- precision: ``mixed_precision`` "no" (fp32), "bf16", "fp16" (on a CPU accelerate gives fp16 neither autocast nor a
  scaler: DDP computes in fp32, the FSDP plugins cast parameters to fp16);
- ac: none; ``inner`` (``torch.utils.checkpoint`` inside each block); ``wrapper`` (torch's ``checkpoint_wrapper`` on
  each block, before ``prepare``);
- accumulation: ``gradient_accumulation_steps`` 1 or 2, the loop under ``accelerator.accumulate(model)``;
- clip: ``accelerator.clip_grad_norm_(model.parameters(), 0.5)`` when gradients sync (the returned norm compared);
- compile: ``Accelerator(dynamo_backend=...)``, accelerate's own switch for ``torch.compile`` (backend ``aot_eager``,
  or SHARDKIT_MATRIX_COMPILE);
- after: ``eval`` (``model.eval()`` and a ``no_grad`` loss); ``full_sd`` (``accelerator.get_state_dict(model)``, then
  one more step: each value still readable and holding what it held, or the live parameter as torch's
  ``state_dict()`` aliases it); ``sharded`` (``accelerator.save_state``, then a fresh Accelerator and model
  ``load_state``: its next step equals the original's next step).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from .matrix_torch import STEPS, VOCAB, Block, batch, make_model

DIMENSIONS = {
    "front": ("ddp", "zero1", "zero2", "fully_shard", "fsdp"),
    "precision": ("fp32", "bf16", "fp16"),
    "ac": ("none", "inner", "wrapper"),
    "accumulation": (1, 2),
    "clip": (False, True),
    "compile": (False, True),
    "after": ("eval", "full_sd", "sharded"),
}

LR = 0.1
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(side: str, cell: dict[str, Any]):
    """A fresh Accelerator for the cell (accelerate's shared state reset first)."""
    _reset_accelerate()
    options: dict[str, Any] = dict(mixed_precision=MIXED_PRECISION[cell["precision"]],
                                   gradient_accumulation_steps=cell["accumulation"])
    if cell["compile"]:
        options["dynamo_backend"] = os.environ.get("SHARDKIT_MATRIX_COMPILE", "aot_eager")
    front = cell["front"]
    if side == "shardkit":
        from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

        plugin = ShardkitPlugin(strategy=front, auto_wrap={Block} if front in ("fully_shard", "fsdp") else None)
        return Accelerator(shardkit_plugin=plugin, **options)
    import accelerate

    if front in ("ddp", "zero1", "zero2"):
        return accelerate.Accelerator(cpu=True, **options)
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class GlooAsMultiGpu(PartialState):
        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return "gloo", DistributedType.MULTI_GPU

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # run_launch restores the environment after the side
    GlooAsMultiGpu()  # the default group exists: accelerate takes it
    version = 2 if front == "fully_shard" else 1
    # SHARDED_STATE_DICT: save_state writes DCP shards (FSDP1's full state dict with CPU offload crashes on the CPU).
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"],
                                            state_dict_type="SHARDED_STATE_DICT",
                                            **({"reshard_after_forward": True} if version == 2 else
                                               {"sharding_strategy": "FULL_SHARD", "use_orig_params": True}))
    return accelerate.Accelerator(fsdp_plugin=plugin, **options)


class Run:
    """One side's accelerator, prepared model and optimizer, and accelerate's loop."""

    def __init__(self, side: str, cell: dict[str, Any]) -> None:
        self.side, self.cell = side, cell
        self.accelerator = _accelerator(side, cell)
        model = make_model(cell)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))

    def step(self, step: int, rank: int, world: int) -> dict[str, float]:
        accelerator, accumulation = self.accelerator, self.cell["accumulation"]
        measured: dict[str, float] = {"loss": 0.0}
        for micro in range(accumulation):
            tokens, targets = batch(step, micro, accumulation, rank, world)
            with accelerator.accumulate(self.model):
                loss = self.loss(tokens, targets)
                accelerator.backward(loss)  # accelerate divides by gradient_accumulation_steps
                measured["loss"] += float(loss) / accumulation
                if self.cell["clip"] and accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(self.model.parameters(), 0.5)
                    measured["norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
        return measured

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model as the user gets it: ``accelerator.get_state_dict`` (a collective on the sharded
        fronts). torch's FSDP1 anchor reads it with torch's ``get_model_state_dict`` instead: accelerate's asks for
        CPU offload, which crashes torch's FSDP1 on the CPU (SIGSEGV)."""
        if self.side == "torch" and self.cell["front"] == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return self.accelerator.get_state_dict(self.model)

    def params(self, rank: int) -> dict[str, np.ndarray]:
        state = self.full_state()
        return {k: v.detach().float().clone().numpy() for k, v in state.items()} if rank == 0 else {}


def run_cell(side: str, cell: dict[str, Any], rank: int, world: int, directory: str) -> dict[str, Any]:
    try:
        run = Run(side, cell)
        measured: dict[str, Any] = {"loss": [], "norm": []}
        for step in range(STEPS):
            for key, value in run.step(step, rank, world).items():
                measured[key].append(value)
        if not measured["norm"]:
            del measured["norm"]
        # The model class a user's save_pretrained goes to (accelerate's own: the model, compiled or not).
        measured["unwrapped"] = type(run.accelerator.unwrap_model(run.model, keep_torch_compile=False)).__name__
        after = cell["after"]
        if after == "eval":
            run.model.eval()
            with torch.no_grad():
                tokens, targets = batch(STEPS, 0, 1, rank, world)
                measured["eval_loss"] = float(run.loss(tokens, targets))
            run.model.train()
            measured["params"] = run.params(rank)
        elif after == "full_sd":
            measured.update(_full_state_dict_after(run, rank, world))
        else:
            measured.update(_save_and_load_state(run, side, cell, rank, world, directory))
        return measured
    finally:
        _reset_accelerate()


def _full_state_dict_after(run: Run, rank: int, world: int) -> dict[str, Any]:
    """``get_state_dict``, then one more step, then its values read: each must have storage for its elements and
    hold either what it held when taken (a tensor of its own) or the parameter's value now (a live alias, as
    torch's ``state_dict()`` gives): never memory a front freed or reused."""
    state = run.full_state()
    taken = {k: v.detach().float().clone().numpy() for k, v in state.items()}
    run.step(STEPS, rank, world)
    now = run.params(0)  # every rank: a collective on the sharded fronts
    problems = []
    if rank == 0:
        for name, value in state.items():
            if value.numel() and value.untyped_storage().nbytes() < value.numel() * value.element_size():
                problems.append(f"{name}: storage of {value.untyped_storage().nbytes()} bytes")
                continue
            read = value.detach().float().numpy()
            if not (np.array_equal(read, taken[name]) or np.array_equal(read, now[name])):
                problems.append(f"{name}: neither the value taken nor the parameter's now")
    return {"full_sd": taken if rank == 0 else {}, "full_sd_problems": problems,
            "params": now if rank == 0 else {}}


def _save_and_load_state(run: Run, side: str, cell: dict[str, Any], rank: int, world: int,
                         directory: str) -> dict[str, Any]:
    """``save_state``; the original's next step; then a fresh Accelerator and model ``load_state`` and take the same
    step: the same loss and the same weights."""
    path = os.path.join(directory, "state")
    torch_fsdp1 = side == "torch" and cell["front"] == "fsdp"
    if torch_fsdp1:
        _dcp_round_trip(run, path, "save")
    else:
        run.accelerator.save_state(path)
    original = run.step(STEPS, rank, world)
    ahead = run.params(rank)
    fresh = Run(side, cell)
    if torch_fsdp1:
        _dcp_round_trip(fresh, path, "load")
    else:
        fresh.accelerator.load_state(path)
    resumed = fresh.step(STEPS, rank, world)
    behind = fresh.params(rank)
    same = ahead.keys() == behind.keys() and all(np.array_equal(ahead[k], behind[k]) for k in ahead)
    return {"resumed_loss": resumed["loss"], "resumed_as_original": bool(original == resumed and same),
            "params": ahead}


def _dcp_round_trip(run: Run, path: str, phase: str) -> None:
    """The FSDP1 anchor's save / load with torch's DCP (model and optimizer state dicts) instead of accelerate's
    ``save_state`` / ``load_state``: on the CPU accelerate's FSDP1 path cannot carry it (its FULL_STATE_DICT offloads
    to the CPU, which crashes torch's FSDP1 there; with SHARDED_STATE_DICT ``load_state`` restores the weights but
    leaves the root unit's SGD momentum as a fresh optimizer's: the next step differs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optimizer = run.optimizer.optimizer
    model = getattr(run.model, "_orig_mod", run.model)  # under dynamo_backend: torch.compile's module around FSDP
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if phase == "save":
        dcp.save(state, checkpoint_id=path)
        return
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

"""The matrix's plain-torch entry point: a training loop as torch's docs write it, on each front.

Sides: ``"torch"`` wraps with torch's own wrapper for the front (DDP for ddp / zero1 / zero2, FSDP2's
``fully_shard`` for fully_shard, FSDP1 for fsdp) on the gloo default group; ``"shardkit"`` with shardkit's
(``DistributedDataParallel(zero_stage=...)`` + ``ZeroRedundancyOptimizer`` for ZeRO, ``shardkit.fully_shard``, the
FSDP1 front) on shardkit's. Every setting is spelled the way each front's docs say (accumulation through
``no_sync`` / ``set_requires_gradient_sync``, clipping through the front's global-norm call, mixed precision through
autocast for DDP and the front's policy for the sharded fronts), so a difference is shardkit's.

Dimensions:
- precision: fp32; bf16 / fp16 (autocast + GradScaler(fp16) on DDP fronts; ``MixedPrecisionPolicy`` /
  ``MixedPrecision(param_dtype, reduce_dtype=float32)`` on the sharded fronts, a GradScaler for fp16);
- ac: none; ``inner`` (``torch.utils.checkpoint`` inside each block, non-reentrant); ``wrapper`` (torch's
  ``checkpoint_wrapper`` on each block, applied before wrapping);
- accumulation: 1 or 2 micro-batches per step;
- clip: off, or clipping to a global norm of 0.5 (the norm itself is compared too);
- compile: off, or ``torch.compile`` of the wrapped model (backend ``aot_eager`` in the pairwise run: dynamo and
  AOTAutograd, where the hooks meet compile; ``inductor`` in ``make matrix``, SHARDKIT_MATRIX_COMPILE);
- after: what follows training: ``eval`` (evaluation in ``eval()`` / ``no_grad``), ``full_sd`` (the full model
  state dict, checked to stay readable after one more step), ``sharded_sd`` (the sharded model + optimizer state
  saved with DCP / ``shardkit.checkpoint``, loaded into a fresh wrapped model, which then steps as the original).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

DIMENSIONS = {
    "front": ("ddp", "zero1", "zero2", "fully_shard", "fsdp"),
    "precision": ("fp32", "bf16", "fp16"),
    "ac": ("none", "inner", "wrapper"),
    "accumulation": (1, 2),
    "clip": (False, True),
    "compile": (False, True),
    "after": ("eval", "full_sd", "sharded_sd"),
}

DIM, VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 16, 32, 6, 8, 2, 0.1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Block(nn.Module):
    def __init__(self, inner_checkpoint: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.inner_checkpoint = inner_checkpoint

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner_checkpoint:
            return x + torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return x + self.body(x)


class TinyLM(nn.Module):
    def __init__(self, inner_checkpoint: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(inner_checkpoint) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, micro: int, accumulation: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of micro-batch ``micro`` of global step ``step``: the same global data at any world size."""
    g = torch.Generator().manual_seed(1000 * step + 10 * accumulation + micro)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH // accumulation, SEQ + 1), generator=g)
    share = GLOBAL_BATCH // accumulation // world
    mine = tokens[rank * share:(rank + 1) * share]
    return mine[:, :-1], mine[:, 1:]


def make_model(cell: dict[str, Any]) -> nn.Module:
    """The cell's TinyLM (seed 0), with its activation checkpointing: ``inner`` inside each block, ``wrapper``
    torch's ``checkpoint_wrapper`` on each block (before any front wraps it). Every entry point builds it here."""
    torch.manual_seed(0)
    model = TinyLM(inner_checkpoint=cell["ac"] == "inner")
    if cell["ac"] == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
    return model


# --- wrapping -------------------------------------------------------------------------------------------------
class Setup:
    """One side's wrapped model, optimizer and the front's calls, for one cell."""

    def __init__(self, side: str, cell: dict[str, Any]) -> None:
        self.side, self.front, self.cell = side, cell["front"], cell
        self.dtype = DTYPES.get(cell["precision"])
        self.model = self._wrap(make_model(cell))
        self.optimizer = self._optimizer()
        self.scaler = self._scaler()
        self.compiled = self.model
        if cell["compile"]:
            backend = os.environ.get("SHARDKIT_MATRIX_COMPILE", "aot_eager")
            self.compiled = torch.compile(self.model, backend=backend)

    def _wrap(self, model: nn.Module) -> nn.Module:
        front, ours = self.front, self.side == "shardkit"
        if front in ("ddp", "zero1", "zero2"):
            if ours:
                import shardkit

                return shardkit.DistributedDataParallel(model, zero_stage={"ddp": 0, "zero1": 1, "zero2": 2}[front])
            return nn.parallel.DistributedDataParallel(model)
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        if front == "fully_shard":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if ours:
                from shardkit import fully_shard
            else:
                from torch.distributed.fsdp import fully_shard
            policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32 if self.dtype else None)
            for block in blocks:
                fully_shard(block, mp_policy=policy)
            return fully_shard(model, mp_policy=policy)
        assert front == "fsdp", front
        if ours:
            import shardkit
            from shardkit.fsdp import MixedPrecision

            precision = MixedPrecision(param_dtype=self.dtype, reduce_dtype=torch.float32) if self.dtype else None
            return shardkit.FullyShardedDataParallel(model, auto_wrap_policy={Block}, mixed_precision=precision)
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        precision = MixedPrecision(param_dtype=self.dtype, reduce_dtype=torch.float32) if self.dtype else None
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=precision,
                                        use_orig_params=True, device_id=torch.device("cpu"))

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.side == "shardkit" and self.front in ("zero1", "zero2"):
            import shardkit

            return shardkit.ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.SGD, lr=LR,
                                                    momentum=0.9)
        return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)

    def _scaler(self):
        if self.cell["precision"] != "fp16":
            return None
        if self.front == "fsdp":  # FSDP1's sharded gradients: its scaler agrees on inf/nan across ranks
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # The group explicitly: the default argument is the WORLD group of the day the module was imported.
            return ShardedGradScaler("cpu", init_scale=2.0 ** 8, process_group=dist.group.WORLD)
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

    # --- the front's calls ----------------------------------------------------------------------------------
    def autocast(self):
        # DDP fronts compute in low precision under autocast; the sharded fronts through their policy.
        if self.dtype is not None and self.front in ("ddp", "zero1", "zero2"):
            return torch.autocast("cpu", dtype=self.dtype)
        return contextlib.nullcontext()

    def no_sync(self, last: bool):
        if self.front == "fully_shard":
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.model.no_sync()

    def clip(self, max_norm: float) -> float:
        if self.front == "fsdp":
            norm = self.model.clip_grad_norm_(max_norm)
        elif self.side == "shardkit" and self.front == "zero2":  # gradients live in the shards (docs/ddp.md)
            norm = self.optimizer.clip_grad_norm_(max_norm)
        else:
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.compiled(tokens)
            return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))

    def step(self, step: int, rank: int, world: int) -> dict[str, float]:
        accumulation = self.cell["accumulation"]
        total = 0.0
        for micro in range(accumulation):
            tokens, targets = batch(step, micro, accumulation, rank, world)
            with self.no_sync(last=micro == accumulation - 1):
                loss = self.loss(tokens, targets) / accumulation
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += float(loss)
        measured = {"loss": total}
        if self.cell["clip"]:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            measured["norm"] = self.clip(0.5)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        return measured

    # --- state dicts ----------------------------------------------------------------------------------------
    def _sd(self):
        if self.side == "shardkit":
            from shardkit import state_dict
            return state_dict
        from torch.distributed.checkpoint import state_dict
        return state_dict

    def full_options(self):
        """What users pass for a whole model on rank 0: ``cpu_offload=True``. Not to torch's FSDP1 anchor: on a CPU
        module its offloading post-hook crashes rank 0 now and then (SIGSEGV in _state_dict_utils.param_hook, torch
        2.13); without it every rank gets the whole model, the same values."""
        offload = not (self.side == "torch" and self.front == "fsdp")
        return self._sd().StateDictOptions(full_state_dict=True, cpu_offload=offload)

    def full_state(self, rank: int) -> dict[str, np.ndarray]:
        state = self._sd().get_model_state_dict(self.model, options=self.full_options())
        return {k: v.detach().float().clone().numpy() for k, v in state.items()} if rank == 0 else {}


def run_cell(side: str, cell: dict[str, Any], rank: int, world: int, directory: str) -> dict[str, Any]:
    setup = Setup(side, cell)
    measured: dict[str, Any] = {"loss": [], "norm": []}
    for step in range(STEPS):
        for key, value in setup.step(step, rank, world).items():
            measured[key].append(value)
    if not measured["norm"]:
        del measured["norm"]
    after = cell["after"]
    if after == "eval":
        setup.compiled.eval()
        with torch.no_grad():
            tokens, targets = batch(STEPS, 0, 1, rank, world)
            measured["eval_loss"] = float(setup.loss(tokens, targets))
        setup.compiled.train()
    elif after == "full_sd":
        measured.update(_full_state_dict_after(setup, rank, world))
    elif after == "sharded_sd":
        measured.update(_sharded_round_trip(setup, side, cell, rank, world, directory))
    measured["params"] = setup.full_state(rank)
    return measured


def _full_state_dict_after(setup: Setup, rank: int, world: int) -> dict[str, Any]:
    """The full state dict as a user keeps it: taken, then one more step, then read. Its values must still be
    readable tensors (no storage smaller than the tensor: a view into memory the front freed or reuses), and must
    clone (the crash of issue #37). What they held when taken is compared with the anchor's."""
    state = setup._sd().get_model_state_dict(setup.model, options=setup.full_options())
    taken = {k: v.detach().float().clone().numpy() for k, v in state.items()}
    setup.step(STEPS, rank, world)
    problems = []
    for name, value in state.items():
        if value.numel() and value.untyped_storage().nbytes() < value.numel() * value.element_size():
            problems.append(f"{name}: storage of {value.untyped_storage().nbytes()} bytes")
        else:
            value.clone()
    return {"full_sd": taken if rank == 0 else {}, "full_sd_problems": problems}


def _sharded_round_trip(setup: Setup, side: str, cell: dict[str, Any], rank: int, world: int,
                        directory: str) -> dict[str, Any]:
    """Sharded model + optimizer state saved, loaded into a freshly wrapped model; both then take the same step."""
    sd = setup._sd()
    path = os.path.join(directory, "checkpoint")
    model_sd, optim_sd = sd.get_state_dict(setup.model, setup.optimizer)
    if side == "shardkit":
        from shardkit import checkpoint
        checkpoint.save({"model": model_sd, "optim": optim_sd}, path)
    else:
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh = Setup(side, dict(cell, compile=False))
    model_sd, optim_sd = sd.get_state_dict(fresh.model, fresh.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if side == "shardkit":
        checkpoint.load(state, path)
    else:
        dcp.load(state, checkpoint_id=path)
    sd.set_state_dict(fresh.model, fresh.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if fresh.scaler is not None and setup.scaler is not None:
        fresh.scaler.load_state_dict(setup.scaler.state_dict())
    original = setup.step(STEPS, rank, world)["loss"]
    resumed = fresh.step(STEPS, rank, world)["loss"]
    ahead, behind = setup.full_state(rank), fresh.full_state(rank)
    same = ahead.keys() == behind.keys() and all(np.array_equal(ahead[k], behind[k]) for k in ahead)
    return {"resumed_loss": resumed, "resumed_as_original": bool(original == resumed and same)}

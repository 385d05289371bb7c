"""The matrix's Lightning entry point: a LightningModule and a ``Trainer`` as Lightning's docs write them.

Sides: ``"torch"`` is Lightning's own strategy for the front on the gloo default group: ``DDPStrategy`` for ddp /
zero1 / zero2, ``ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)`` (torch FSDP2, the
LightningModule's ``configure_model`` sharding each block, then the net, idempotently: every stage calls it) for
fully_shard, and ``DDPStrategy`` for fsdp too (Lightning's FSDPStrategy, torch FSDP1, refuses the CPU: "requires a
GPU accelerator"). ``"shardkit"`` is ``ShardkitStrategy(front)`` on shardkit's
default group, as docs/integrations.md tells users (``auto_wrap={Block}`` for fully_shard). ``ShardkitStrategy``
refuses ``"fsdp"`` by name (matrix.UNSUPPORTED). The default group is the one run_launch made: Lightning's
``_init_dist_connection`` keeps an existing one, and its teardown does not destroy it.

Dimensions (values as matrix.TOLERANCE names them; what a Lightning user writes for each):
- precision: fp32 ``Trainer(precision="32-true")``; bf16 ``"bf16-mixed"`` (Lightning's MixedPrecision plugin:
  autocast, parameters and reductions in fp32; ModelParallelStrategy takes it too); fp16 ``"16-mixed"`` for the
  DDP fronts, which Lightning itself turns into ``"bf16-mixed"`` on the CPU (with a warning; no scaler), and, for
  fully_shard, FSDP2's ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`` under ``"32-true"``
  (``configure_model``'s ``fully_shard(mp_policy=...)`` / ``ShardkitStrategy(mixed_precision=...)``):
  ModelParallelStrategy refuses ``"16-mixed"`` (ValueError: only 32-true, bf16-mixed, bf16-true, 16-true).
- ac: none; ``inner`` (``torch.utils.checkpoint`` inside each block); ``wrapper`` (torch's ``checkpoint_wrapper`` on
  each block, in the LightningModule's ``__init__``).
- accumulation: ``accumulate_grad_batches`` 1 or 2.
- clip: off, or ``gradient_clip_val=0.5`` (by norm). The norm before clipping is measured in
  ``on_before_optimizer_step`` (a clip to 1e30, which scales by 1: torch's function, or the
  ZeroRedundancyOptimizer's under zero2, whose gradients live in shards) and compared.
- compile: off, or ``torch.compile`` as Lightning documents it: of the LightningModule passed to ``fit`` for the DDP
  fronts (Lightning's ``from_compiled``: the ``*_step`` methods compiled), of the inner net in ``configure_model``
  after sharding for fully_shard (ModelParallelStrategy refuses a compiled LightningModule), in place
  (``self.net.compile()``: see configure_model). Backend ``aot_eager`` unless SHARDKIT_MATRIX_COMPILE says
  otherwise.
- after: ``validate`` (``trainer.validate`` after fit, val_loss synced), ``test`` (``trainer.test`` after fit),
  ``checkpoint`` (a ``ModelCheckpoint`` saving every epoch during fit -- a single file for DDPStrategy and
  ShardkitStrategy, a directory for ModelParallelStrategy -- then a fresh model and Trainer resuming from the first
  epoch's checkpoint with ``fit(ckpt_path=...)``: it must end as the uninterrupted fit ended).

Each fit is 2 epochs of one optimizer step each (``accumulation`` batches of a global 8 samples, reshuffled per
epoch by Lightning's DistributedSampler), SGD with momentum; measured: each batch's loss, the norms, the metric,
and the LightningModule's whole weights after fit (rank 0).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from .matrix_torch import LR, SEQ, VOCAB, Block, TinyLM

DIMENSIONS = {
    "front": ("ddp", "zero1", "zero2", "fully_shard", "fsdp"),
    "precision": ("fp32", "bf16", "fp16"),
    "ac": ("none", "inner", "wrapper"),
    "accumulation": (1, 2),
    "clip": (False, True),
    "compile": (False, True),
    "after": ("validate", "test", "checkpoint"),
}

GLOBAL_BATCH, EPOCHS = 8, 2
FLAGS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _tokens(count: int, seed: int) -> torch.utils.data.TensorDataset:
    tokens = torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())


def _precision(cell: dict[str, Any]) -> tuple[str, Any]:
    """(the Trainer's precision flag, the fully_shard MixedPrecisionPolicy or None) for the cell."""
    if cell["front"] == "fully_shard" and cell["precision"] == "fp16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return "32-true", MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return FLAGS[cell["precision"]], None


def _module_class():
    import lightning.pytorch as pl

    class LM(pl.LightningModule):
        def __init__(self, side: str, cell: dict[str, Any], policy: Any) -> None:
            super().__init__()
            self.side, self.cell, self.policy = side, cell, policy
            self.net = TinyLM(inner_checkpoint=cell["ac"] == "inner")
            if cell["ac"] == "wrapper":
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                    apply_activation_checkpointing,
                    checkpoint_wrapper,
                )

                apply_activation_checkpointing(self.net, checkpoint_wrapper_fn=checkpoint_wrapper,
                                               check_fn=lambda m: isinstance(m, Block))

        def configure_model(self) -> None:
            # Every stage calls it (fit, then validate / test): shard and compile once.
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if self.cell["front"] != "fully_shard":
                return
            if self.side == "torch" and not isinstance(self.net, FSDPModule):
                mesh = self.device_mesh["data_parallel"]
                extra = {} if self.policy is None else {"mp_policy": self.policy}
                for block in [m for m in self.net.modules() if isinstance(m, Block)]:
                    fully_shard(block, mesh=mesh, **extra)
                fully_shard(self.net, mesh=mesh, **extra)
            if self.cell["compile"] and self.net._compiled_call_impl is None:
                # In place (nn.Module.compile): ``self.net = torch.compile(self.net)`` renames the parameters
                # ``net._orig_mod.*``, and ModelParallelStrategy cannot resume its own checkpoint of that (its
                # loader's module.load_state_dict gets the names without ``_orig_mod``).
                self.net.compile(backend=os.environ.get("SHARDKIT_MATRIX_COMPILE", "aot_eager"))

        def _loss(self, batch) -> torch.Tensor:
            tokens, targets = batch
            logits = self.net(tokens)
            return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self._loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return LM


def _callback(measured: dict[str, Any]):
    import lightning.pytorch as pl

    class Measure(pl.Callback):
        """Each batch's loss; with clipping, the global gradient norm before Lightning clips."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            measured["loss"].append(float(outputs["loss"]))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if not measured.get("clipping"):
                return
            inner = getattr(optimizer, "_optimizer", optimizer)
            if hasattr(inner, "gradient_shards"):  # shardkit's ZeroRedundancyOptimizer: the norm from its shards
                norm = inner.clip_grad_norm_(1e30)
            else:
                norm = torch.nn.utils.clip_grad_norm_(
                    [p for group in inner.param_groups for p in group["params"] if p.grad is not None], 1e30)
            measured["norm"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))

    return Measure()


def _strategy(side: str, cell: dict[str, Any], world: int, policy: Any):
    front = cell["front"]
    if side == "shardkit":
        from shardkit.integrations.lightning import ShardkitStrategy

        if front == "fully_shard":
            return ShardkitStrategy(front, auto_wrap={Block}, mixed_precision=policy)
        return ShardkitStrategy(front)
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if front == "fully_shard":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
    return DDPStrategy(process_group_backend="gloo")


def _fit(side: str, cell: dict[str, Any], world: int, measured: dict[str, Any], checkpoints: str | None = None,
         ckpt_path: str | None = None):
    """(trainer, the LightningModule, what fit was given: it or its torch.compile) after one fit of the cell's
    settings; ``checkpoints``: a ModelCheckpoint's directory (one checkpoint per epoch), ``ckpt_path``: resume."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    flag, policy = _precision(cell)
    pl.seed_everything(0, verbose=False)
    module = _module_class()(side, cell, policy)
    fitted = module
    if cell["compile"] and cell["front"] != "fully_shard":
        fitted = torch.compile(module, backend=os.environ.get("SHARDKIT_MATRIX_COMPILE", "aot_eager"))
    callbacks: list = [_callback(measured)]
    checkpointing = checkpoints is not None
    if checkpointing:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, filename="{epoch}",
                                         save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=_strategy(side, cell, world, policy),
                         precision=flag, max_epochs=EPOCHS, accumulate_grad_batches=cell["accumulation"],
                         gradient_clip_val=0.5 if cell["clip"] else None, gradient_clip_algorithm="norm",
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=checkpointing, callbacks=callbacks, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(_tokens(GLOBAL_BATCH, 1), shuffle=True,
                                         batch_size=GLOBAL_BATCH // cell["accumulation"] // world)
    trainer.fit(fitted, loader, ckpt_path=ckpt_path)
    return trainer, module, fitted


def _weights(module: nn.Module, rank: int) -> dict[str, np.ndarray]:
    """The LightningModule's whole weights on rank 0 (DTensor shards gathered: a collective, every rank calls)."""
    whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone().numpy()
             for k, v in module.state_dict().items()}
    return whole if rank == 0 else {}


def run_cell(side: str, cell: dict[str, Any], rank: int, world: int, directory: str) -> dict[str, Any]:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # its notes, repeated per Trainer
    measured: dict[str, Any] = {"loss": [], "norm": [], "clipping": cell["clip"]}
    checkpoints = os.path.join(directory, "checkpoints") if cell["after"] == "checkpoint" else None
    trainer, module, fitted = _fit(side, cell, world, measured, checkpoints)
    del measured["clipping"]
    if not measured["norm"]:
        del measured["norm"]
    measured["params"] = _weights(module, rank)
    after = cell["after"]
    evaluation = torch.utils.data.DataLoader(_tokens(GLOBAL_BATCH, 2), batch_size=GLOBAL_BATCH // world)
    if after == "validate":
        measured["val_loss"] = float(trainer.validate(fitted, evaluation, verbose=False)[0]["val_loss"])
    elif after == "test":
        measured["test_loss"] = float(trainer.test(fitted, evaluation, verbose=False)[0]["test_loss"])
    elif after == "checkpoint":
        measured["checkpoints"] = sorted(os.listdir(checkpoints))
        resumed: dict[str, Any] = {"loss": [], "norm": [], "clipping": False}
        _, again, _ = _fit(side, cell, world, resumed, ckpt_path=os.path.join(checkpoints, "epoch=0.ckpt"))
        weights = _weights(again, rank)
        measured["resumed_loss"] = resumed["loss"]
        measured["resumed_as_original"] = bool(
            resumed["loss"] == measured["loss"][len(measured["loss"]) - len(resumed["loss"]):]
            and weights.keys() == measured["params"].keys()
            and all(np.array_equal(weights[k], measured["params"][k]) for k in weights))
    return measured

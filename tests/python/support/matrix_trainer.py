"""The matrix's Hugging Face Trainer entry point: ``Trainer(...).train()`` on each front, a tiny GPT-2.

Sides: ``"torch"`` is transformers' own ``Trainer`` and ``TrainingArguments(ddp_backend="gloo", use_cpu=True)`` on
the gloo default group; ``"shardkit"`` is ``shardkit.integrations.transformers``' ``Trainer`` and
``ShardkitTrainingArguments(shardkit_strategy=...)`` on shardkit's, as docs/integrations.md tells users. Both use the
default group ``run_launch`` made (accelerate's process state takes an initialised group as it is). The anchor is
the Trainer's torch DDP for ddp / zero1 / zero2 and for fsdp, and the Trainer's own FSDP2 (``fsdp="full_shard"``,
``fsdp_config={"version": 2}``) for fully_shard. Not the Trainer's FSDP1 for fsdp: on the CPU its full state dict
(save_model, every checkpoint) offloads to the CPU, which crashes torch's FSDP1 (SIGSEGV); with sharded checkpoints
instead it writes no model files ``from_pretrained`` or the best-model check can read, and ``resume_from_checkpoint``
does not continue as the uninterrupted run (measured: the weights after the resumed step differ).

Dimensions (each spelled as a Trainer user turns it on):
- precision: neither flag (fp32), ``bf16=True`` (with ``use_cpu=True``, which transformers asks for on a host
  without a GPU), ``fp16=True``;
- ac: none, or ``gradient_checkpointing=True``;
- accumulation: ``gradient_accumulation_steps`` 1 or 2;
- clip: ``max_grad_norm`` 0 (off) or 1.0 (the logged gradient norm compared);
- compile: ``torch_compile=True`` with ``torch_compile_backend`` ``aot_eager`` (or SHARDKIT_MATRIX_COMPILE);
- after: ``evaluate`` (``trainer.evaluate()``); ``save`` (``trainer.save_model``, then ``from_pretrained`` loads the
  directory with nothing missing, equal to the trained weights); ``best`` (``load_best_model_at_end`` with an
  evaluation and a checkpoint every step: the model ends as the best checkpoint's files); ``resume``
  (``resume_from_checkpoint`` of the step-1 checkpoint in a fresh Trainer ends where the uninterrupted run ended).

Each cell trains 2 optimizer steps (``max_steps=2``), 2 samples per rank per micro-batch, logging each step in
memory only (the losses and gradient norms compared; no printing, no reporting, no progress bar).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

DIMENSIONS = {
    "front": ("ddp", "zero1", "zero2", "fully_shard", "fsdp"),
    "precision": ("fp32", "bf16", "fp16"),
    "ac": ("none", "gradient_checkpointing"),
    "accumulation": (1, 2),
    "clip": (False, True),
    "compile": (False, True),
    "after": ("evaluate", "save", "best", "resume"),
}

VOCAB, SEQ, SAMPLES, PER_DEVICE, STEPS = 64, 8, 16, 2, 2


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def _dataset() -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _arguments(side: str, cell: dict[str, Any], output_dir: str, **overrides: Any):
    options: dict[str, Any] = dict(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=PER_DEVICE,
        per_device_eval_batch_size=PER_DEVICE, gradient_accumulation_steps=cell["accumulation"],
        max_grad_norm=1.0 if cell["clip"] else 0.0, learning_rate=1e-2, adam_epsilon=1e-4, seed=0,
        logging_strategy="steps", logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no",
        eval_strategy="no", dataloader_num_workers=0)
    # adam_epsilon: GPT-2's attention key bias has an exact gradient of zero (softmax ignores a shift per query), so
    # its computed gradient is rounding noise that Adam with a tiny epsilon turns into full-size steps.
    if cell["precision"] == "bf16":
        options.update(bf16=True, use_cpu=True)  # transformers asks for use_cpu with bf16 on a host without a GPU
    elif cell["precision"] == "fp16":
        options.update(fp16=True)
    if cell["ac"] == "gradient_checkpointing":
        options.update(gradient_checkpointing=True)
    if cell["compile"]:
        options.update(torch_compile=True,
                       torch_compile_backend=os.environ.get("SHARDKIT_MATRIX_COMPILE", "aot_eager"))
    options.update(overrides)
    if side == "shardkit":
        from shardkit.integrations.transformers import ShardkitTrainingArguments

        return ShardkitTrainingArguments(shardkit_strategy=cell["front"], **options)
    from transformers import TrainingArguments

    options.update(ddp_backend="gloo", use_cpu=True)
    if cell["front"] == "fully_shard":
        options.update(_torch_fsdp2())
    return TrainingArguments(**options)


def _torch_fsdp2() -> dict[str, Any]:
    """transformers' own FSDP2 (``fsdp="full_shard"``, ``fsdp_config={"version": 2}``) on gloo on the CPU: accelerate
    builds FSDP only on its MULTI_GPU path, so a process state that names gloo and MULTI_GPU
    (ACCELERATE_TORCH_DEVICE=cpu as its device) is configured first and the Trainer told to use it
    (``use_configured_state``), as tests/python/test_accelerate.py does for accelerate's own Accelerator."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    class GlooAsMultiGpu(PartialState):
        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return "gloo", DistributedType.MULTI_GPU

    _reset_accelerate()
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # run_launch restores the environment after the side
    GlooAsMultiGpu()  # the default group exists: accelerate takes it
    return dict(fsdp="full_shard", accelerator_config={"use_configured_state": True},
                fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                             "reshard_after_forward": True})


def _trainer(side: str, args, eval_dataset=None):
    from transformers.trainer_callback import PrinterCallback

    if side == "shardkit":
        from shardkit.integrations.transformers import Trainer
    else:
        from transformers import Trainer
    trainer = Trainer(model=_model(), args=args, train_dataset=_dataset(), eval_dataset=eval_dataset)
    trainer.remove_callback(PrinterCallback)  # the logs stay in trainer.state.log_history
    return trainer


def _params(trainer, rank: int) -> dict[str, np.ndarray]:
    """The whole model as the accelerator gives it (a collective on the sharded fronts: every rank calls it)."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    return {k: v.detach().float().clone().numpy() for k, v in state.items()} if rank == 0 else {}


def _logged(trainer) -> dict[str, list[float]]:
    history = trainer.state.log_history
    measured = {"loss": [entry["loss"] for entry in history if "loss" in entry]}
    norms = [entry["grad_norm"] for entry in history if entry.get("grad_norm") is not None]
    if norms:
        measured["norm"] = norms
    return measured



def tolerance(cell: dict[str, Any]) -> dict[str, float] | None:
    """The fsdp front's anchor here is the Trainer's DDP (its FSDP1 cannot save or resume on a CPU, see above). Under
    bf16 / fp16 shardkit's FSDP1 front casts the weights and the gradient reduction to that dtype, as accelerate's
    FSDP1 plugin does, while DDP's autocast keeps both in fp32: they agree to the low precision's resolution over the
    steps (measured up to 1.0e-2 in the weights), not closer. test_transformers.py allows the same."""
    if cell["front"] == "fsdp" and cell["precision"] != "fp32":
        return dict(rtol=2e-2, atol=2e-2)
    return None
def run_cell(side: str, cell: dict[str, Any], rank: int, world: int, directory: str) -> dict[str, Any]:
    try:
        return _run(side, cell, rank, world, directory)
    finally:
        _reset_accelerate()


def _run(side: str, cell: dict[str, Any], rank: int, world: int, directory: str) -> dict[str, Any]:
    after = cell["after"]
    output_dir = os.path.join(directory, "out")
    eval_dataset = _dataset()[:2 * PER_DEVICE * world] if after in ("evaluate", "best") else None
    overrides: dict[str, Any] = {}
    if after == "best":
        overrides = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                         load_best_model_at_end=True, metric_for_best_model="loss")
    elif after == "resume":
        overrides = dict(save_strategy="steps", save_steps=1)
    trainer = _trainer(side, _arguments(side, cell, output_dir, **overrides), eval_dataset)
    trainer.train()
    measured: dict[str, Any] = _logged(trainer)
    measured["params"] = _params(trainer, rank)
    if after == "evaluate":
        measured["eval_loss"] = float(trainer.evaluate()["eval_loss"])
    elif after == "save":
        measured.update(_saved(trainer, rank, os.path.join(directory, "final")))
    elif after == "best":
        measured.update(_best(trainer, rank))
    elif after == "resume":
        trainer.accelerator.wait_for_everyone()
        _reset_accelerate()
        resumed = _trainer(side, _arguments(side, cell, output_dir, **overrides))
        resumed.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-1"))
        again = _params(resumed, rank)
        same = again.keys() == measured["params"].keys() and all(
            np.array_equal(again[k], measured["params"][k]) for k in again)
        measured.update(resumed_as_original=bool(same), resumed_log=_logged(resumed)["loss"])
    return measured


def _saved(trainer, rank: int, path: str) -> dict[str, Any]:
    """``save_model``, then ``from_pretrained`` on rank 0: nothing missing or unexpected, the trained weights."""
    from transformers import GPT2LMHeadModel

    trainer.save_model(path)  # every rank: a collective on the sharded fronts
    trained = _params(trainer, rank)
    trainer.accelerator.wait_for_everyone()
    if rank != 0:
        return {"loaded_as_trained": True, "loading_info": []}
    loaded, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    state = {k: v.detach().float().numpy() for k, v in loaded.state_dict().items()}
    same = all(np.array_equal(state[k], v) for k, v in trained.items() if k in state)
    return {"loaded_as_trained": bool(same and set(trained) <= set(state)),
            "loading_info": sorted(f"{k}: {sorted(map(str, v))}" for k, v in info.items()
                                   if k != "error_msgs" and v)}


def _best(trainer, rank: int) -> dict[str, Any]:
    """The best checkpoint (by evaluation loss), and whether the model ends as its model files, bitwise."""
    from safetensors.torch import load_file

    from .matrix import _normalise

    best = trainer.state.best_model_checkpoint
    trained = {_normalise(k): v for k, v in _params(trainer, rank).items()}
    if rank != 0:
        return {"best": os.path.basename(best), "model_is_best": True}
    files = {k: v.float().numpy() for k, v in load_file(os.path.join(best, "model.safetensors")).items()}
    same = all(np.array_equal(trained[k], v) for k, v in files.items())
    return {"best": os.path.basename(best), "model_is_best": bool(same and set(files) <= set(trained))}

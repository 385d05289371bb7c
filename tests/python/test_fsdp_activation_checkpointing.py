"""shardkit.FullyShardedDataParallel with activation checkpointing, against torch's own FSDP1
(torch.distributed.fsdp.FullyShardedDataParallel, use_orig_params=True) on gloo with the same checkpointing,
and the full state dict such a model hands out.

Forms (each with use_reentrant=False and =True, on the same model, the same data and AdamW):
- inner: ``torch.utils.checkpoint.checkpoint`` inside a unit's forward, around part of it (the unit's LayerNorm
  runs outside: one flat parameter gets gradients from the recompute's backward and from the ordinary one), or
  around the whole body;
- wrapper: ``apply_activation_checkpointing`` (checkpoint_wrapper) around the blocks that become units, applied
  before wrapping, or after wrapping (torch then checkpoints inside its unit, shardkit around it);
- wrapper_inside: ``checkpoint_wrapper`` around a submodule of each unit.

torch FSDP1 itself cannot train the two forms where reentrant checkpointing covers part of a unit (inner and
wrapper_inside with use_reentrant=True: its post-backward runs in the recompute's backward and frees the unit's
parameters that the rest of the unit's backward still reads, "data is not allocated yet"); there the oracle is torch
FSDP1 on the same model without checkpointing (the same arithmetic).

What each case catches: a recompute that sees the sharded (1-D) parameters, or a full buffer freed under it
(an error, garbage, or a crash); a recompute that issues its own gradient reduction, or none (parameters drift
from torch's); parameters left as views of a freed buffer after backward (the state dict's tensors of 0 bytes,
a SIGSEGV on clone); a full state dict whose values change with the next step.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from support.ddp_cases import assert_close, gloo_world
from support.fsdp_cases import Block, D, Net, batch, dut_group

STEPS = 3


class InnerBlock(Block):
    """A Block whose forward checkpoints its MLP (``whole=False``: the LayerNorm outside) or everything."""

    def __init__(self, reentrant: bool, whole: bool) -> None:
        super().__init__(D)
        self.reentrant, self.whole = reentrant, whole

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(h)))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._mlp(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole:
            return torch_checkpoint.checkpoint(self._body, x, use_reentrant=self.reentrant)
        return x + torch_checkpoint.checkpoint(self._mlp, self.norm(x), use_reentrant=self.reentrant)


def _model(form: str, reentrant: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Net(depth=3)
    if form.startswith("inner"):
        for i, old in enumerate(model.blocks):
            new = InnerBlock(reentrant, whole=form == "inner_whole")
            new.load_state_dict(old.state_dict())
            model.blocks[i] = new
    return model


def _impl(reentrant: bool):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT


def _checkpoint(model: nn.Module, form: str, reentrant: bool) -> None:
    """Applies checkpoint_wrapper for the wrapper forms (to the model before or after wrapping, as the form says)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=_impl(reentrant))
    if form.startswith("wrapper_around"):
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
    elif form == "wrapper_inside":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                       check_fn=lambda m: isinstance(m, nn.Linear) and m.out_features == 2 * D)


TORCH_FSDP1_CANNOT = {("inner", True), ("wrapper_inside", True)}  # see the module docstring


def _pair(form: str, reentrant: bool, backend: str = "shardkit"):
    """(torch FSDP1 on gloo, shardkit FSDP on the default shardkit group or a gloo group), the same module and
    checkpointing (torch's without checkpointing for the forms of TORCH_FSDP1_CANNOT)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import wrap as torch_wrap

    import shardkit
    from shardkit.wrap import transformer_auto_wrap_policy

    ref_form = "plain" if (form, reentrant) in TORCH_FSDP1_CANNOT else form
    after = form == "wrapper_around_after"
    ref_model, dut_model = _model(ref_form, reentrant), _model(form, reentrant)
    if not after:
        _checkpoint(ref_model, ref_form, reentrant)
        _checkpoint(dut_model, form, reentrant)
    ref = TorchFSDP(ref_model, process_group=gloo_world(), device_id=torch.device("cpu"), use_orig_params=True,
                    auto_wrap_policy=functools.partial(torch_wrap.transformer_auto_wrap_policy,
                                                       transformer_layer_cls={Block}))
    dut = shardkit.FullyShardedDataParallel(dut_model, process_group=dut_group(backend),
                                            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                               transformer_layer_cls={Block}))
    if after:
        _checkpoint(ref, ref_form, reentrant)
        _checkpoint(dut, form, reentrant)
    return ref, dut


def _torch_full_state(ref: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    with TorchFSDP.state_dict_type(ref, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        return ref.state_dict()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> float:
    optimizer.zero_grad()
    x, y = batch(rank, step)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


FORMS = ["inner", "inner_whole", "wrapper_around", "wrapper_around_after", "wrapper_inside"]


def _forms(rank: int, world: int, forms: list[str], backend: str) -> None:
    for form in forms:
        for reentrant in (False, True):
            where = f"rank {rank}, {form}, use_reentrant={reentrant}, shardkit on {backend}"
            ref, dut = _pair(form, reentrant, backend)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
            dut_opt = torch.optim.AdamW(dut.parameters(), lr=1e-2, weight_decay=0.01)
            for step in range(STEPS):
                try:
                    ref_loss = _train(ref, ref_opt, rank, step)
                except Exception as error:
                    error.add_note(f"torch FSDP1: {where}, step {step}")
                    raise
                try:
                    dut_loss = _train(dut, dut_opt, rank, step)
                except Exception as error:
                    error.add_note(f"shardkit FSDP: {where}, step {step}")
                    raise
                assert dut_loss == pytest.approx(ref_loss, rel=1e-5), f"{where}, step {step}"
            # Between steps every parameter is the sharded one again (not a view of a full buffer).
            for name, p in dut.named_parameters():
                assert p.dim() == 1 and p.untyped_storage().nbytes() > 0, f"{where}: {name} {tuple(p.shape)}"
            want, got = _torch_full_state(ref), dut.state_dict()
            assert sorted(got) == sorted(want), f"{where}: {sorted(got)} vs {sorted(want)}"
            for key, value in want.items():
                assert_close(got[key], value, f"{where}: {key}", rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_every_activation_checkpointing_form_matches_torch_fsdp1_on_gloo(ranks):
    ranks.run(_forms, 2, FORMS, "shardkit", timeout=280)


@pytest.mark.timeout(200)
def test_recompute_gathers_in_the_same_order_on_a_gloo_group(ranks):
    # A reentrant recompute of a whole unit all-gathers during backward: gloo pairs collectives by issue order.
    ranks.run(_forms, 2, ["inner_whole", "wrapper_around"], "gloo", timeout=180)


def _state_dict_after_checkpoint_wrapper(rank: int, world: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as torch_get_model_state_dict

    from shardkit.state_dict import StateDictOptions, get_model_state_dict

    ref, dut = _pair("wrapper_around", reentrant=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dut_opt = torch.optim.AdamW(dut.parameters(), lr=1e-2)
    for step in range(2):
        _train(ref, ref_opt, rank, step)
        _train(dut, dut_opt, rank, step)
    for cpu_offload in (True, False):
        # torch's with cpu_offload=True dies of SIGSEGV on a CPU FSDP1 model (torch 2.13, with or without
        # checkpointing): the oracle is its full state dict without offloading, the same values.
        want = torch_get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True))
        got = get_model_state_dict(dut, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
        where = f"rank {rank}, cpu_offload={cpu_offload}"
        if cpu_offload and rank != 0:
            assert got == {}, where
        else:
            assert sorted(got) == sorted(want), f"{where}: {sorted(got)} vs {sorted(want)}"
        captured = {}
        for key, value in got.items():
            # Tensors of their own: their storage is theirs alone, and alive.
            assert value.untyped_storage().nbytes() == value.nbytes > 0, (where, key, value.untyped_storage().nbytes())
            captured[key] = value.clone()
            assert_close(value, want[key], f"{where}: {key}", rtol=1e-5, atol=1e-6)
        # The next step reshards, re-gathers and steps the shards: what was handed out stays as it was.
        _train(ref, ref_opt, rank, 2 + cpu_offload)
        _train(dut, dut_opt, rank, 2 + cpu_offload)
        for key, value in got.items():
            assert torch.equal(value.clone(), captured[key]), f"{where}: {key} changed after a step"
    dist.barrier()


@pytest.mark.timeout(120)
def test_full_state_dict_after_checkpoint_wrapper_owns_its_storage(ranks):
    ranks.run(_state_dict_after_checkpoint_wrapper, 2, timeout=100)

"""Configurations a torch user expects to work.

1. A root unit that owns no parameter (``auto_wrap_policy={nn.Linear}`` on a Sequential of Linears and
   activations; torch FSDP handles it): full and sharded state dicts, ``get_state_dict`` / ``set_state_dict``,
   FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``, and a DCP round trip that loads bitwise the saved
   values, after which training continues bitwise as the run that never saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from ddp_cases import adamw, batch, loss_fn, mlp


def _bits(value):
    """Tensors as their bytes (bitwise comparison), through dicts and lists; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return bytes(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    return value


def _train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        x, y = batch(rank, step)
        loss_fn(model(x), y).backward()
        optimizer.step()


# --- 1. a root unit without parameters --------------------------------------------------------------------------
def _linears_wrapped(seed: int):
    """mlp() (Linears and ReLUs) with every Linear a unit: the root unit owns no parameter."""
    import shardkit

    model = shardkit.FullyShardedDataParallel(mlp(seed), auto_wrap_policy={nn.Linear})
    assert model._units[0].is_root and model._units[0].groups == [] and len(model._units) == 4
    return model, adamw(model.parameters())


def _root_without_parameters(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from shardkit import FullyShardedDataParallel as FSDP
    from shardkit.fsdp import StateDictType
    from shardkit.state_dict import StateDictOptions, get_state_dict, set_state_dict

    full = StateDictOptions(full_state_dict=True)
    model, optimizer = _linears_wrapped(seed=0)
    _train(model, optimizer, rank, range(2))
    saved_model, saved_optim = get_state_dict(model, optimizer, options=full)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):  # FSDP1's interface
        fsdp1_sharded = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
    sharded_model, sharded_optim = get_state_dict(model, optimizer)
    assert sorted(fsdp1_sharded["optim"]["state"]) == sorted(sharded_optim["state"]) == sorted(saved_optim["state"])
    dcp.save({"model": sharded_model, "optim": sharded_optim}, checkpoint_id=path)

    resumed, resumed_optim = _linears_wrapped(seed=1)  # other values: the load must replace every one
    model_sd, optim_sd = get_state_dict(resumed, resumed_optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded_model, loaded_optim = get_state_dict(resumed, resumed_optim, options=full)

    # The full dicts through FSDP1's interface, into a third model.
    third, third_optim = _linears_wrapped(seed=2)
    third.load_state_dict(saved_model)
    FSDP.optim_state_dict_to_load(third, third_optim, saved_optim, load_directly=True)

    for m, o in ((model, optimizer), (resumed, resumed_optim), (third, third_optim)):
        _train(m, o, rank, range(2, 4))
    return {"saved": _bits([saved_model, saved_optim]), "loaded": _bits([loaded_model, loaded_optim]),
            "after": [_bits(m.state_dict()) for m in (model, resumed, third)]}


@pytest.mark.timeout(180)
def test_a_root_without_parameters_saves_loads_and_resumes_bitwise(ranks, tmp_path: Path):
    for rank, r in enumerate(ranks.run(_root_without_parameters, 2, str(tmp_path / "ckpt"), timeout=150)):
        assert r["loaded"] == r["saved"], f"rank {rank}: the DCP round trip changed model or optimizer state"
        never_saved, resumed, third = r["after"]
        assert resumed == never_saved, f"rank {rank}: training after the DCP load differs from the run that went on"
        assert third == never_saved, f"rank {rank}: training after loading the full state dicts differs"

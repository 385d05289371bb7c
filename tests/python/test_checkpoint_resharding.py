"""Checkpoints across world sizes, sharding strategies, ZeRO stages and wrappers (issue #11), through
shardkit.state_dict's get_state_dict / set_state_dict (torch.distributed.checkpoint.state_dict's names).

Every case trains 2 steps at world N with one system (shardkit FSDP under a strategy, or shardkit DDP with
zero_stage 0|1|2 and its optimizer), saves model and optimizer (sharded through shardkit.checkpoint.save and
loaded through shardkit.checkpoint.load, strict, as the README writes it; or full with torch.save),
then loads them at world M into another system built from other values, and compares with the run that
never stopped (one process, the global batch, torch's AdamW): the full parameters and the optimizer state
right after loading, and the parameters after 3 more steps at world M. World sizes 1-4 all occur as N and as
M; the model's parameters split unevenly at 3 and 4 ranks.

What each can catch: a piece saved or read at the wrong offset, a ZeRO partition and an FSDP layout that do not
agree on what a name's elements are, a load that reaches only some ranks' pieces (the model built from other
values keeps them), a sharded DDP load that never all-gathers, optimizer state that is not the unsharded
optimizer's (step count, moments) and so diverges in the 3 steps after the restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.ddp_cases import assert_close
from support.fsdp_cases import adamw, block_policy, net, reference_run, train_global

TWO_HOSTS = [{"SHARDKIT_HOST_ID": host} for host in ("host0", "host0", "host1", "host1")]


def _build(system: str, seed: int, depth: int = 3, d_in: int = 7):
    """``fsdp:STRATEGY`` or ``zeroK`` (shardkit DDP, zero_stage K; K=0 with torch's AdamW)."""
    import shardkit
    from shardkit.fsdp import ShardingStrategy

    module = net(seed=seed, depth=depth, d_in=d_in)
    if system.startswith("fsdp:"):
        model = shardkit.FullyShardedDataParallel(module, auto_wrap_policy=block_policy(),
                                                  sharding_strategy=ShardingStrategy[system[5:]])
        return model, adamw(model.parameters())
    stage = int(system.removeprefix("zero"))
    model = shardkit.DistributedDataParallel(module, zero_stage=stage)
    if stage == 0:
        return model, adamw(model.parameters())
    return model, shardkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def _save(rank: int, world: int, system: str, path: str, full: bool) -> None:
    from shardkit import checkpoint
    from shardkit.state_dict import StateDictOptions, get_state_dict

    model, optimizer = _build(system, seed=0)
    train_global(model, optimizer, rank, world, range(2))
    if full:
        model_sd, optim_sd = get_state_dict(model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        assert (model_sd == {}) == (rank != 0)  # cpu_offload with full: rank 0 only, as torch's
        if rank == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, path)
    else:  # the README's Checkpoints snippet
        model_sd, optim_sd = get_state_dict(model, optimizer)
        checkpoint.save({"model": model_sd, "optim": optim_sd}, path)


def _resume(rank: int, world: int, system: str, path: str, full: bool) -> dict:
    from shardkit import checkpoint
    from shardkit.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict

    model, optimizer = _build(system, seed=123)  # other values: the load must replace every one
    if full:
        state = torch.load(path, weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        checkpoint.load(state, path)  # the README's way: verified, and strict (every rank's keys together)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    whole = StateDictOptions(full_state_dict=True)
    params_loaded, optim_loaded = get_state_dict(model, optimizer, options=whole)
    loaded = {"loaded": {k: v.tolist() for k, v in params_loaded.items()},  # values now: the dict may alias them
              "optim": {name: {k: v.tolist() for k, v in entry.items()}
                        for name, entry in optim_loaded["state"].items()}}
    train_global(model, optimizer, rank, world, range(2, 5))
    return {**loaded, "after": {k: v.tolist() for k, v in get_model_state_dict(model, options=whole).items()}}


def _check(results: list[dict], where: str) -> None:
    final, optim_two, params_two = reference_run()
    for rank, got in enumerate(results):
        at = f"{where}, rank {rank}"
        assert list(got["loaded"]) == list(params_two), at
        for key, value in params_two.items():
            assert_close(torch.tensor(got["loaded"][key]), value, f"{at}: {key} right after loading")
        assert sorted(got["optim"]) == sorted(optim_two), at
        for name, entry in optim_two.items():
            assert sorted(got["optim"][name]) == sorted(entry), f"{at}: optimizer state keys of {name}"
            for key, value in entry.items():
                assert_close(torch.tensor(got["optim"][name][key]), value, f"{at}: optimizer {name}.{key}")
        for key, value in final.items():
            assert_close(torch.tensor(got["after"][key]), value, f"{at}: {key} after 3 more steps")


def _round_trip(ranks, tmp_path: Path, save: tuple, loads: list[tuple], full: bool = False) -> None:
    world, system, *env = save
    path = str(tmp_path / f"{system.replace(':', '_')}_w{world}{'.pt' if full else ''}")
    ranks.run(_save, world, system, path, full, timeout=120, env=env[0] if env else None)
    for load_world, load_system, *load_env in loads:
        results = ranks.run(_resume, load_world, load_system, path, full, timeout=120,
                            env=load_env[0] if load_env else None)
        _check(results, f"saved by {system} at world {world}{' (full)' if full else ''}, "
                        f"loaded by {load_system} at world {load_world}")


@pytest.mark.timeout(300)
def test_zero2_world_4_sharded_loads_into_zero_and_fsdp_at_1_2_3(ranks, tmp_path: Path):
    # saved on 2 simulated hosts x 2 ranks (the ZeRO partition's all-gathers and DCP's exchanges cross hosts)
    _round_trip(ranks, tmp_path, (4, "zero2", TWO_HOSTS),
                [(1, "zero1"), (2, "zero2"), (3, "fsdp:FULL_SHARD"), (3, "zero0"), (4, "fsdp:HYBRID_SHARD", TWO_HOSTS)])
    _consolidates_into_a_plain_model(tmp_path / "zero2_w4", tmp_path / "zero2.pt")


def _consolidates_into_a_plain_model(directory: Path, out: Path) -> None:
    """In this process, which has no process group: one plain file that the unwrapped model and torch's AdamW
    load, holding the reference's values after 2 steps."""
    from shardkit.checkpoint import consolidate

    consolidate(directory, out)
    plain = torch.load(out, weights_only=True)
    model = net(seed=5, depth=3, d_in=7)
    model.load_state_dict(plain["model"])  # strict: every key, the parameters' own shapes
    _, optim_two, params_two = reference_run()
    for key, value in params_two.items():
        assert_close(model.state_dict()[key], value, f"consolidated {key}")
    optimizer = adamw(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    optimizer.load_state_dict({"state": {names.index(n): s for n, s in plain["optim"]["state"].items()},
                               "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]}
                                                for g in plain["optim"]["param_groups"]]})
    for p, name in zip(model.parameters(), names):
        for key, value in optim_two[name].items():
            assert_close(optimizer.state[p][key], value, f"consolidated optimizer {name}.{key}")


@pytest.mark.timeout(300)
def test_fsdp_sharded_loads_into_zero_at_other_world_sizes(ranks, tmp_path: Path):
    _round_trip(ranks, tmp_path, (3, "fsdp:SHARD_GRAD_OP"), [(4, "zero1", TWO_HOSTS), (2, "zero2")])
    _round_trip(ranks, tmp_path, (1, "fsdp:NO_SHARD"), [(4, "fsdp:FULL_SHARD")])
    _round_trip(ranks, tmp_path, (2, "zero0"), [(3, "zero1")])  # a plain optimizer's whole state, flattened
    _consolidates_into_a_plain_model(tmp_path / "zero0_w2", tmp_path / "zero0.pt")


@pytest.mark.timeout(300)
def test_full_checkpoints_from_zero_and_fsdp_load_anywhere(ranks, tmp_path: Path):
    _round_trip(ranks, tmp_path, (2, "zero1"), [(3, "zero2"), (1, "fsdp:FULL_SHARD")], full=True)
    _round_trip(ranks, tmp_path, (4, "fsdp:FULL_SHARD"), [(2, "zero0")], full=True)


def _load_other_model(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict
    from support.ddp_cases import error_of

    errors = {}
    for label, depth, d_in in (("wider", 3, 9), ("shallower", 2, 7), ("deeper", 4, 7)):
        model, optimizer = _build("fsdp:FULL_SHARD", seed=1, depth=depth, d_in=d_in)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        errors[label] = error_of(lambda: checkpoint.load(state, path), RuntimeError, rank)
        if label == "wider":  # DCP alone also refuses, on every rank, but names the first parameter only
            errors["dcp"] = error_of(lambda: dcp.load(state, checkpoint_id=path), BaseException, rank)
    return errors


@pytest.mark.timeout(240)
def test_another_models_checkpoint_raises_on_every_rank_naming_parameters_and_shapes(ranks, tmp_path: Path):
    path = str(tmp_path / "ckpt")
    ranks.run(_save, 2, "zero1", path, False, timeout=120)
    for rank, errors in enumerate(ranks.run(_load_other_model, 3, path, timeout=120)):
        head = f"shardkit checkpoint load (rank {rank}): {path} does not match the state dict: "
        wider = errors["wider"]
        assert wider.startswith(head), wider
        assert "model.embed.weight has shape [16, 7] in the checkpoint but [16, 9] in the model" in wider, wider
        assert "optim.state.embed.weight.exp_avg has shape [16, 7] in the checkpoint but [16, 9] in the model" in wider
        assert "missing" not in wider and "not in the model" not in wider, wider
        shallower = errors["shallower"]
        assert shallower.startswith(head + "not in the model: ['model.blocks.2.up.weight', "), shallower
        deeper = errors["deeper"]
        assert deeper.startswith(head + "missing from the checkpoint: ['model.blocks.3.up.weight', "), deeper
        dcp_error = errors["dcp"]
        assert ("Size mismatch between saved torch.Size([16, 7]) and current: torch.Size([16, 9])"
                in dcp_error), dcp_error


def _fsdp1_interface(rank: int, world: int, path: str, system: str, save: bool) -> dict:
    """FSDP1's state_dict_type / optim_state_dict on a shardkit DDP: keys keep the DDP's ``module.`` prefix."""
    import torch.distributed.checkpoint as dcp

    from shardkit import FullyShardedDataParallel as FSDP
    from shardkit.fsdp import StateDictType

    model, optimizer = _build(system, seed=0 if save else 123)
    if save:
        train_global(model, optimizer, rank, world, range(2))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        if save:
            dcp.save(state, checkpoint_id=path)
        else:
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            FSDP.optim_state_dict_to_load(model, optimizer, state["optim"], load_directly=True)
    keys = sorted(k for k in state["model"] if not k.endswith("_shardkit.shapes"))
    optim = FSDP.optim_state_dict(model, optimizer)  # outside the context: full
    return {"keys": keys, "params": {k: v.tolist() for k, v in model.module.state_dict().items()},
            "optim": {name: {k: v.tolist() for k, v in entry.items()} for name, entry in optim["state"].items()}}


@pytest.mark.timeout(240)
def test_fsdp1_interface_on_ddp_keeps_the_module_prefix_and_reshards(ranks, tmp_path: Path):
    path = str(tmp_path / "ckpt")
    saved = ranks.run(_fsdp1_interface, 2, path, "zero1", True, timeout=120)
    assert saved[0]["keys"] == sorted("module." + k for k in net(seed=0, depth=3, d_in=7).state_dict())
    _, optim_two, params_two = reference_run()
    for rank, got in enumerate(ranks.run(_fsdp1_interface, 3, path, "zero2", False, timeout=120)):
        for key, value in params_two.items():
            assert_close(torch.tensor(got["params"][key]), value, f"rank {rank}: {key}")
        for name, entry in optim_two.items():
            for key, value in entry.items():
                assert_close(torch.tensor(got["optim"][name][key]), value, f"rank {rank}: optimizer {name}.{key}")

"""Configurations a torch user expects to work, ranks that disagree, and zero-copy memory that cannot be had.

1. A root unit that owns no parameter (``auto_wrap_policy={nn.Linear}`` on a Sequential of Linears and
   activations; torch FSDP handles it): full and sharded state dicts, ``get_state_dict`` / ``set_state_dict``,
   FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``, and a DCP round trip that loads bitwise the saved
   values, after which training continues bitwise as the run that never saved.
2. Ranks that pass FSDP or DDP arguments that change communication differently (a sharding strategy, mixed
   precision, offload, a process group, use_orig_params, a prefetch; DDP's zero_stage, gradient_as_bucket_view,
   bucket_cap_mb, a comm hook) get, on every rank, one error naming the ranks and values, raised before anything
   that depends on them; launched with a hard timeout, so a hang fails fast.
3. Zero-copy memory that cannot be had is said through Python's warnings (shardkit.ZeroCopyUnavailableWarning,
   which users can filter): no room in /dev/shm (simulated: the backend's refusal), for FSDP and DDP; a group
   across hosts or on gloo where DDP's gradient_as_bucket_view=True asked for zero-copy buckets; nothing where
   nobody asked (FSDP on gloo or across hosts, DDP without the flag). Real /dev/shm exhaustion is checked by
   test_zero_copy.py's namespace test.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from support.ddp_cases import adamw, batch, error_of, loss_fn, mlp


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


# --- 2. ranks that disagree -------------------------------------------------------------------------------------
def _strategy_per_rank(rank: int, world: int) -> None:
    import shardkit
    from shardkit.fsdp import ShardingStrategy

    strategy = ShardingStrategy.FULL_SHARD if rank == 0 else ShardingStrategy.HYBRID_SHARD
    shardkit.FullyShardedDataParallel(mlp(), sharding_strategy=strategy)


@pytest.mark.timeout(90)
def test_ranks_with_different_sharding_strategies_both_raise_naming_ranks_and_values(ranks):
    for outcome in ranks.launch(_strategy_per_rank, 2, timeout=60, pg_timeout=20):
        assert outcome.finished, f"rank {outcome.rank} hung: {outcome.error}"
        assert outcome.error is not None, f"rank {outcome.rank}: FSDP was built from different strategies"
        assert outcome.error.strip().splitlines()[-1] == (
            f"RuntimeError: shardkit FSDP (rank {outcome.rank}): ranks disagree on sharding_strategy: rank 0 "
            "FULL_SHARD, rank 1 HYBRID_SHARD; pass the same arguments on every rank"), outcome.error


def _fsdp_arguments_per_rank(rank: int, world: int) -> dict[str, str]:
    """One FSDP construction per argument, rank 1 passing another value than rank 0; every one must fail on both
    ranks (so they stay in step for the next)."""
    import shardkit
    from shardkit.fsdp import CPUOffload, MixedPrecision

    gloo = dist.new_group(backend="gloo")  # a collective: both ranks make it, rank 1 passes it
    other = rank == 1
    cases = {
        "mixed_precision": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16) if other else None},
        "cpu_offload": {"cpu_offload": CPUOffload(offload_params=other)},
        "use_orig_params": {"use_orig_params": not other},
        "process_group": {"process_group": gloo if other else None},
        "forward_prefetch": {"forward_prefetch": other},
    }
    return {name: error_of(lambda: shardkit.FullyShardedDataParallel(mlp(), **kwargs), RuntimeError, rank)
            for name, kwargs in cases.items()}


@pytest.mark.timeout(120)
def test_ranks_with_other_fsdp_arguments_fail_alike_naming_ranks_and_values(ranks):
    for rank, messages in enumerate(ranks.run(_fsdp_arguments_per_rank, 2, timeout=90, pg_timeout=20)):
        def disagreement(name: str) -> str:
            message = messages[name]
            assert message.startswith(f"shardkit FSDP (rank {rank}): ranks disagree on {name}: "), message
            assert message.endswith("; pass the same arguments on every rank"), message
            return message

        assert "rank 0 MixedPrecision(), rank 1 MixedPrecision(param_dtype=torch.bfloat16)" in disagreement(
            "mixed_precision")
        cpu_offload = disagreement("cpu_offload")
        assert "rank 0 CPUOffload(), rank 1 CPUOffload(offload_params=True)" in cpu_offload, cpu_offload
        assert "ranks disagree on the compute device type: rank 0 cpu, rank 1 cuda" in cpu_offload, cpu_offload
        assert "rank 0 True, rank 1 False" in disagreement("use_orig_params")
        assert re.search(r"rank 0 group '0' over ranks \[0, 1\] \(shardkit\), rank 1 group '\d+' over ranks \[0, 1\] "
                         r"\(gloo\)", disagreement("process_group")), messages["process_group"]
        assert "rank 0 False, rank 1 True" in disagreement("forward_prefetch")


def test_hybrid_shard_pairs_that_do_not_fit_together_are_named():
    """(shard, replicate) pairs differ by rank; each member of a rank's shard group must name the same group."""
    from shardkit._agreement import mismatched_pairs

    fitting = {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}
    assert mismatched_pairs(fitting) == []
    shifted = {**fitting, 1: ([1, 2], [1, 3])}
    assert mismatched_pairs(shifted) == ["ranks disagree on process_group: rank 0's shard group holds ranks [0, 1], "
                                            "but rank 1's holds ranks [1, 2]"]


def _ddp_arguments_per_rank(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import shardkit

    other = rank == 1
    cases = {"zero_stage": {"zero_stage": 1 if other else 0},
             "gradient_as_bucket_view": {"gradient_as_bucket_view": other},
             "bucket_cap_mb": {"bucket_cap_mb": 1 if other else None}}
    messages = {name: error_of(lambda: shardkit.DistributedDataParallel(mlp(), **kwargs), RuntimeError, rank)
                for name, kwargs in cases.items()}
    model = shardkit.DistributedDataParallel(mlp())
    hook = default_hooks.fp16_compress_hook if other else default_hooks.allreduce_hook
    messages["the comm hook"] = error_of(lambda: model.register_comm_hook(None, hook), RuntimeError, rank)
    return messages


@pytest.mark.timeout(120)
def test_ddp_ranks_with_different_communication_arguments_fail_alike(ranks):
    hooks = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
    want = {"zero_stage": "rank 0 0, rank 1 1", "gradient_as_bucket_view": "rank 0 False, rank 1 True",
            "bucket_cap_mb": "rank 0 None, rank 1 1",
            "the comm hook": f"rank 0 {hooks}.allreduce_hook (state: NoneType), rank 1 {hooks}.fp16_compress_hook "
                             "(state: NoneType)"}
    for rank, messages in enumerate(ranks.run(_ddp_arguments_per_rank, 2, timeout=90, pg_timeout=20)):
        for name, values in want.items():
            where = " register_comm_hook" if name == "the comm hook" else ""
            end = "register the same hook on every rank" if where else "pass the same arguments on every rank"
            assert messages[name] == f"shardkit DDP (rank {rank}){where}: ranks disagree on {name}: {values}; {end}", (
                messages[name])


# --- 3. zero-copy memory that cannot be had ---------------------------------------------------------------------
def _zero_copy_warnings(rank: int, world: int, case: str) -> list[str]:
    """The ZeroCopyUnavailableWarning messages while wrapping a model and training it one step; ``no_room``: the
    backend refuses every shared buffer as where /dev/shm is full (on every rank, as the real refusal)."""
    import shardkit
    from shardkit import _C

    if case == "no_room":
        _C.ProcessGroupShardkit.shared_buffer = lambda self, nbytes: (
            None, f"/dev/shm has 4096 bytes free and the buffer needs {nbytes + 8192}")
    gloo = dist.new_group(backend="gloo")
    wrappers = {
        "fsdp": lambda m: shardkit.FullyShardedDataParallel(m),
        "fsdp_gloo": lambda m: shardkit.FullyShardedDataParallel(m, process_group=gloo),
        "ddp": lambda m: shardkit.DistributedDataParallel(m, gradient_as_bucket_view=True),
        "ddp_gloo": lambda m: shardkit.DistributedDataParallel(m, process_group=gloo, gradient_as_bucket_view=True),
        "ddp_without_the_flag": lambda m: shardkit.DistributedDataParallel(m),
    }
    caught_by_wrapper = {}
    for name, wrap in wrappers.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = wrap(mlp())
            for step in range(2):  # DDP rebuilds its buckets before the second backward: new memory is asked for
                loss_fn(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        caught_by_wrapper[name] = [str(w.message) for w in caught
                                   if issubclass(w.category, shardkit.ZeroCopyUnavailableWarning)]
    with warnings.catch_warnings(record=True) as caught:  # what users do to silence them
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=shardkit.ZeroCopyUnavailableWarning)
        shardkit.DistributedDataParallel(mlp(), process_group=gloo, gradient_as_bucket_view=True)
    caught_by_wrapper["ignored"] = [str(w.message) for w in caught]
    return caught_by_wrapper


@pytest.mark.timeout(120)
def test_no_room_in_dev_shm_is_a_python_warning_for_fsdp_and_ddp(ranks):
    assert issubclass(__import__("shardkit").ZeroCopyUnavailableWarning, UserWarning)
    for rank, caught in enumerate(ranks.run(_zero_copy_warnings, 2, "no_room", timeout=90)):
        (fsdp,) = caught["fsdp"]
        assert re.fullmatch(rf"shardkit FSDP \(rank {rank}\): no zero-copy memory for the flat gradients \(\d+ bytes "
                            r"per rank\): /dev/shm has 4096 bytes free and the buffer needs \d+; ordinary memory is "
                            "used, with the same results", fsdp), fsdp
        assert len(caught["ddp"]) == 2, caught["ddp"]  # at construction and at the bucket rebuild
        for ddp in caught["ddp"]:
            assert re.fullmatch(rf"shardkit DDP \(rank {rank}\): no zero-copy memory for the gradient buckets "
                                r"gradient_as_bucket_view=True asked for \(\d+ bytes per rank\): /dev/shm has 4096 "
                                r"bytes free and the buffer needs \d+; ordinary memory is used, with the same results",
                                ddp), ddp
        assert caught["fsdp_gloo"] == caught["ddp_without_the_flag"] == caught["ignored"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", ["one", "two"])
def test_ddp_says_why_its_zero_copy_buckets_do_not_apply_and_fsdp_stays_silent(ranks, hosts):
    env = [{"SHARDKIT_HOST_ID": "h0"}, {"SHARDKIT_HOST_ID": "h1"}] if hosts == "two" else None
    for rank, caught in enumerate(ranks.run(_zero_copy_warnings, 2, "as_is", timeout=90, env=env)):
        ending = "; ordinary memory is used, with the same results"
        asked = f"shardkit DDP (rank {rank}): no zero-copy memory for the gradient buckets gradient_as_bucket_view=True"
        on_gloo = f"{asked} asked for: the group's backend is gloo, not shardkit's{ending}"
        assert caught["ddp_gloo"] == [on_gloo], caught
        across_hosts = f"{asked} asked for: the group's ranks are on 2 hosts, which share no memory{ending}"
        assert caught["ddp"] == ([across_hosts] if hosts == "two" else []), caught
        # Nobody asked FSDP for zero-copy memory: where it does not apply (gloo, hosts) that is no news.
        assert caught["fsdp"] == caught["fsdp_gloo"] == caught["ddp_without_the_flag"] == caught["ignored"] == []

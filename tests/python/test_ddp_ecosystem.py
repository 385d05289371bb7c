"""shardkit.DistributedDataParallel where torch's DDP is expected: isinstance, join(), torch.compile, arguments.

- It is a torch.nn.parallel.DistributedDataParallel (libraries unwrap ``.module`` and special-case DDP by
  isinstance) without torch's reducer: torch DDP methods it does not implement raise naming themselves.
- ``join()`` (uneven inputs): every rank trains on its own number of batches; the final parameters must equal
  torch DDP's ``join()`` on gloo fed the same batches (both average with zeros from ranks that ran out, or over
  the ranks still training, and both end with the last joiner's model on every rank). Rank 0 runs out after
  one batch with tiny buckets, so the bucket rebuild's broadcast happens on a rank that has joined.
- torch.compile: no graph break at all (torch DDP's own forward has three), torch's DDPOptimizer splits the graph
  at shardkit's bucket cap (it recognises the module as the active DDP), and the compiled training matches torch
  DDP's compiled one.
- torch DDP's constructor arguments: accepted with torch's meaning (device_mesh, init_sync, forward_sync_buffers,
  _ddp_params_and_buffers_to_ignore) or refused by name.
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support import harness
from support.collective_cases import topology_env
from support.ddp_cases import (
    Pair,
    assert_modules_match,
    batch,
    bn_net,
    error_of,
    gloo_world,
    loss_fn,
    mlp,
    sgd,
    shardkit_ddp,
    two_heads,
    wide_mlp,
)

TINY_BUCKET_MB = 0.0001  # one parameter per bucket after the rebuild


def _flat(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


# --- isinstance and the methods it does not implement ------------------------------------------------------

def _is_a_torch_ddp(rank, world):
    model = shardkit_ddp()(mlp())
    assert isinstance(model, TorchDDP)
    unwrapped = model.module if isinstance(model, TorchDDP) else model  # what HF accelerate/Lightning do
    assert isinstance(unwrapped, nn.Sequential)
    messages = [error_of(model._get_ddp_logging_data, NotImplementedError, rank),
                error_of(lambda: model._register_fused_optim(torch.optim.SGD, lr=0.1), NotImplementedError, rank)]
    assert not hasattr(model, "_distributed_rank")  # a property of torch's: AttributeError, so hasattr is False
    messages.append(error_of(lambda: model._distributed_rank, AttributeError, rank))
    messages.append(error_of(lambda: pickle.dumps(model), TypeError, rank))
    model._set_static_graph()  # trainers call it; the reducer needs no hint
    assert model.static_graph and model.will_sync_module_buffers() is False  # mlp has no buffers
    loss_fn(model(batch(rank, 0)[0]), batch(rank, 0)[1]).backward()  # still a working DDP
    return messages


def test_is_a_torch_ddp_without_torch_reducer(ranks):
    messages = ranks.run(_is_a_torch_ddp, 2)[0]
    assert messages[0] == "shardkit DDP does not implement torch DDP's _get_ddp_logging_data()"
    assert messages[1] == "shardkit DDP does not implement torch DDP's _register_fused_optim()"
    assert messages[2] == "shardkit DDP does not implement torch DDP's _distributed_rank"
    assert messages[3].startswith("shardkit DDP holds a C++ reducer bound to a process group and cannot be pickled")


# --- join(): uneven inputs -------------------------------------------------------------------------------

def _batches_of(rank: int) -> int:
    return 1 + 2 * rank  # world 3: 1, 3 and 5 batches


def _train_joined(model: nn.Module, rank: int, divide: bool, **forward_kwargs) -> None:
    opt = sgd(model.module.parameters())
    with model.join(divide_by_initial_world_size=divide):
        for step in range(_batches_of(rank)):
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x, **forward_kwargs), y).backward()
            opt.step()


def _join(rank, world, divide, ddp_kwargs, forward_kwargs, hook):
    zero_copy = ddp_kwargs.get("gradient_as_bucket_view", False)
    module = two_heads() if forward_kwargs else wide_mlp() if zero_copy else mlp()
    ref = TorchDDP(copy.deepcopy(module), process_group=gloo_world(), **ddp_kwargs)
    dut = shardkit_ddp()(copy.deepcopy(module), **ddp_kwargs)
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ref.register_comm_hook(gloo_world(), default_hooks.allreduce_hook)
        dut.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    # One wrapper's whole join loop after the other's: their collectives never interleave.
    _train_joined(ref, rank, divide, **forward_kwargs)
    _train_joined(dut, rank, divide, **forward_kwargs)
    assert dut.reducer.zero_copy() is zero_copy
    assert_modules_match(ref.module, dut.module, f"rank {rank} after join()", rtol=1e-5, atol=1e-6)
    return _flat(dut.module)


@pytest.mark.parametrize("divide", [True, False], ids=["divide_by_initial_world_size", "divide_by_active"])
@pytest.mark.parametrize("case", ["tiny_buckets", "find_unused", "comm_hook", "zero_copy_buckets"])
def test_join_uneven_inputs_matches_torch(ranks, divide, case):
    # zero_copy_buckets: a joined rank reduces zeros in its shared buckets, which hold its .grad (saved and restored).
    ddp_kwargs = {"tiny_buckets": {"bucket_cap_mb": TINY_BUCKET_MB},
                  "find_unused": {"find_unused_parameters": True}, "comm_hook": {},
                  "zero_copy_buckets": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.05}}[case]
    forward_kwargs = {"use_b": False} if case == "find_unused" else {}
    flats = ranks.run(_join, 3, divide, ddp_kwargs, forward_kwargs, case == "comm_hook", timeout=120)
    assert flats[1] == flats[0] and flats[2] == flats[0], "join() must end with one model on every rank"


@pytest.mark.parametrize("hosts", [[0, 0, 1], [0, 1, 1]], ids=["2+1hosts", "1+2hosts"])
def test_join_on_simulated_hosts_matches_torch(ranks, hosts):
    flats = ranks.run(_join, 3, False, {"bucket_cap_mb": TINY_BUCKET_MB}, {}, True, timeout=120,
                      env=topology_env(hosts))
    assert flats[1] == flats[0] and flats[2] == flats[0]


def _join_on_subgroup(rank, world):
    """Ranks 1 and 2 of 3 train on a subgroup, so group ranks are not global ranks: the last joiner (global rank 2,
    group rank 1) must be the broadcast's root as a group rank."""
    shardkit_group, gloo_group = dist.new_group([1, 2]), dist.new_group([1, 2], backend="gloo")
    if rank == 0:
        return None
    module = mlp()
    ref = TorchDDP(copy.deepcopy(module), process_group=gloo_group, bucket_cap_mb=TINY_BUCKET_MB)
    dut = shardkit_ddp()(copy.deepcopy(module), process_group=shardkit_group, bucket_cap_mb=TINY_BUCKET_MB)
    _train_joined(ref, rank, True)
    _train_joined(dut, rank, True)
    assert_modules_match(ref.module, dut.module, f"rank {rank} after join() on a subgroup", rtol=1e-5, atol=1e-6)
    return _flat(dut.module)


def test_join_on_a_subgroup_matches_torch(ranks):
    flats = ranks.run(_join_on_subgroup, 3, timeout=120)
    assert flats[0] is None and flats[2] == flats[1]


def _join_until_a_rank_dies(rank, world):
    victim = world - 1  # the rank with the most batches: the others have joined and shadow its backward
    model = shardkit_ddp()(mlp(), bucket_cap_mb=TINY_BUCKET_MB)
    opt = sgd(model.parameters())
    steps = {"n": 0}
    if rank == victim:
        def die(module, grad_output):
            if steps["n"] == 3:  # mid-backward: after the last layer's bucket launched, before the rest
                os.kill(os.getpid(), signal.SIGKILL)

        model.module[2].register_full_backward_pre_hook(die)
    start = time.monotonic()
    try:
        with model.join():
            for step in range(_batches_of(rank)):
                opt.zero_grad()
                x, y = batch(rank, step)
                loss_fn(model(x), y).backward()
                opt.step()
                steps["n"] += 1
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return "join() ended normally although a rank died"


# The victim (rank 2) shares its simulated host with rank 1, which sees the death in shared memory and names it.
@pytest.mark.parametrize("hosts", [None, [0, 1, 1]], ids=["1host", "1+2hosts"])
def test_rank_killed_while_others_have_joined(ranks, hosts):
    outcomes = ranks.launch(_join_until_a_rank_dies, 3, timeout=90, pg_timeout=60, env=topology_env(hosts))
    for outcome in harness.survivors(outcomes, 2):
        assert not isinstance(outcome.value, str), f"rank {outcome.rank}: {outcome.value}"
        elapsed, message = outcome.value
        assert elapsed < 20.0, f"rank {outcome.rank} took {elapsed:.1f} s (the group timeout is 60 s): {message}"
        assert "rank(s) 2 (pid" in message and "exited" in message, message


def _join_refused_with_zero(rank, world):
    model = shardkit_ddp()(mlp(), zero_stage=1)
    return error_of(model.join, NotImplementedError, rank)


def test_join_refused_with_zero_stages(ranks):
    message = ranks.run(_join_refused_with_zero, 2)[0]
    assert message.startswith("shardkit DDP: join() with zero_stage=1 is not supported")


# --- torch.compile --------------------------------------------------------------------------------------

class _Wide(nn.Module):
    """~2.1 MB of parameters (two 512x512 layers): enough for DDPOptimizer to split at a 1 MB cap (its first
    bucket is 1 MiB and it refuses smaller caps). A user-defined class: dynamo starts compiling in user frames,
    not in torch.nn's own (an nn.Sequential called from an eager frame is not compiled at all)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _compiled(rank, world, bucket_cap_mb):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs: dict[str, int] = {"torch": 0, "shardkit": 0}

    def counting_backend(name):
        def backend(gm: torch.fx.GraphModule, example_inputs):
            graphs[name] += 1
            return gm.forward  # run the captured graph as it is: autograd differentiates it
        return backend

    pair = Pair(_Wide(), sgd, bucket_cap_mb=bucket_cap_mb)
    ref = torch.compile(pair.ref, backend=counting_backend("torch"))
    dut = torch.compile(pair.dut, backend=counting_backend("shardkit"))
    breaks = {"torch": 0, "shardkit": 0}
    for step in range(3):
        x, y = batch(rank, step)
        for name, model, opt in (("torch", ref, pair.ref_opt), ("shardkit", dut, pair.dut_opt)):
            before = sum(torch._dynamo.utils.counters["graph_break"].values())
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            breaks[name] += sum(torch._dynamo.utils.counters["graph_break"].values()) - before
        pair.check(f"rank {rank} step {step} after backward", grads=True)
        pair.ref_opt.step()
        pair.dut_opt.step()
    return graphs, breaks


@pytest.mark.parametrize("bucket_cap_mb", [None, 1.0], ids=["default_buckets", "1MB_buckets"])
def test_torch_compile_without_graph_break(ranks, bucket_cap_mb):
    for graphs, breaks in ranks.run(_compiled, 2, bucket_cap_mb, timeout=180):
        assert breaks["shardkit"] == 0, breaks  # torch DDP's own forward breaks 3 times (its logger, its context)
        # DDPOptimizer splits the forward graph at the bucket cap, for shardkit's DDP as for torch's.
        assert graphs["shardkit"] == graphs["torch"]
        assert graphs["shardkit"] == (2 if bucket_cap_mb is None else 3), graphs


# --- constructor arguments ------------------------------------------------------------------------------

_REFUSED = {
    "delay_all_reduce_named_params": lambda m: list(m.named_parameters())[:1],
    "param_to_hook_all_reduce": lambda m: next(m.parameters()),
    "mixed_precision": lambda m: object(),
    "skip_all_reduce_unused_params": lambda m: True,
    "bucket_cap_mb_list": lambda m: [1, 25],
}


def _refused_arguments(rank, world):
    messages = {}
    for name, value in _REFUSED.items():
        module = mlp()
        messages[name] = error_of(lambda: shardkit_ddp()(module, **{name: value(module)}), NotImplementedError, rank)
    return messages


def test_unsupported_torch_arguments_are_refused_by_name(ranks):
    for name, message in ranks.run(_refused_arguments, 2)[0].items():
        assert message.startswith(f"shardkit DDP does not support torch DDP's {name} (got "), message


def _device_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = shardkit_ddp()(mlp(seed=rank), device_mesh=mesh)
    assert model.process_group is mesh.get_group(0)
    messages = [error_of(lambda: shardkit_ddp()(mlp(), device_mesh=mesh, process_group=dist.group.WORLD),
                         ValueError, rank)]
    loss_fn(model(batch(rank, 0)[0]), batch(rank, 0)[1]).backward()
    return _flat(model.module), [p.grad.flatten().tolist() for p in model.module.parameters()], messages


def test_device_mesh_gives_the_group(ranks):
    (flat0, grads0, messages), (flat1, grads1, _) = ranks.run(_device_mesh, 2)
    assert flat0 == flat1 and grads0 == grads1  # broadcast at construction, averaged gradients
    assert messages == ["shardkit DDP: pass process_group or device_mesh, not both"]


def _init_sync_false(rank, world):
    model = shardkit_ddp()(mlp(seed=rank), init_sync=False)
    return _flat(model.module)


def test_init_sync_false_keeps_each_ranks_parameters(ranks):
    flats = ranks.run(_init_sync_false, 2)
    assert flats[0] == _flat(mlp(seed=0)) and flats[1] == _flat(mlp(seed=1))


def _ignored_parameters(rank, world):
    module = bn_net()
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, ["3.bias", "1.running_mean"])
    module._ddp_params_and_buffers_to_ignore = ["3.bias", "1.running_mean"]
    pair = Pair(module)
    for step in range(3):
        pair.step(rank, step)  # the ignored bias keeps its local gradient in both, the buffer its local stats
    return _flat(pair.dut.module)


def test_params_and_buffers_to_ignore_match_torch(ranks):
    flats = ranks.run(_ignored_parameters, 2)
    assert flats[0] != flats[1]  # the ignored bias trained on each rank's own data


_TORCH_HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(TorchDDP.__init__).parameters


def _forward_sync_buffers(rank, world, kwargs):
    pair = Pair(bn_net(seed=rank), **kwargs)  # replicas differ: what init syncs shows at once
    pair.check(f"rank {rank} after construction")
    for step in range(3):
        pair.step(rank, step)


@pytest.mark.parametrize("kwargs", [{"forward_sync_buffers": False}, {"broadcast_buffers": False},
                                    {"forward_sync_buffers": True, "broadcast_buffers": False}],
                         ids=["forward_sync_buffers_false", "broadcast_buffers_false", "both"])
def test_buffer_sync_arguments_match_torch(ranks, kwargs):
    if "forward_sync_buffers" in kwargs and not _TORCH_HAS_FORWARD_SYNC_BUFFERS:
        pytest.skip(f"torch {torch.__version__} has no forward_sync_buffers to compare with")
    ranks.run(_forward_sync_buffers, 2, kwargs)

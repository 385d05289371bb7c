"""``shardkit.fully_shard``: parity with torch FSDP2 on gloo (and torch DDP on gloo), torch's FSDP2 methods, the
zero-copy reduce-scatter, unit identities, checkpoints interchanged with torch FSDP2 at other world sizes through
``shardkit.checkpoint``, and torch's ``clip_grad_norm_``.

The oracle is torch's own ``fully_shard`` on a **gloo** mesh over every rank (no shardkit code on its path); the
device under test is ``shardkit.fully_shard`` on the default ("shardkit") group's mesh. Both wrap deep copies of
the same model, get the same per-rank batches and take turns, so their collectives never interleave. After every
step every parameter, gathered whole (``DTensor.full_tensor()``), must agree.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from support import harness  # noqa: E402
from support.collective_cases import topology_env  # noqa: E402
from support.ddp_cases import assert_close, gloo_world  # noqa: E402
from support.fsdp_cases import Block, TinyLM  # noqa: E402

VOCAB, D, SEQ = 96, 64, 8  # a block's gradients are 66 KB: past the engine's 32 KB zero-copy threshold


def tiny_lm(seed: int = 0, depth: int = 3, vocab: int = VOCAB) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(depth, vocab, D)


def tokens(rank: int, step: int, micro: int = 0, rows: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step + 31 * micro + 11)
    return torch.randint(0, VOCAB, (rows or 2 + rank, SEQ + 1), generator=g)  # uneven rows on purpose


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _wrap(shard, model: TinyLM, mesh, reshard_after_forward: Any = None, mp_policy=None) -> TinyLM:
    """The recipe of torch's guides: each block, then the root."""
    kwargs: dict[str, Any] = {"mesh": mesh}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in model.layers:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    return model


def _meshes(world: int, hsdp: bool):
    """(the oracle's mesh on gloo, shardkit's mesh on the default group): 1-D, or 2-D (replicate, shard) for HSDP."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not hsdp:
        return DeviceMesh.from_group(gloo_world(), "cpu"), init_device_mesh("cpu", (world,))
    names = ("replicate", "shard")
    layout = torch.arange(world).view(2, world // 2)
    # gloo subgroups for the oracle: every rank creates every group, in the same order (new_group is collective)
    rows = [dist.new_group(r.tolist(), backend="gloo") for r in layout]
    cols = [dist.new_group(c.tolist(), backend="gloo") for c in layout.t()]
    me = dist.get_rank()
    replicate = next(g for g, c in zip(cols, layout.t()) if me in c.tolist())
    shard = next(g for g, r in zip(rows, layout) if me in r.tolist())
    ref = DeviceMesh.from_group([replicate, shard], "cpu", mesh=layout, mesh_dim_names=names)
    return ref, init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective on the model's mesh, in parameter order)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _train_side_by_side(rank: int, ref: tuple, dut: tuple, steps: int = 3) -> None:
    """(model, optimizer) pairs, the oracle first, take turns on the same batches; after every step the parameters
    must agree (fp32)."""
    for step in range(steps):
        for model, opt in (ref, dut):
            lm_loss(model, tokens(rank, step)).backward()
            opt.step()
            opt.zero_grad()
        want = _full(ref[0])
        for name, value in _full(dut[0]).items():
            assert_close(value, want[name], f"rank {rank} step {step}: {name}", 1e-5, 1e-6)


CASES = {
    # name: (optimizer, reshard_after_forward, bf16, accumulation micro-steps, frozen layer, hsdp)
    "recipe_sgd": ("sgd", None, False, 1, False, False),
    "adamw_keep_unsharded": ("adamw", False, False, 1, False, False),
    "adamw_reshard_to_2": ("adamw", 2, False, 1, False, False),
    "bf16": ("sgd", None, True, 1, False, False),  # AdamW's first steps are ±lr: a rounding flips them
    "no_sync_accumulation": ("sgd", None, False, 3, False, False),
    "frozen_layer": ("adamw", None, False, 1, True, False),
    "hsdp": ("adamw", None, False, 1, False, True),
}


def _parity(rank: int, world: int, case: str, steps: int = 5) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import shardkit

    optimizer, reshard, bf16, micro_steps, frozen, hsdp = CASES[case]
    ref_mesh, dut_mesh = _meshes(world, hsdp)
    base = tiny_lm()
    if frozen:
        base.layers[1].requires_grad_(False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    ref = _wrap(torch_fully_shard, copy.deepcopy(base), ref_mesh, reshard, mp)
    dut = _wrap(shardkit.fully_shard, copy.deepcopy(base), dut_mesh, reshard, mp)
    ddp = None if bf16 else TorchDDP(copy.deepcopy(base), process_group=gloo_world())
    models = [m for m in (ref, dut, ddp) if m is not None]
    optimizers = [_optimizer(optimizer, [p for p in m.parameters() if p.requires_grad]) for m in models]
    rtol, atol = (2e-2, 2e-3) if bf16 else (1e-5, 1e-6)
    for step in range(steps):
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            batch = tokens(rank, step, micro)
            for model in models:
                if model is ddp:
                    context = ddp.no_sync() if not last else contextlib.nullcontext()
                else:
                    model.set_requires_gradient_sync(last)
                    context = contextlib.nullcontext()
                with context:
                    lm_loss(model, batch).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        want, got = _full(ref), _full(dut)
        assert list(got) == list(want)
        for name, value in want.items():
            assert_close(got[name], value, f"rank {rank} step {step} {case}: {name} (shardkit vs torch FSDP2)",
                         rtol, atol)
            if ddp is not None:
                ddp_value = dict(ddp.module.named_parameters())[name].detach()
                assert_close(got[name], ddp_value, f"rank {rank} step {step} {case}: {name} (vs torch DDP)",
                             rtol, atol)
    shard_group = dut_mesh.get_group("shard" if hsdp else 0)
    return {"types": sorted({type(p).__name__ for p in dut.parameters()}),
            "zero_copy_calls": sum(pool.zero_copy_calls for pool in _pools(dut)),
            "pools": len(_pools(dut)),
            "units_reduced": sum(any(p.requires_grad for p in m.parameters()) for m in [*dut.layers, dut]),
            "shared_ops": shardkit.backend.cpu_backend(shard_group).shared_ops()}


def _pools(model: nn.Module) -> list[Any]:
    """The SharedReduceInput blocks the model's units lend their reduce-scatter inputs from (each once)."""
    return list({id(c.shared): c.shared for c in _reduce_scatters(model) if c.shared}.values())


def _reduce_scatters(model: nn.Module) -> list[Any]:
    from shardkit import _torch_compat
    from shardkit.fsdp import _fully_shard

    comms = [group._reduce_scatter_comm for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")
             for group in _torch_compat.fsdp2_param_groups(m)]
    assert all(isinstance(c, _fully_shard.UnitReduceScatter) for c in comms), comms
    return comms


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, case, hosts", [
    (2, "recipe_sgd", None), (3, "recipe_sgd", None), (4, "recipe_sgd", None),
    (2, "adamw_keep_unsharded", None), (4, "adamw_reshard_to_2", None), (3, "bf16", None),
    (2, "no_sync_accumulation", None), (2, "frozen_layer", None),
    (4, "hsdp", [0, 0, 1, 1]), (4, "recipe_sgd", [0, 0, 1, 1]),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, list) else str(v))
def test_fully_shard_trains_as_torch_fsdp2_and_ddp_on_gloo(ranks, world: int, case: str, hosts):
    for value in ranks.run(_parity, world, case, timeout=100, env=topology_env(hosts)):
        assert value["types"] == ["DTensor"]
        # A shard group on one host (HSDP's groups of 2 lie on one host each): every unit's reduce-scatter input
        # was made in shared memory (5 steps), and the engine read the peers' gradients in place (the blocks';
        # the root's 25 KB go through the slots). Across hosts, nothing is shared.
        if hosts is None or case == "hsdp":
            assert value["zero_copy_calls"] == 5 * value["units_reduced"] and value["pools"] == 1, value
            assert value["shared_ops"] >= 5 * 2, value
        else:
            assert value["zero_copy_calls"] == value["shared_ops"] == 0, value


def _methods(rank: int, world: int) -> list[str]:
    """torch's guide: explicit prefetching, an async unshard, several forwards before one backward (multi-view),
    set_is_last_backward / set_reshard_after_backward, a registered forward method — the same calls on both."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    ref_mesh, dut_mesh = _meshes(world, hsdp=False)
    models = []
    for shard, mesh in ((torch_fully_shard, ref_mesh), (shardkit.fully_shard, dut_mesh)):
        model = _wrap(shard, tiny_lm(), mesh)
        assert isinstance(model, TinyLM) and isinstance(model, FSDPModule)
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(layers[i - 1:i] if i else [])
        model.score = lambda batch, m=model: lm_loss(m, batch)  # noqa: B023 - bound per model
        register_fsdp_forward_method(model, "score")
        models.append(model)
    optimizers = [_optimizer("adamw", m.parameters()) for m in models]
    for step in range(3):
        for model in models:
            handle = model.unshard(async_op=True)
            handle.wait()
            model.set_is_last_backward(step == 2)
            model.set_reshard_after_backward(True)
            view_a, view_b = tokens(rank, step, 0), tokens(rank, step, 1)
            (model.score(view_a) + lm_loss(model, view_b)).backward()
            model.reshard()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        want, got = _full(models[0]), _full(models[1])
        for name, value in want.items():
            assert_close(got[name], value, f"rank {rank} step {step}: {name}", 1e-5, 1e-6)
    return list(want)


@pytest.mark.timeout(90)
def test_fsdp_module_methods_of_torchs_guide_behave_as_torchs(ranks):
    ranks.run(_methods, 2, timeout=80)


def _skipped_unit(rank: int, world: int) -> str:
    """After a good step, rank 1's forward leaves layer 1 out: its all-gather of layers.2 meets rank 0's of
    layers.1 (same shapes: without identities they would swap shards silently)."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit

    model = _wrap(shardkit.fully_shard, tiny_lm(), init_device_mesh("cpu", (world,)))
    lm_loss(model, tokens(rank, 0)).backward()
    if rank == 1:
        model.skip = {1}
    try:
        lm_loss(model, tokens(rank, 1)).backward()
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return str(error)
    return "no error"


@pytest.mark.timeout(60)
def test_ranks_that_run_different_units_fail_naming_both(ranks):
    for message in ranks.run(_skipped_unit, 2, timeout=50):
        assert "fully_shard unit 'layers.1'" in message and "fully_shard unit 'layers.2'" in message, message


def _reordered_units_on_gloo(rank: int, world: int) -> dict[str, Any]:
    """On a gloo mesh (no identities in the backend), after a good step rank 1 runs layers 2 and 1 swapped: the
    same number of collectives of the same shapes, which gloo pairs silently. The ledger's check at the end of
    that backward raises on every rank, before the optimizer steps."""
    from torch.distributed.device_mesh import DeviceMesh

    import shardkit

    model = _wrap(shardkit.fully_shard, tiny_lm(), DeviceMesh.from_group(gloo_world(), "cpu"))
    optimizer = _optimizer("sgd", model.parameters())
    lm_loss(model, tokens(rank, 0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    (ledger,) = {id(c.unit.ledger): c.unit.ledger for c in _reduce_scatters(model)}.values()
    checks_after_good_step = ledger.checks
    if rank == 1:
        model.order = [0, 2, 1]
    try:
        lm_loss(model, tokens(rank, 1)).backward()
    except RuntimeError as error:
        return {"message": str(error), "checks": checks_after_good_step}
    return {"message": "no error", "checks": checks_after_good_step}


@pytest.mark.timeout(60)
def test_on_gloo_ranks_that_run_units_in_another_order_fail_at_the_end_of_backward(ranks):
    for got in ranks.run(_reordered_units_on_gloo, 2, timeout=50):
        message = got["message"]
        assert got["checks"] == 1, got  # the good step was checked, and passed
        assert message.startswith("shardkit.fully_shard (rank ") and "ranks ran different units' collectives on the " \
            "shard group" in message, message
        assert "an all-gather of fully_shard unit 'layers.1'" in message, message
        assert "an all-gather of fully_shard unit 'layers.2'" in message, message



def _hf_gpt2(rank: int, world: int) -> list[tuple[float, float]]:
    """Hugging Face GPT-2 from a config (tied wte / lm_head), each GPT2Block then the root, as the HF Trainer's
    FSDP2 plug-in wraps it: shardkit against torch FSDP2 on gloo."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit
    from test_fsdp_models import gpt2
    from test_fsdp_models import tokens as gpt2_tokens

    models = []
    for shard, mesh in ((torch_fully_shard, DeviceMesh.from_group(gloo_world(), "cpu")),
                        (shardkit.fully_shard, init_device_mesh("cpu", (world,)))):
        model = gpt2()
        for block in model.transformer.h:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        assert model.lm_head.weight is model.transformer.wte.weight
        models.append(model)
    optimizers = [_optimizer("adamw", m.parameters()) for m in models]
    losses = []
    for step in range(5):
        ids = gpt2_tokens(rank, step)
        pair = []
        for model, opt in zip(models, optimizers):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(float(loss))
        want, got = _full(models[0]), _full(models[1])
        for name, value in want.items():
            assert_close(got[name], value, f"rank {rank} step {step}: {name}", 1e-5, 1e-6)
        losses.append(tuple(pair))
    return losses


@pytest.mark.timeout(120)
def test_hugging_face_gpt2_trains_as_with_torch_fsdp2(ranks):
    pytest.importorskip("transformers")
    for losses in ranks.run(_hf_gpt2, 2, timeout=110):
        for torch_loss, shardkit_loss in losses:
            assert shardkit_loss == pytest.approx(torch_loss, rel=1e-5), losses


def _big_root(rank: int, world: int) -> dict[str, int]:
    """A root (embedding + LM head) 16x a block's size: between iterations only a block's reduce-scatter input
    stays resident in the shared block; the root's part is given back and allocated again (one MIN allreduce)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    ref = _wrap(torch_fully_shard, tiny_lm(vocab=4096), DeviceMesh.from_group(gloo_world(), "cpu"))
    dut = _wrap(shardkit.fully_shard, tiny_lm(vocab=4096), init_device_mesh("cpu", (world,)))
    _train_side_by_side(rank, (ref, _optimizer("adamw", ref.parameters())),
                        (dut, _optimizer("adamw", dut.parameters())))
    (pool,) = _pools(dut)
    return {"resident": pool._memory.resident, "kept": pool._memory.kept, "bytes": pool._memory.memory.numel(),
            "block_input": 4 * sum(p.numel() for p in tiny_lm().layers[0].parameters()),
            "zero_copy_calls": pool.zero_copy_calls}


@pytest.mark.timeout(60)
def test_only_the_second_largest_reduce_input_stays_resident(ranks):
    for got in ranks.run(_big_root, 2, timeout=50):
        assert got["kept"] == got["resident"] == got["block_input"] < got["bytes"], got
        assert got["zero_copy_calls"] == 4 * 3, got

# --- checkpoints: torch FSDP2 <-> shardkit.fully_shard, at other world sizes, through shardkit.checkpoint ---------
GLOBAL_ROWS = 12  # one global batch per step, split evenly over 1, 2, 3 or 4 ranks


def _global_step(model, optimizer, rank: int, world: int, step: int) -> None:
    rows = GLOBAL_ROWS // world
    batch = tokens(0, step, rows=GLOBAL_ROWS)[rank * rows:(rank + 1) * rows]
    lm_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad()


def _wrapped(front: str, world: int):
    """The same model and AdamW under one front: "torch" (torch FSDP2 on gloo), "shardkit" (shardkit.fully_shard),
    "fsdp1" (shardkit's FSDP1 front, per-block units) or "zero2" (shardkit DDP, zero_stage=2)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    if front == "torch":
        model = _wrap(torch_fully_shard, tiny_lm(), DeviceMesh.from_group(gloo_world(), "cpu"))
    elif front == "shardkit":
        model = _wrap(shardkit.fully_shard, tiny_lm(), init_device_mesh("cpu", (world,)))
    elif front == "fsdp1":
        model = shardkit.FullyShardedDataParallel(tiny_lm(), auto_wrap_policy={Block})
    else:
        assert front == "zero2", front
        model = shardkit.DistributedDataParallel(tiny_lm(), zero_stage=2)
        return model, shardkit.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                                       lr=1e-2, weight_decay=0.01)
    return model, _optimizer("adamw", model.parameters())


def _whole(model: nn.Module, optimizer=None):
    """The model's (and optimizer's) state, every value whole, by the unwrapped model's names, for any front (a
    collective): shardkit.state_dict's functions, which hand torch's models to torch's."""
    from shardkit.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    whole = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=whole).items()}
    return get_state_dict(model, optimizer, options=whole)


def _save(rank: int, world: int, front: str, directory: str) -> None:
    """Trains 2 steps, saves (README's snippet), then 2 more steps: the run that never stopped, whose final
    parameters rank 0 keeps beside the checkpoint."""
    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict

    model, optimizer = _wrapped(front, world)
    for step in range(2):
        _global_step(model, optimizer, rank, world, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd}, directory)
    for step in range(2, 4):
        _global_step(model, optimizer, rank, world, step)
    final = _whole(model)
    if rank == 0:
        torch.save(final, Path(directory).with_suffix(".final.pt"))


def _resume(rank: int, world: int, front: str, directories: list[str]) -> None:
    """Loads each checkpoint (README's snippet), checks model and optimizer state bitwise against a torch-only read
    of the same files, then continues 2 steps: the same parameters as the run that never stopped."""
    import torch.distributed.checkpoint as dcp

    from shardkit import checkpoint
    from shardkit.state_dict import get_state_dict, set_state_dict

    for directory in directories:
        model, optimizer = _wrapped(front, world)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        checkpoint.load(state, directory)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        # bitwise: the whole state, gathered, against the checkpoint read by DCP alone into whole tensors
        full = _whole(model, optimizer)
        saved = {"model": {k: torch.empty_like(v) for k, v in full[0].items()},
                 "optim": _empty_like_tree(full[1])}
        dcp.load(saved, checkpoint_id=directory, process_group=gloo_world())
        _assert_bitwise(full[0], saved["model"], f"rank {rank}: {directory} model")
        _assert_bitwise(full[1], saved["optim"], f"rank {rank}: {directory} optimizer")
        for step in range(2, 4):
            _global_step(model, optimizer, rank, world, step)
        want = torch.load(Path(directory).with_suffix(".final.pt"))
        for name, value in _whole(model).items():
            assert_close(value, want[name], f"rank {rank}: resumed from {directory}: {name}", 1e-5, 1e-6)


def _empty_like_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: _empty_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_empty_like_tree(v) for v in tree]
    return tree


def _assert_bitwise(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"
        for key in want:
            _assert_bitwise(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_bitwise(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("saver, loader", [("torch", "shardkit"), ("shardkit", "torch")],
                         ids=["torch_fsdp2_to_shardkit", "shardkit_to_torch_fsdp2"])
def test_checkpoints_interchange_with_torch_fsdp2_at_every_world_size(ranks, tmp_path: Path, saver: str,
                                                                      loader: str):
    directories = []
    for n in (1, 2, 3, 4):
        directory = str(tmp_path / f"saved-by-{saver}-at-{n}")
        ranks.run(_save, n, saver, directory, timeout=60)
        directories.append(directory)
    for m in (1, 2, 3, 4):  # every saved world size into every loading world size
        ranks.run(_resume, m, loader, directories, timeout=90)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saver, n, loads", [
    ("fsdp1", 2, [("torch", 3), ("shardkit", 1), ("zero2", 4)]),
    ("zero2", 4, [("torch", 2), ("fsdp1", 3)]),
    ("torch", 3, [("fsdp1", 2), ("zero2", 4), ("fsdp1", 1)]),
    ("shardkit", 2, [("fsdp1", 4), ("zero2", 3)]),
], ids=["fsdp1_front", "zero2", "torch_fsdp2", "fully_shard"])
def test_checkpoints_of_every_front_load_into_every_other_and_torch_fsdp2(ranks, tmp_path: Path, saver: str, n: int,
                                                                         loads: list):
    # One format for shardkit's three fronts and torch FSDP2: parameters and optimizer state in their own shapes.
    directory = str(tmp_path / f"saved-by-{saver}-at-{n}")
    ranks.run(_save, n, saver, directory, timeout=60)
    for loader, m in loads:
        ranks.run(_resume, m, loader, [directory], timeout=90)


def _clip(rank: int, world: int) -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit

    plain = tiny_lm()
    model = _wrap(shardkit.fully_shard, copy.deepcopy(plain), init_device_mesh("cpu", (world,)))
    batch = tokens(0, 0, rows=GLOBAL_ROWS)
    rows = GLOBAL_ROWS // world
    lm_loss(model, batch[rank * rows:(rank + 1) * rows]).backward()
    lm_loss(plain, batch).backward()
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm=0.5)
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    assert_close(got, want, f"rank {rank}: total norm", 1e-5, 1e-6)
    for name, p in model.named_parameters():
        assert_close(p.grad.full_tensor(), dict(plain.named_parameters())[name].grad, f"clipped {name}", 1e-5, 1e-6)
    return float(got), float(want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_equals_torchs_on_the_unwrapped_model(ranks, world: int):
    ranks.run(_clip, world, timeout=50)


# --- the README's fully_shard section, as written --------------------------------------------------------------------

def _run_readme(rank: int, world: int, code: str) -> None:
    """The snippet wraps the model (the default mesh: the default shardkit group); torch's FSDP2 with the same
    policy on gloo is the oracle for 3 steps."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    namespace = {"model": tiny_lm()}
    exec(compile(code, "README.md#sharding-fully_shard", "exec"), namespace)
    model, optimizer = namespace["model"], namespace["optimizer"]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = _wrap(torch_fully_shard, tiny_lm(), DeviceMesh.from_group(gloo_world(), "cpu"), mp_policy=policy)
    _train_side_by_side(rank, (ref, torch.optim.AdamW(ref.parameters(), lr=1e-3)), (model, optimizer))


@pytest.mark.timeout(60)
def test_the_readme_fully_shard_snippet_runs_as_written(ranks):
    ((lang, code),) = harness.readme_blocks("Sharding: `shardkit.fully_shard`")
    assert lang == "python"
    assert "from shardkit import fully_shard" in code
    ranks.run(_run_readme, 2, code, timeout=50)


def _old_flat_checkpoint_into_fully_shard(rank: int, world: int, directory: str) -> str:
    """A checkpoint in the format shardkit wrote before 0.2 (flattened parameters, their shapes beside them)."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit
    from shardkit import checkpoint
    from shardkit.state_dict import get_model_state_dict

    plain = tiny_lm()
    old = {"model": {**{k: v.detach().reshape(-1).clone() for k, v in plain.state_dict().items()},
                     "_shardkit.shapes": json.dumps({k: list(v.shape) for k, v in plain.state_dict().items()})}}
    dcp.save(old, checkpoint_id=directory)
    model = _wrap(shardkit.fully_shard, tiny_lm(), init_device_mesh("cpu", (world,)))
    with pytest.raises(RuntimeError) as raised, pytest.warns(checkpoint.UnverifiedCheckpointWarning):
        checkpoint.load({"model": get_model_state_dict(model)}, directory)
    return str(raised.value)


@pytest.mark.timeout(60)
def test_an_old_flat_checkpoint_is_refused_naming_the_layouts_and_consolidates(ranks, tmp_path: Path):
    directory = tmp_path / "old"
    for message in ranks.run(_old_flat_checkpoint_into_fully_shard, 2, str(directory), timeout=50):
        assert ("model.wte.weight is [96, 64] in both, but the checkpoint holds it as [6144] and the state dict as "
                "[96, 64]: the layouts differ") in message, message
    from shardkit import checkpoint

    checkpoint.consolidate(directory, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)["model"]
    assert {k: v.shape for k, v in plain.items()} == {k: v.shape for k, v in tiny_lm().state_dict().items()}
    assert all(torch.equal(plain[k], v) for k, v in tiny_lm().state_dict().items())


# --- a second model on the same group, the first still alive on one rank only ------------------------------------

def _second_model_while_the_first_lives_on_one_rank(rank: int, world: int) -> list[float]:
    """Rank 0 keeps its first model (as a callback or a reference cycle may); rank 1 frees it. The second model's
    units are larger, so its first reduce-scatter needs a larger shared block: whether to grow it (a collective)
    must not depend on which ranks still hold the first model's."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    import shardkit

    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    first = _wrap(shardkit.fully_shard, tiny_lm(depth=2), mesh)
    first(tokens).sum().backward()
    if rank == 1:
        del first
        gc.collect()
    second = _wrap(shardkit.fully_shard, tiny_lm(seed=1, depth=2, vocab=4 * VOCAB), mesh)
    losses = []
    for _ in range(2):
        loss = second(tokens).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(60)
def test_a_model_freed_on_one_rank_only_changes_no_collective_of_the_next(ranks):
    got = ranks.run(_second_model_while_the_first_lives_on_one_rank, 2, timeout=50)
    assert all(len(losses) == 2 for losses in got), got

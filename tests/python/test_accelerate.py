"""shardkit inside Hugging Face accelerate (python/shardkit/integrations/accelerate.py), tried as its users train.

- Every strategy trains exactly as accelerate's own Accelerator does with torch's DDP on gloo (the anchor, run
  in its own launch), on one host and on two simulated hosts (SHARDKIT_HOST_ID: the hierarchical engine): the
  same loop (``prepare``, ``accumulate`` over 2 micro-batches, ``backward``, ``clip_grad_norm_``, ``step``), the
  same parameters after 3 steps, the same global gradient norm.
- The process group is shardkit's and accelerate says so; a CPU job is distributed without ``cpu=True``.
- ``save_model`` writes a plain Hugging Face checkpoint (no prefix, the tied weight once) that
  ``from_pretrained`` loads with no missing key, equal to the trained model.
- ``save_state`` at one world size, ``load_state`` at another: the resumed run continues as the run that never
  stopped; also with ``save_state(async_save=True)``, the next step trained while the save is in flight.
- ``strategy="auto"`` chooses with shardkit's memory math: a budget that holds DDP's model states gives ddp, one
  that holds only ZeRO-2's or ZeRO-3's gives zero2 or fully_shard, and the run trains as the anchor; one that
  holds only ZeRO-3 + CPU offload's raises, naming it.
- Wrong use raises, naming the feature: a model wrapped twice, an unknown strategy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

GLOBAL_BATCH = 12  # divisible by every world size used (1, 2, 3, 4) and by the 2 micro-batches
STEPS = 3
DIM = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TiedLM(nn.Module):
    """An embedding tied to the output head, two blocks: what Hugging Face causal LMs look like."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _data(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of micro-batch ``micro`` of global step ``step`` (the same global data at any world)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, 50, (GLOBAL_BATCH // 2, 5), generator=g)
    share = GLOBAL_BATCH // 2 // world
    return tokens[rank * share:(rank + 1) * share, :-1], tokens[rank * share:(rank + 1) * share, 1:]


def _train(accelerator, model, optimizer, rank: int, world: int, steps: range) -> list[float]:
    norms = []
    for step in steps:
        for micro in range(2):
            x, y = _data(step, micro, rank, world)
            with accelerator.accumulate(model):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)))
                optimizer.step()
                optimizer.zero_grad()
    return norms


def _full_params(accelerator, model) -> dict:
    """The whole model as numpy arrays (tensors would travel back through shared memory the rank frees)."""
    return {k: v.detach().numpy().copy() for k, v in accelerator.get_state_dict(model).items()}


def _auto_budget_gb(choice: str, world: int = 2) -> float:
    """A memory budget per rank (GB) in which the estimator's ``choice`` is the first rung that fits TiedLM + AdamW."""
    from shardkit import estimate

    states = estimate.model_states(TIED_LM_PARAMS, world, "fp32", "adam", master_weights=False)
    return states[choice].total_gb * 1.001


TIED_LM_PARAMS = 50 * DIM + 2 * (2 * DIM + DIM * DIM + DIM)  # the tied embedding once, two blocks


def _run(rank: int, world: int, store: str, strategy: str | None, steps: int = STEPS, auto_wrap: bool = True,
         budget: float | None = None):
    from accelerate.utils import InitProcessGroupKwargs

    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handlers = [InitProcessGroupKwargs(init_method=f"file://{store}")]
    if strategy is None:  # the anchor: accelerate's own Accelerator, torch's DDP on gloo
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=handlers)
    else:
        from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

        units = {Block} if auto_wrap and strategy in ("fully_shard", "fsdp") else None
        plugin = ShardkitPlugin(strategy=strategy, auto_wrap=units, memory_budget_gb=budget)
        accelerator = Accelerator(gradient_accumulation_steps=2, kwargs_handlers=handlers, shardkit_plugin=plugin)
    model, optimizer = accelerator.prepare(model, optimizer)
    norms = _train(accelerator, model, optimizer, rank, world, range(steps))
    import torch.distributed as dist

    params = _full_params(accelerator, model)  # a collective for the sharded strategies: every rank calls it
    return {"norms": norms, "params": params if rank == 0 else None,
            "backend": accelerator.state.backend, "pg_backend": dist.get_backend(),
            "processes": accelerator.num_processes, "wrapper": type(model).__name__,
            "resolved": plugin.resolved_strategy if strategy is not None else None,
            "planned_params": plugin.auto_plan.num_params if strategy == "auto" else None,
            "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__}


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    from support.harness import run

    workdir = tmp_path_factory.mktemp("anchor")
    return run(_run, 2, str(workdir / "store"), None, workdir=workdir, backend=None, timeout=90)


@pytest.mark.parametrize("hosts", [None, [0, 1]], ids=["one_host", "2_simulated_hosts"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fully_shard", "fsdp"])
def test_every_strategy_trains_as_accelerate_with_torch_ddp_on_gloo(ranks, tmp_path, anchor, strategy, hosts):
    from support.collective_cases import topology_env
    from support.harness import run

    results = run(_run, 2, str(tmp_path / "store"), strategy, workdir=tmp_path, backend=None, timeout=90,
                  env=topology_env(hosts))
    assert anchor[0]["pg_backend"] == "gloo" and anchor[0]["wrapper"] == "DistributedDataParallel"
    for result in results:
        assert result["backend"] == "shardkit" and result["pg_backend"] == "shardkit", result
        assert result["processes"] == 2, "a CPU job launched distributed must run distributed without cpu=True"
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(anchor[0]["norms"]),
                                   rtol=1e-5, atol=1e-6)
    expected_optimizer = "ZeroRedundancyOptimizer" if strategy in ("zero1", "zero2") else "AdamW"
    assert results[0]["optimizer"] == expected_optimizer
    ours, theirs = results[0]["params"], anchor[0]["params"]
    assert sorted(ours) == sorted(theirs)  # the unwrapped model's names, no prefix
    for name in theirs:
        torch.testing.assert_close(torch.from_numpy(ours[name]), torch.from_numpy(theirs[name]), rtol=1e-5, atol=1e-6,
                                   msg=f"{strategy}: {name}")


@pytest.mark.parametrize("choice,expected,wrapper", [("ddp", "ddp", "DistributedDataParallel"),
                                                     ("zero2", "zero2", "DistributedDataParallel"),
                                                     ("zero3", "fully_shard", "FSDPTiedLM")])
def test_auto_chooses_by_the_memory_budget_and_trains_as_the_anchor(ranks, tmp_path, anchor, choice, expected, wrapper):
    from support.harness import run

    results = run(_run, 2, str(tmp_path / "store"), "auto", workdir=tmp_path, backend=None, timeout=90,
                  budget=_auto_budget_gb(choice))
    for result in results:  # every rank chose the same
        assert (result["resolved"], result["wrapper"]) == (expected, wrapper), result
        assert result["planned_params"] == TIED_LM_PARAMS, result
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(anchor[0]["norms"]),
                                   rtol=1e-5, atol=1e-6)
    expected_optimizer = "ZeroRedundancyOptimizer" if expected == "zero2" else "AdamW"
    assert results[0]["optimizer"] == expected_optimizer
    for name, value in anchor[0]["params"].items():
        torch.testing.assert_close(torch.from_numpy(results[0]["params"][name]), torch.from_numpy(value), rtol=1e-5,
                                   atol=1e-6, msg=f"auto ({expected}): {name}")


# --- save_model -> from_pretrained ---------------------------------------------------------------------------

def _save_hf_model(rank: int, world: int, store: str, strategy: str, directory: str):
    from accelerate.utils import InitProcessGroupKwargs
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = ShardkitPlugin(strategy=strategy, auto_wrap={GPT2Block} if strategy in ("fully_shard", "fsdp") else None)
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(init_method=f"file://{store}")],
                              shardkit_plugin=plugin)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
    optimizer.step()
    # The two ways accelerate's guides save a Hugging Face model: save_model (weights; the config beside it) ...
    accelerator.save_model(model, f"{directory}/save_model")
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(f"{directory}/save_model")
    # ... and save_pretrained of the unwrapped model with the accelerator's state dict.
    accelerator.unwrap_model(model).save_pretrained(f"{directory}/save_pretrained",
                                                    is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save,
                                                    state_dict=accelerator.get_state_dict(model))
    trained = _full_params(accelerator, model)
    # Only the main process saves: the others get ZeRO's parameters as the views they are, not a copy each.
    names = {name for name, _ in accelerator.unwrap_model(model).named_parameters()}
    state = accelerator.get_state_dict(model)
    own = sorted(n for n in names if n in state and state[n].untyped_storage().nbytes() == state[n].nbytes)
    accelerator.wait_for_everyone()
    if rank != 0:
        return {"own_storage": own}
    from safetensors.torch import load_file

    result = {"trained": trained}
    for way in ("save_model", "save_pretrained"):
        saved = load_file(f"{directory}/{way}/model.safetensors")
        loaded, info = GPT2LMHeadModel.from_pretrained(f"{directory}/{way}", output_loading_info=True)
        result[way] = {"saved_keys": sorted(saved), "info": {k: list(v) for k, v in info.items() if k != "error_msgs"},
                       "loaded": {k: v.detach().numpy().copy() for k, v in loaded.state_dict().items()}}
    return result


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fully_shard", "fsdp"])
def test_save_model_writes_a_plain_hugging_face_checkpoint(tmp_path, strategy):
    pytest.importorskip("transformers")
    from support.harness import run

    result, other = run(_save_hf_model, 2, str(tmp_path / "store"), strategy, str(tmp_path / "model"),
                        workdir=tmp_path, backend=None, timeout=120)
    if strategy == "zero2":  # views of the flat buffer, no copy, off the main process
        assert other["own_storage"] == [], other["own_storage"][:3]
    for way in ("save_model", "save_pretrained"):
        saved = result[way]
        assert not any(k.startswith("module.") for k in saved["saved_keys"]), (way, saved["saved_keys"][:3])
        assert "transformer.wte.weight" in saved["saved_keys"] and "lm_head.weight" not in saved["saved_keys"], way
        assert not any(saved["info"].values()), (way, saved["info"])  # nothing missing, unexpected or mismatched
        for name, value in result["trained"].items():
            torch.testing.assert_close(torch.from_numpy(saved["loaded"][name]), torch.from_numpy(value), rtol=0,
                                       atol=0, msg=f"{strategy}, {way}: {name}")


# --- save_state at one world size, load_state at another -----------------------------------------------------

def _resume(rank: int, world: int, store: str, strategy: str, directory: str, phase: str, async_save: bool = False):
    from accelerate.utils import InitProcessGroupKwargs

    from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = ShardkitPlugin(strategy=strategy, auto_wrap={Block} if strategy in ("fully_shard", "fsdp") else None)
    accelerator = Accelerator(gradient_accumulation_steps=2, shardkit_plugin=plugin,
                              kwargs_handlers=[InitProcessGroupKwargs(init_method=f"file://{store}")])
    model, optimizer = accelerator.prepare(model, optimizer)
    if phase == "save":
        _train(accelerator, model, optimizer, rank, world, range(2))
        accelerator.save_state(directory, async_save=async_save)
        norms = _train(accelerator, model, optimizer, rank, world, range(2, 3))  # async: while the save runs
        accelerator.wait_for_checkpoint()
    else:
        accelerator.load_state(directory)
        norms = _train(accelerator, model, optimizer, rank, world, range(2, 3))
    params = _full_params(accelerator, model)
    return {"norms": norms, "params": params if rank == 0 else None}


@pytest.mark.parametrize("strategy,save_world,load_world,async_save",
                         [("zero2", 2, 3, False), ("fully_shard", 2, 3, False), ("fsdp", 3, 2, False),
                          ("zero1", 2, 1, False), ("fully_shard", 2, 3, True), ("fsdp", 3, 2, True)])
def test_save_state_resumes_at_another_world_size(tmp_path, strategy, save_world, load_world, async_save):
    from support.harness import run

    directory = str(tmp_path / "checkpoint")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    uninterrupted = run(_resume, save_world, str(tmp_path / "a" / "store"), strategy, directory, "save", async_save,
                        workdir=tmp_path / "a", backend=None, timeout=120)[0]
    resumed = run(_resume, load_world, str(tmp_path / "b" / "store"), strategy, directory, "load",
                  workdir=tmp_path / "b", backend=None, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(resumed["norms"]), torch.tensor(uninterrupted["norms"]), rtol=1e-5,
                               atol=1e-6)
    for name, value in uninterrupted["params"].items():
        torch.testing.assert_close(torch.from_numpy(resumed["params"][name]), torch.from_numpy(value), rtol=1e-5,
                                   atol=1e-6, msg=f"{strategy}: {name}")


# --- wrong use -------------------------------------------------------------------------------------------------

def test_plugin_refuses_what_it_cannot_do():
    from shardkit.integrations.accelerate import ShardkitPlugin

    assert ShardkitPlugin(strategy="auto").resolved_strategy is None  # decided at the first prepare of a model
    with pytest.raises(ValueError,
                       match=r"strategy must be one of ddp, zero1, zero2, fully_shard, fsdp or auto, got 'zero3'"):
        ShardkitPlugin(strategy="zero3")
    with pytest.raises(ValueError, match=r"comm_hook='bf16' applies to ddp, zero1 and zero2, not to strategy='auto'"):
        ShardkitPlugin(strategy="auto", comm_hook="bf16")
    with pytest.raises(ValueError, match=r"memory_budget_gb applies to strategy='auto', not to strategy='zero2'"):
        ShardkitPlugin(strategy="zero2", memory_budget_gb=1.0)
    with pytest.raises(ValueError, match=r"memory_budget_gb must be a positive number of GB, got -1"):
        ShardkitPlugin(strategy="auto", memory_budget_gb=-1)
    with pytest.raises(ValueError, match=r"comm_hook='fp16' applies to ddp, zero1 and zero2, not to strategy='fsdp'"):
        ShardkitPlugin(strategy="fsdp", comm_hook="fp16")
    with pytest.raises(ValueError, match=r"auto_wrap applies to fully_shard and fsdp .*, not to strategy='ddp'"):
        ShardkitPlugin(auto_wrap={Block})


def _wrapped_twice(rank: int, world: int, store: str):
    from accelerate.utils import InitProcessGroupKwargs

    import shardkit
    from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(init_method=f"file://{store}")],
                              shardkit_plugin=ShardkitPlugin(strategy="zero2"))
    errors = {}
    for name, model in (("shardkit_ddp", shardkit.DistributedDataParallel(TiedLM())),
                        ("inner_fsdp", nn.Sequential(shardkit.FullyShardedDataParallel(TiedLM())))):
        try:
            accelerator.prepare(model)
        except ValueError as error:
            errors[name] = str(error)
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    for p in sgd.param_groups[0]["params"]:
        sgd.state[p] = {"momentum_buffer": torch.zeros_like(p)}
    try:
        accelerator.prepare(sgd)
    except ValueError as error:
        errors["stateful_optimizer"] = str(error)
    offload_only = Accelerator(shardkit_plugin=ShardkitPlugin(strategy="auto",
                                                              memory_budget_gb=_auto_budget_gb("zero3_offload", world)))
    model = TiedLM()
    try:
        offload_only.prepare(model, torch.optim.AdamW(model.parameters()))
    except RuntimeError as error:
        errors["auto_offload"] = str(error)
    return errors


def test_prepare_refuses_a_model_already_wrapped_and_an_optimizer_with_state(tmp_path):
    from support.harness import run

    errors = run(_wrapped_twice, 2, str(tmp_path / "store"), workdir=tmp_path, backend=None, timeout=60)[0]
    assert "the model is already wrapped (DistributedDataParallel)" in errors["shardkit_ddp"], errors
    assert "a submodule is already wrapped (FullyShardedDataParallel)" in errors["inner_fsdp"], errors
    assert "the SGD already holds state" in errors["stateful_optimizer"], errors
    assert "ShardkitPlugin(strategy='auto') (rank 0): only ZeRO-3 + CPU offload fits" in errors["auto_offload"], errors


# --- the README's accelerate section, as written ----------------------------------------------------------------

def test_the_readme_shows_the_example_and_it_runs_under_torchrun(tmp_path):
    import re
    from pathlib import Path

    from support.harness import assert_readme_shows_example, run_torchrun

    example = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"
    assert_readme_shows_example("Hugging Face accelerate", example, 2)

    result = run_torchrun(example, 2, timeout=150, cwd=tmp_path)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert re.fullmatch(r"2 processes on shardkit: last gradient norm \d+\.\d{3}\n", result.stdout), result.stdout
    assert (tmp_path / "accelerate_checkpoint" / "shardkit").is_dir()


# --- mixed precision: every strategy against accelerate's own wrapping, in one launch ------------------------------

# The anchor of each strategy under accelerate's mixed_precision: its DDP on gloo for shardkit's DDP and ZeRO, its
# FSDP2 plugin for fully_shard, its FSDP1 plugin for the FSDP1 front (both plugins on gloo, on the CPU).
ANCHORS = {"ddp": "torch_ddp", "zero1": "torch_ddp", "zero2": "torch_ddp", "fully_shard": "torch_fsdp2",
           "fsdp": "torch_fsdp1"}


def _accelerate_on_gloo(engine: str, precision: str, store: str):
    """accelerate's own Accelerator, on gloo on the CPU: ``torch_ddp`` (``cpu=True``: its MULTI_CPU DDP) or, with a
    ``FullyShardedDataParallelPlugin`` of version 2 / 1, its FSDP (``torch_fsdp2`` / ``torch_fsdp1``). accelerate
    builds FSDP only on its MULTI_GPU path, which it takes only with CUDA: a process state that names gloo and
    MULTI_GPU, with ACCELERATE_TORCH_DEVICE=cpu as the device, takes that path on the CPU."""
    import os

    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    handlers = [InitProcessGroupKwargs(init_method=f"file://{store}")]
    if engine == "torch_ddp":
        return accelerate.Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=2,
                                      kwargs_handlers=handlers)

    class GlooAsMultiGpu(PartialState):
        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return "gloo", DistributedType.MULTI_GPU

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    GlooAsMultiGpu(**handlers[0].to_kwargs(), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    version = 2 if engine == "torch_fsdp2" else 1
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"],
                                            **({"reshard_after_forward": True} if version == 2 else
                                               {"sharding_strategy": "FULL_SHARD", "use_orig_params": True}))
    return accelerate.Accelerator(mixed_precision=precision, gradient_accumulation_steps=2, kwargs_handlers=handlers,
                                  fsdp_plugin=plugin)


def _mixed_precision_cells(rank: int, world: int, workdir: str, cells: list[tuple[str, str, str]]):
    """Each (engine, strategy, precision) cell in turn, in this one launch: its own process group (a fresh store),
    accelerate's state reset between cells. engine: ``shardkit`` (with ``strategy``) or an anchor
    (``_accelerate_on_gloo``; strategy None)."""
    import os
    import time

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import InitProcessGroupKwargs

    from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

    results = {}
    for i, (engine, strategy, precision) in enumerate(cells):
        store = f"{workdir}/store-{i}"
        torch.manual_seed(0)
        model = TiedLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        computed = []  # the dtype the first block's linear layer computes in
        model.blocks[0].fc.register_forward_hook(lambda module, args, out: computed.append(out.dtype))
        try:
            if engine == "shardkit":
                plugin = ShardkitPlugin(strategy=strategy,
                                        auto_wrap={Block} if strategy in ("fully_shard", "fsdp") else None)
                accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=precision,
                                          shardkit_plugin=plugin,
                                          kwargs_handlers=[InitProcessGroupKwargs(init_method=f"file://{store}")])
            else:
                accelerator = _accelerate_on_gloo(engine, precision, store)
            model, optimizer = accelerator.prepare(model, optimizer)
            norms = _train(accelerator, model, optimizer, rank, world, range(STEPS))
            if engine == "torch_fsdp1":  # accelerate's get_state_dict on torch's FSDP1 on the CPU crashes (SIGSEGV)
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
                params = {k: v.detach().numpy().copy() for k, v in full.items()}
            else:
                params = _full_params(accelerator, model)
            results[(engine, strategy, precision)] = {
                "norms": norms, "params": params if rank == 0 else None, "pg_backend": dist.get_backend(),
                "wrapper": type(model).__name__, "native_amp": accelerator.native_amp,
                "scaler": accelerator.scaler is not None, "computed": sorted({str(d) for d in computed})}
        finally:
            os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            if dist.is_initialized():
                dist.destroy_process_group()
            # The next cell drops this one's model, and with torch's DDP its Reducer's gloo group, whose destructor
            # joins gloo's worker threads holding the GIL; a worker still destroying its last Work needs the GIL
            # (the Work's captured thread-local state holds a Python object): a deadlock seen once on a loaded
            # machine. Releasing the GIL here lets such a worker finish first.
            time.sleep(0.05)
    return results


MIXED = ("bf16", "fp16")
DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


@pytest.fixture(scope="module")
def mixed_precision_runs(tmp_path_factory):
    """Every strategy and its anchor under bf16 and fp16: one launch of 2 ranks."""
    from support.harness import run

    workdir = tmp_path_factory.mktemp("mixed")
    cells = [cell for precision in MIXED for strategy in ANCHORS
             for cell in (("shardkit", strategy, precision), (ANCHORS[strategy], None, precision))]
    cells = list(dict.fromkeys(cells))  # one anchor run serves ddp, zero1 and zero2
    return run(_mixed_precision_cells, 2, str(workdir), cells, workdir=workdir, backend=None, timeout=400)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("strategy", list(ANCHORS))
def test_mixed_precision_trains_as_accelerate_with_torch_wrappers_on_gloo(mixed_precision_runs, strategy, precision):
    ours = mixed_precision_runs[("shardkit", strategy, precision)]
    theirs = mixed_precision_runs[(ANCHORS[strategy], None, precision)]
    assert theirs["pg_backend"] == "gloo" and ours["pg_backend"] == "shardkit", (ours, theirs)
    # accelerate's own choices: bf16 autocast on the CPU; fp16 on the CPU neither autocast nor a scaler (accelerate
    # allows fp16 autocast only on accelerators), so DDP computes in fp32 and the FSDP plugins in the policy's fp16.
    assert (ours["native_amp"], ours["scaler"]) == (theirs["native_amp"], theirs["scaler"]) == \
        (precision == "bf16", False), (ours, theirs)
    expected = "torch.float32" if (precision, ANCHORS[strategy]) == ("fp16", "torch_ddp") else DTYPES[precision]
    assert ours["computed"] == theirs["computed"] == [expected], (ours["computed"], theirs["computed"])
    torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(theirs["norms"]), rtol=1e-5, atol=1e-6)
    assert sorted(ours["params"]) == sorted(theirs["params"])
    for name, value in theirs["params"].items():
        torch.testing.assert_close(torch.from_numpy(ours["params"][name]), torch.from_numpy(value), rtol=1e-5,
                                   atol=1e-6, msg=f"{strategy}, {precision}: {name}")

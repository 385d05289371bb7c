"""shardkit.FullyShardedDataParallel on real models and setups: a Hugging Face GPT-2, bf16 mixed precision,
HYBRID_SHARD over simulated hosts, model-state bytes per rank, and other backends and strategies.

The oracle is torch DDP on a gloo group over every rank (fsdp_cases.FsdpPair): same module, same optimizer,
same per-rank batches, lock step; after every step shardkit's full state dict must equal DDP's (fp32:
rtol 1e-5). Memory is counted from the tensors themselves (parameter shards, gradients, AdamW's exp_avg and
exp_avg_sq) and compared to the exact figure the flat layouts imply and to shardkit.estimate's ZeRO-3 row.

What it can catch: a transformer block's kwargs/outputs mishandled by the unit hooks, a tied embedding
sharded or reduced twice, names that differ from the unwrapped model's, bf16 casts missing (or applied to
the master shards), hybrid groups that shard across hosts or forget the replica all-reduce, a gradient or
optimizer state larger than this rank's shard, and anything that only works on shardkit's own backend.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from support.fsdp_cases import D_IN, D_OUT, Block, FsdpPair, adamw, batch, block_policy, net

WARM = 5  # parity steps


def fsdp_module():
    import shardkit.fsdp

    return shardkit.fsdp


# --- a. Hugging Face GPT-2 (tiny config, tied wte / lm_head) -------------------------------------------

def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 104_729 * step + 3)
    return torch.randint(0, 64, (2 + rank, 8), generator=g)  # uneven batches


def _gpt2_parity(rank: int, world: int) -> dict:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from shardkit.wrap import transformer_auto_wrap_policy

    model = gpt2()
    unwrapped_names = [n for n, _ in model.named_parameters()]
    pair = FsdpPair(model, adamw, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                     transformer_layer_cls={GPT2Block}))
    dut = pair.dut.module
    names = [n for n, _ in pair.dut.named_parameters()]
    losses = []
    for step in range(WARM):
        pair.ref_opt.zero_grad()
        pair.dut_opt.zero_grad()
        ids = tokens(rank, step)
        ref_loss = pair.ref(ids, labels=ids).loss
        ref_loss.backward()
        dut_loss = pair.dut(ids, labels=ids).loss
        dut_loss.backward()
        pair.ref_opt.step()
        pair.dut_opt.step()
        pair.check(f"rank {rank} step {step}")
        losses.append((float(ref_loss), float(dut_loss)))
    return {
        "units": [u.name or "(root)" for u in pair.dut._units],
        "names": names,
        "unwrapped_names": unwrapped_names,
        "tied_is_one_parameter": dut.lm_head.weight is dut.transformer.wte.weight,
        "local_numel": sum(p.numel() for p in pair.dut.parameters()),
        "model_numel": sum(p.numel() for p in model.parameters()),
        "losses": losses,
    }


@pytest.mark.timeout(300)
def test_gpt2_transformer_wrap_matches_torch_ddp(ranks):
    results = ranks.run(_gpt2_parity, 2, timeout=240)
    first = results[0]
    assert first["units"] == ["(root)", "transformer.h.0", "transformer.h.1"]
    assert first["names"] == first["unwrapped_names"], "named_parameters() keys differ from the unwrapped model's"
    assert first["names"].count("transformer.wte.weight") == 1 and "lm_head.weight" not in first["names"]
    for rank, r in enumerate(results):
        assert r["tied_is_one_parameter"], f"rank {rank}: lm_head.weight is no longer transformer.wte.weight"
        for step, (want, got) in enumerate(r["losses"]):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: loss {got} vs torch DDP {want}"
    # The tied weight is sharded once: the ranks' pieces add up to the model's distinct parameters.
    assert sum(r["local_numel"] for r in results) == first["model_numel"] == 28_032


# --- b. bf16 mixed precision against fp32 torch DDP -----------------------------------------------------

def _bf16_losses(rank: int, world: int) -> dict:
    fsdp = fsdp_module()
    mp = fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    pair = FsdpPair(net(), mixed_precision=mp, auto_wrap_policy=block_policy())
    losses = [pair.step(rank, step, check=False) for step in range(20)]
    pair.check(f"rank {rank} after 20 bf16 steps", rtol=0.05, atol=0.02)
    return {
        "losses": losses,
        "param_dtypes": sorted({str(p.dtype) for p in pair.dut.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in pair.dut.parameters() if p.grad is not None}),
        "compute_dtypes": sorted({str(g.handle.compute_dtype) for u in pair.dut._units for g in u.groups}),
    }


@pytest.mark.timeout(300)
def test_bf16_mixed_precision_tracks_fp32_torch_ddp(ranks):
    results = ranks.run(_bf16_losses, 2, timeout=240)
    for rank, r in enumerate(results):
        for step, (want, got) in enumerate(r["losses"]):
            assert abs(got - want) <= 1e-2, f"rank {rank} step {step}: bf16 loss {got} vs fp32 {want}"
        # bf16 really ran: some loss differs from fp32, the compute buffers are bf16, the master shards not.
        assert any(got != want for want, got in r["losses"]), f"rank {rank}: bf16 losses equal fp32's bit for bit"
        assert r["compute_dtypes"] == ["torch.bfloat16"], r["compute_dtypes"]
        assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r


# --- c. HYBRID_SHARD over 2 simulated hosts x 2 ranks --------------------------------------------------

def _hybrid(rank: int, world: int) -> dict:
    fsdp = fsdp_module()
    model = net()
    pair = FsdpPair(model, adamw, sharding_strategy=fsdp.ShardingStrategy.HYBRID_SHARD,
                    auto_wrap_policy=block_policy())
    for step in range(WARM):
        pair.step(rank, step)
    handles = [g.handle for u in pair.dut._units for g in u.groups]
    return {
        "local_numel": sum(p.numel() for p in pair.dut.parameters()),
        "model_numel": sum(p.numel() for p in model.parameters()),
        "layout_worlds": sorted({h.layout.world for h in handles}),
        "shards": [(h.layout.shard_numel, h.layout.padded_numel, h.shard.numel()) for h in handles],
        "owned": sum(h.layout.owned_numel(rank % 2) for h in handles),  # rank % 2: its rank inside the host
        "padding": sum(h.layout.padded_numel - h.layout.param_numel for h in handles),
        "pieces": [p.detach().clone() for p in pair.dut.parameters()],
    }


@pytest.mark.timeout(420)
def test_hybrid_shard_two_hosts_matches_torch_ddp(ranks):
    env = [{"SHARDKIT_HOST_ID": host} for host in ("host0", "host0", "host1", "host1")]
    results = ranks.run(_hybrid, 4, timeout=360, env=env)
    model_numel = results[0]["model_numel"]
    for host_ranks in ((0, 1), (2, 3)):
        assert sum(results[r]["local_numel"] for r in host_ranks) == model_numel, (
            f"ranks {host_ranks} (one host) together should hold the model once")
    for rank, r in enumerate(results):
        assert r["layout_worlds"] == [2], f"rank {rank}: sharded over {r['layout_worlds']} ranks, not the host's 2"
        for shard, padded, held in r["shards"]:
            assert held == shard and 2 * shard == padded, f"rank {rank}: shard {held} of padded {padded}"
        assert r["local_numel"] == r["owned"], f"rank {rank}: holds {r['local_numel']}, its layouts say {r['owned']}"
        assert abs(r["local_numel"] - model_numel / 2) <= r["padding"], (
            f"rank {rank}: holds {r['local_numel']} of {model_numel} elements, not half (padding {r['padding']})")
    # Replicas across hosts (local rank i on each host) hold identical pieces.
    for a, b in ((0, 2), (1, 3)):
        for pa, pb in zip(results[a]["pieces"], results[b]["pieces"]):
            assert torch.equal(pa, pb), f"ranks {a} and {b} (replicas) disagree"


# --- d. model-state bytes per rank with AdamW ---------------------------------------------------------

class WideNet(nn.Module):
    """150,285 parameters: an input layer, a projection, two Blocks of width 128, a head (odd sizes: padded)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, 129)
        self.proj = nn.Linear(129, 128, bias=False)
        self.blocks = nn.ModuleList([Block(128), Block(128)])
        self.head = nn.Linear(128, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.tanh(self.embed(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat shard count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _state_bytes(rank: int, world: int) -> dict:
    import shardkit

    torch.manual_seed(0)
    model = WideNet()
    psi = sum(p.numel() for p in model.parameters())
    dut = shardkit.FullyShardedDataParallel(model, auto_wrap_policy=block_policy())
    opt = adamw(dut.parameters())
    x, y = batch(rank, 0)
    F.mse_loss(dut(x), y).backward()
    opt.step()
    params = list(dut.parameters())
    layouts = [g.handle.layout for u in dut._units for g in u.groups]
    state = [opt.state[p] for p in params]
    return {
        "psi": psi,
        "param_bytes": _storage_bytes(params),
        "grad_bytes": _storage_bytes([p.grad for p in params]),
        "optimizer_bytes": sum(s[k].numel() * s[k].element_size() for s in state for k in ("exp_avg", "exp_avg_sq")),
        "optimizer_storage_bytes": sum(s[k].untyped_storage().nbytes()
                                       for s in state for k in ("exp_avg", "exp_avg_sq")),
        "local_numel": sum(p.numel() for p in params),
        "layouts": [(lay.shard_numel, lay.owned_numel(rank), lay.padded_numel, lay.param_numel) for lay in layouts],
    }


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [2, 3])
def test_adamw_model_state_bytes_are_a_shard(ranks, world):
    from shardkit.estimate import model_states

    results = ranks.run(_state_bytes, world, timeout=240)
    psi = results[0]["psi"]
    assert psi == 150_285 and psi >= 100_000
    padding = sum(padded - params for _, _, padded, params in results[0]["layouts"])  # gaps + tail, all ranks
    assert padding > 0, "the model was chosen so the layouts pad"
    estimate = model_states(psi, world, precision="fp32", optimizer="adamw")["zero3"]
    assert estimate.total_bytes == 16 * psi / world
    for rank, r in enumerate(results):
        shards = sum(s for s, _, _, _ in r["layouts"])
        owned = sum(o for _, o, _, _ in r["layouts"])
        assert r["local_numel"] == owned, f"rank {rank}: parameters hold {r['local_numel']} elements, owns {owned}"
        assert r["param_bytes"] == 4 * shards, f"rank {rank}: parameter storage {r['param_bytes']} B"
        assert r["grad_bytes"] == 4 * shards, f"rank {rank}: gradient storage {r['grad_bytes']} B"
        assert r["optimizer_bytes"] == r["optimizer_storage_bytes"] == 8 * owned, (
            f"rank {rank}: AdamW state {r['optimizer_bytes']} B ({r['optimizer_storage_bytes']} B of storage)")
        total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        assert total == 16 * shards - 8 * (shards - owned)
        assert abs(total - 16 * psi / world) <= 0.01 * 16 * psi / world, f"rank {rank}: {total} B vs 16*Psi/N"
        # shardkit.estimate's ZeRO-3 row, up to the padding: total - estimate = 16*padding/N - 8*(unowned here).
        assert -8 * padding <= total - estimate.total_bytes <= 16 * padding / world, (
            f"rank {rank}: {total} B vs estimate {estimate.total_bytes} B (padding {padding} elements)")
    assert sum(r["local_numel"] for r in results) == psi


# --- e. other backends and strategies ------------------------------------------------------------------

def _gloo_full_shard(rank: int, world: int) -> list[tuple[float, float]]:
    pair = FsdpPair(net(), adamw, dut_backend="gloo", auto_wrap_policy=block_policy())
    assert dist.get_backend(pair.dut.process_group) == "gloo"
    return [pair.step(rank, step) for step in range(WARM)]


@pytest.mark.timeout(300)
def test_full_shard_on_a_gloo_group_matches_torch_ddp(ranks):
    for rank, losses in enumerate(ranks.run(_gloo_full_shard, 2, timeout=240)):
        for step, (want, got) in enumerate(losses):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: loss {got} vs {want}"


def _strategies(rank: int, world: int) -> dict:
    fsdp = fsdp_module()
    out = {}
    for strategy in (fsdp.ShardingStrategy.SHARD_GRAD_OP, fsdp.ShardingStrategy.NO_SHARD):
        model = net(seed=3)
        pair = FsdpPair(model, adamw, sharding_strategy=strategy, auto_wrap_policy=block_policy())
        for step in range(WARM):
            pair.step(rank, step)  # raises, naming the step, at the first parameter off torch DDP's
        out[strategy.name] = sum(p.numel() for p in pair.dut.parameters())
    out["model_numel"] = sum(p.numel() for p in net().parameters())
    return out


@pytest.mark.timeout(420)
def test_shard_grad_op_and_no_shard_at_world_3_with_adamw(ranks):
    results = ranks.run(_strategies, 3, timeout=360)
    model_numel = results[0]["model_numel"]
    assert sum(r["SHARD_GRAD_OP"] for r in results) == model_numel, "SHARD_GRAD_OP: the shards partition the model"
    assert all(r["NO_SHARD"] == model_numel for r in results), "NO_SHARD: every rank holds the whole model"


def _full_shard_across_hosts(rank: int, world: int) -> list[int]:
    fsdp = fsdp_module()
    pair = FsdpPair(net(), adamw, sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD, auto_wrap_policy=block_policy())
    for step in range(WARM):
        pair.step(rank, step)
    return sorted({g.handle.layout.world for u in pair.dut._units for g in u.groups})


@pytest.mark.timeout(300)
def test_full_shard_across_two_simulated_hosts_matches_torch_ddp(ranks):
    """The shard group spans hosts: the in-place all-gather and the reduce-scatter go through the backend's
    hierarchical engine (shared memory inside a host, gloo between hosts), with hosts interleaved."""
    env = [{"SHARDKIT_HOST_ID": host} for host in ("host0", "host1", "host0", "host1")]
    for rank, worlds in enumerate(ranks.run(_full_shard_across_hosts, 4, timeout=240, env=env)):
        assert worlds == [4], f"rank {rank}: sharded over {worlds} ranks, not all 4"

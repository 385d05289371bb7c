"""Tensor parallelism on shardkit's backend: torch's own TP (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``, DTensor redistributions), sequence parallelism (``SequenceParallel`` norms between
projections that gather and scatter the sequence) and ``shardkit.fully_shard`` + TP on a 2-D mesh.

shardkit builds no TP of its own: torch's TP is DTensor code that issues ordinary c10d collectives (all-reduce,
all-gather, reduce-scatter) on the mesh's groups, so on a mesh over the ``shardkit`` group it runs on shardkit's
collectives. The oracle is the identical run on a **gloo** mesh over the same ranks, in the same processes (no
shardkit code on its path: torch's ``fully_shard`` where shardkit's is under test); both train deep copies of one
model on the same batches, taking turns. With 2 ranks per reduction (2 ranks of TP; a 2 x 2 mesh), every sum has
one order, so the losses and every parameter after every step are asserted **bitwise** equal.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from support import harness  # noqa: E402
from support.ddp_cases import gloo_world  # noqa: E402

D, HEADS, SEQ = 16, 4, 6


class AttentionMLP(nn.Module):
    """One pre-norm transformer block: multi-head self-attention (q, k, v column-wise, o row-wise: each TP rank
    holds whole heads) and an MLP (up column-wise, down row-wise)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.o = nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        # -1 heads: under TP each rank holds HEADS / tp of them
        q, k, v = (proj(h).view(b, s, -1, D // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([AttentionMLP(), AttentionMLP()])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "up")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "down")})
    return plan


def _batch(data_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel rank ``data_rank`` (every TP rank of it gets the same one)."""
    g = torch.Generator().manual_seed(7919 * data_rank + 104_729 * step + 3)
    return torch.randn(3, SEQ, D, generator=g), torch.randn(3, SEQ, 1, generator=g)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for name, value in got.items():
        assert torch.equal(value, want[name]), (f"{what}: {name} differs by "
                                                f"{(value - want[name]).abs().max().item():.3e}")


def _train_side_by_side(rank: int, ref: nn.Module, dut: nn.Module, data_rank: int, steps: int = 3) -> list[float]:
    """ref and dut take turns on the same batches (AdamW); losses and parameters compared bitwise after every
    step. Returns dut's losses."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (ref, dut)]
    losses = []
    for step in range(steps):
        x, y = _batch(data_rank, step)
        pair = []
        for model, optimizer in zip((ref, dut), optimizers):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pair.append(loss.detach())
        assert torch.equal(pair[0], pair[1]), f"rank {rank} step {step}: loss {pair[1].item()!r} on shardkit, " \
                                              f"{pair[0].item()!r} on gloo"
        _assert_bitwise(_full(dut), _full(ref), f"rank {rank} step {step}")
        losses.append(pair[1].item())
    return losses


def _tp_rank(rank: int, world: int) -> dict:
    """TP over both ranks: ColwiseParallel / RowwiseParallel blocks, plus DTensor redistributions on each mesh."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    gloo_mesh = DeviceMesh.from_group(gloo_world(), "cpu")
    mesh = init_device_mesh("cpu", (world,))
    assert dist.get_backend(mesh.get_group()) == "shardkit" and dist.get_backend(gloo_mesh.get_group()) == "gloo"

    # every redistribution between Shard(0), Shard(1), Replicate and Partial, on both meshes: the same bytes
    full = torch.arange(6 * 10, dtype=torch.float32).view(6, 10).sin()
    placements = [Shard(0), Shard(1), Replicate()]
    for source in placements + [Partial()]:
        for target in placements:
            results = []
            for m in (gloo_mesh, mesh):
                if isinstance(source, Partial):  # each rank holds a share of the sum
                    from torch.distributed.tensor import DTensor

                    t = DTensor.from_local(full * (rank + 1), m, [Partial()])
                else:
                    t = distribute_tensor(full, m, [source])
                results.append(t.redistribute(m, [target]).to_local())
            assert torch.equal(results[0], results[1]), f"rank {rank}: {source} -> {target}"

    torch.manual_seed(0)
    model = TwoBlocks()
    ref = parallelize_module(copy.deepcopy(model), gloo_mesh, _tp_plan())
    dut = parallelize_module(copy.deepcopy(model), mesh, _tp_plan())
    assert dut.blocks[0].q.weight.to_local().shape == (D // world, D)  # sharded, not replicated
    return {"losses": _train_side_by_side(rank, ref, dut, data_rank=0)}


class SequenceParallelBlock(AttentionMLP):
    """AttentionMLP whose activations between the projections stay split along the sequence (Megatron-style sequence
    parallelism): the norm runs on each rank's share of the tokens, the column-wise projections all-gather the
    sequence, the row-wise ones reduce-scatter back onto it. Shapes are read from the tensors (the sequence length
    differs between the split and the gathered activations)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (t.view(t.shape[0], t.shape[1], -1, D // HEADS).transpose(1, 2)
                   for t in (self.q(h), self.k(h), self.v(h)))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self.o(attn.reshape(attn.shape[0], attn.shape[1], -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _sp_rank(rank: int, world: int) -> dict:
    """Sequence parallelism over both ranks: SequenceParallel norms, ColwiseParallel(input_layouts=Shard(1)) and
    RowwiseParallel(output_layouts=Shard(1)); each rank feeds its share of the sequence and computes the loss on
    it."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    gloo_mesh = DeviceMesh.from_group(gloo_world(), "cpu")
    mesh = init_device_mesh("cpu", (world,))
    plan = {"norm": SequenceParallel(), "o": RowwiseParallel(output_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            **{n: ColwiseParallel(input_layouts=Shard(1)) for n in ("q", "k", "v", "up")}}
    torch.manual_seed(0)
    model = SequenceParallelBlock()
    ref, dut = (parallelize_module(copy.deepcopy(model), m, plan) for m in (gloo_mesh, mesh))
    assert dut.q.weight.to_local().shape == (D // world, D)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, dut)]
    share = SEQ // world
    losses = []
    for step in range(3):
        x, y = _batch(0, step)
        x, y = x[:, rank * share:(rank + 1) * share], y[:, rank * share:(rank + 1) * share]
        pair = []
        for m, optimizer in zip((ref, dut), optimizers, strict=True):
            out = m(x)
            assert out.shape[1] == share  # the block's output stays split along the sequence
            loss = nn.functional.mse_loss(out.sum(-1, keepdim=True), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pair.append(loss.detach())
        assert torch.equal(pair[0], pair[1]), f"rank {rank} step {step}: {pair[1].item()!r} vs {pair[0].item()!r}"
        _assert_bitwise(_full(dut), _full(ref), f"sequence parallel rank {rank} step {step}")
        losses.append(pair[1].item())
    return {"losses": losses}


def _fsdp_tp_rank(rank: int, world: int) -> dict:
    """FSDP2 + TP on a 2 x 2 mesh ("dp", "tp"): TP inside each row, fully_shard over each column; shardkit's
    fully_shard on the shardkit mesh against torch's fully_shard on the gloo mesh."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import shardkit

    names = ("dp", "tp")
    layout = torch.arange(world).view(2, world // 2)
    # gloo subgroups for the oracle: every rank creates every group, in the same order (new_group is collective)
    rows = [dist.new_group(r.tolist(), backend="gloo") for r in layout]
    cols = [dist.new_group(c.tolist(), backend="gloo") for c in layout.t()]
    tp_group = next(g for g, r in zip(rows, layout) if rank in r.tolist())
    dp_group = next(g for g, c in zip(cols, layout.t()) if rank in c.tolist())
    gloo_mesh = DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh=layout, mesh_dim_names=names)
    mesh = init_device_mesh("cpu", tuple(layout.shape), mesh_dim_names=names)
    assert dist.get_backend(mesh["dp"].get_group()) == "shardkit"

    torch.manual_seed(0)
    model = TwoBlocks()
    pairs = []
    for m, shard in ((gloo_mesh, torch_fully_shard), (mesh, shardkit.fully_shard)):
        replica = parallelize_module(copy.deepcopy(model), m["tp"], _tp_plan())
        for block in replica.blocks:
            shard(block, mesh=m["dp"])
        pairs.append(shard(replica, mesh=m["dp"]))
    ref, dut = pairs
    weight = dut.blocks[0].q.weight  # rows split over "tp" (ColwiseParallel), then those over "dp" (FSDP2)
    assert weight.device_mesh.mesh_dim_names == names and weight.to_local().shape == (D // world, D)
    assert weight.placements[1].is_shard(0) and getattr(weight.placements[0], "dim", None) == 0, weight.placements
    assert type(dut.blocks[0]).__name__.startswith("FSDP")
    data_rank = rank // (world // 2)  # the rank's coordinate on "dp": each TP group (a row) gets its own batches
    return {"losses": _train_side_by_side(rank, ref, dut, data_rank=data_rank)}


@pytest.mark.timeout(240)
def test_tensor_parallel_on_shardkit_is_bitwise_gloo(tmp_path):
    results = harness.run(_tp_rank, 2, workdir=tmp_path, timeout=180)
    assert results[0]["losses"] == results[1]["losses"]  # TP ranks see one batch: one loss
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.timeout(240)
def test_sequence_parallel_on_shardkit_is_bitwise_gloo(tmp_path):
    results = harness.run(_sp_rank, 2, workdir=tmp_path, timeout=180)
    assert results[0]["losses"] != results[1]["losses"]  # each rank's loss is on its own share of the sequence


@pytest.mark.timeout(300)
def test_fully_shard_with_tensor_parallel_on_a_2x2_mesh_is_bitwise_gloo(tmp_path):
    results = harness.run(_fsdp_tp_rank, 4, workdir=tmp_path, timeout=240)
    assert results[0]["losses"] == results[1]["losses"] and results[2]["losses"] == results[3]["losses"]
    assert results[0]["losses"] != results[2]["losses"]  # the two TP groups train on different batches

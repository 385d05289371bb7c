"""Pipeline and expert parallelism on shardkit's backend: torch's own ``torch.distributed.pipelining`` (GPipe and
1F1B schedules, whose stages exchange activations and gradients by batched isend/irecv) and an expert-parallel MoE
layer (tokens dispatched to the experts' ranks and back by ``all_to_all_single`` with uneven splits, as MoE layers
do, through torch's autograd-aware functional ``all_to_all_single_autograd``), each alone and each with
``fully_shard`` on a 2 x 2 mesh (GPipe over "pp" with every stage sharded over "dp"; experts over "ep", every
module sharded over "dp"), where torch's ``fully_shard`` on a gloo mesh over the same ranks is the oracle.

shardkit builds neither: both are torch code issuing ordinary c10d point-to-point ops and all-to-alls, which run on
shardkit's backend when their group is a shardkit group. The oracle is the identical run on a **gloo** group over the
same ranks, in the same processes, taking turns on deep copies of one model: point-to-point and all-to-all move
bytes without reducing them, so losses and every parameter after every step are asserted **bitwise** equal — on one
host and with the ranks split into simulated hosts (SHARDKIT_HOST_ID: the hierarchical engine's paths).
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

D = 16
STEPS = 3


def _hosts(world: int, hosts: int, **env: str) -> list[dict[str, str]] | None:
    """Each rank's SHARDKIT_HOST_ID for ``hosts`` simulated hosts of consecutive ranks (None: one host), and ``env``."""
    if hosts == 1:
        return [dict(env) for _ in range(world)] if env else None
    return [{"SHARDKIT_HOST_ID": f"host{rank * hosts // world}", **env} for rank in range(world)]


# The pipelines' activations are small: every point-to-point message between ranks of one host takes the direct
# route (csrc/comm/local_p2p.h) here, the rest gloo.
DIRECT = {"SHARDKIT_P2P_DIRECT_BYTES": "1"}


def _direct_bytes(group: dist.ProcessGroup | None = None) -> int:
    """What this rank received on the direct route (read from a peer's memory) in ``group`` (default: the world)."""
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).direct_p2p_bytes()


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), what
    for name, value in got.items():
        assert torch.equal(value, want[name]), (f"{what}: {name} differs by "
                                                f"{(value - want[name]).abs().max().item():.3e}")


# --- pipeline parallelism --------------------------------------------------------------------------------------

class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _train_pipelines(runs: list, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor, what: str) -> list[float]:
    """The (module, schedule, optimizer) runs take turns for STEPS steps on one batch: the first stage feeds ``x``,
    the last computes the loss against ``y``; after every step the runs' losses and parameters must be bitwise
    equal. Returns the last stage's losses (empty elsewhere)."""
    last = stage == stages - 1
    losses = []
    for step in range(STEPS):
        pair = []
        for module, schedule, optimizer in runs:
            step_losses: list[torch.Tensor] = []
            if stage == 0:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=step_losses)
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad()
            pair.append((torch.stack(step_losses) if last else None, _full(module)))
        (ref_losses, ref_params), (losses_now, params_now) = pair
        if last:
            assert torch.equal(ref_losses, losses_now), f"{what} step {step}: {losses_now} vs {ref_losses}"
            losses.append(losses_now.sum().item())
        _assert_bitwise(params_now, ref_params, f"{what} step {step}")
    return losses


def _pipeline_rank(rank: int, world: int, schedule_name: str) -> dict:
    """One stage per rank (world stages), ``schedule_name`` over 4 microbatches, SGD; the stage on the shardkit
    group against the same stage on a gloo group, step by step."""
    from torch.distributed import pipelining

    schedule_class = getattr(pipelining, schedule_name)
    torch.manual_seed(0)
    stages = [Stage() for _ in range(world)]  # every rank builds the whole model, keeps its own stage
    loss_fn = nn.MSELoss()
    runs = []
    for group in (gloo_world(), dist.group.WORLD):
        module = copy.deepcopy(stages[rank])
        stage = pipelining.PipelineStage(module, rank, world, torch.device("cpu"), group=group)
        runs.append((module, schedule_class(stage, n_microbatches=4, loss_fn=loss_fn),
                     torch.optim.SGD(module.parameters(), lr=0.05)))
    assert dist.get_backend(dist.group.WORLD) == "shardkit" and dist.get_backend(gloo_world()) == "gloo"
    g = torch.Generator().manual_seed(101)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)  # one batch, so the loss must fall
    losses = _train_pipelines(runs, rank, world, x, y, f"{schedule_name} rank {rank}")
    return {"losses": losses, "direct": _direct_bytes()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule_name,world,hosts", [("ScheduleGPipe", 2, 1), ("Schedule1F1B", 4, 2)])
def test_pipeline_schedules_on_shardkit_are_bitwise_gloo(tmp_path, schedule_name, world, hosts):
    results = harness.run(_pipeline_rank, world, schedule_name, workdir=tmp_path, timeout=180,
                          env=_hosts(world, hosts, **DIRECT))
    losses = results[-1]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    assert all(r["direct"] > 0 for r in results), results  # every rank has a stage neighbour on its host


# --- expert parallelism ----------------------------------------------------------------------------------------

class ExpertParallelMoE(nn.Module):
    """Top-1 mixture of experts, ``experts_per_rank`` experts on each rank of ``group``: each token goes to the
    expert its router picks, wherever it lives, and comes back weighted by the router's probability."""

    def __init__(self, world: int, experts_per_rank: int) -> None:
        super().__init__()
        self.world, self.local = world, experts_per_rank
        self.group: dist.ProcessGroup | None = None  # set on each copy (a group does not deep-copy)
        self.router = nn.Linear(D, world * experts_per_rank)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all_single

        probs = torch.softmax(self.router(x), dim=-1)
        weight, expert = probs.max(dim=-1)
        order = torch.argsort(expert, stable=True)  # tokens grouped by expert, so by destination rank
        send_counts = torch.bincount(expert // self.local, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        tokens = all_to_all_single(x[order], recv, send, group=self.group)
        # the experts each received token belongs to, sent alongside (ids, not activations: no gradient)
        ids = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(ids, expert[order].contiguous(), recv, send, group=self.group)
        out = torch.zeros_like(tokens)
        for e, layer in enumerate(self.experts):
            mine = ids % self.local == e
            out = out.index_put((mine.nonzero().squeeze(1),), layer(tokens[mine]))
        back = all_to_all_single(out, send, recv, group=self.group)
        combined = torch.empty_like(back).index_copy(0, order, back)
        return x + weight.unsqueeze(-1) * combined


def _expert_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.ModuleDict({"moe": ExpertParallelMoE(world, 2), "head": nn.Linear(D, 1)})
    # every rank's router and head start equal (replicated); each rank's experts are its own
    runs = []
    for group in (gloo_world(), dist.group.WORLD):
        replica = copy.deepcopy(model)
        replica["moe"].group = group
        runs.append((replica, torch.optim.SGD(replica.parameters(), lr=0.1)))
    assert dist.get_backend(dist.group.WORLD) == "shardkit"
    splits = []
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(6 + 3 * rank, D, generator=g), torch.randn(6 + 3 * rank, 1, generator=g)  # uneven
        pair = []
        for replica, optimizer in runs:
            loss = nn.functional.mse_loss(replica["head"](replica["moe"](x)), y)
            loss.backward()
            # the replicated router and head: their gradient averaged over the ranks, on the run's own group, summed
            # here in rank order (an all-gather moves bytes: the sum's order is the test's, not the backend's)
            for p in (*replica["moe"].router.parameters(), *replica["head"].parameters()):
                gathered = torch.empty(world * p.grad.shape[0], *p.grad.shape[1:])
                dist.all_gather_into_tensor(gathered, p.grad.contiguous(), group=replica["moe"].group)
                p.grad = gathered.view(world, *p.grad.shape).sum(dim=0) / world
            optimizer.step()
            optimizer.zero_grad()
            pair.append((loss.detach(), _params(replica)))
        (ref_loss, ref_params), (loss_now, params_now) = pair
        assert torch.equal(ref_loss, loss_now), f"rank {rank} step {step}: loss {loss_now} vs {ref_loss}"
        _assert_bitwise(params_now, ref_params, f"expert parallel rank {rank} step {step}")
        losses.append(loss_now.item())
        with torch.no_grad():
            counts = torch.bincount(runs[1][0]["moe"].router(x).argmax(-1) // 2, minlength=world)
        splits.append(counts.tolist())
    return {"losses": losses, "splits": splits}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,hosts", [(2, 1), (4, 2)])
def test_expert_parallel_moe_on_shardkit_is_bitwise_gloo(tmp_path, world, hosts):
    results = harness.run(_expert_rank, world, workdir=tmp_path, timeout=180, env=_hosts(world, hosts))
    splits = [s for r in results for s in r["splits"]]
    assert any(len(set(s)) > 1 for s in splits), f"every dispatch was even: {splits}"  # uneven splits were sent


# --- with fully_shard on a 2 x 2 mesh --------------------------------------------------------------------------

def _meshes(rank: int, names: tuple[str, str]):
    """The 2 x 2 mesh ``names`` over the world (ranks [[0, 1], [2, 3]]: rows are the second name's groups, columns
    the first's), once on the shardkit world (init_device_mesh) and once from gloo subgroups over the same ranks."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    layout = torch.arange(4).view(2, 2)
    rows = [dist.new_group(r.tolist(), backend="gloo") for r in layout]  # every rank makes every group, in order
    cols = [dist.new_group(c.tolist(), backend="gloo") for c in layout.t()]
    row = next(g for g, r in zip(rows, layout, strict=True) if rank in r.tolist())
    col = next(g for g, c in zip(cols, layout.t(), strict=True) if rank in c.tolist())
    gloo_mesh = DeviceMesh.from_group([col, row], "cpu", mesh=layout, mesh_dim_names=names)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    assert all(dist.get_backend(mesh[n].get_group()) == "shardkit" for n in names)
    assert all(dist.get_backend(gloo_mesh[n].get_group()) == "gloo" for n in names)
    return gloo_mesh, mesh


def _pipeline_fsdp_rank(rank: int, world: int) -> dict:
    """GPipe over "pp" (2 stages, a column each) with each stage's module fully_shard over "dp" (a row); each
    "dp" coordinate trains on its own batch. torch's fully_shard on the gloo mesh against shardkit's on the
    shardkit mesh."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    gloo_mesh, mesh = _meshes(rank, ("pp", "dp"))
    stage_index, data_rank = divmod(rank, 2)
    torch.manual_seed(0)
    stages = [Stage() for _ in range(2)]
    runs = []
    for m, shard in ((gloo_mesh, torch_fully_shard), (mesh, shardkit.fully_shard)):
        module = shard(copy.deepcopy(stages[stage_index]), mesh=m["dp"])
        stage = pipelining.PipelineStage(module, stage_index, 2, torch.device("cpu"), group=m["pp"].get_group())
        runs.append((module, pipelining.ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.MSELoss()),
                     torch.optim.SGD(module.parameters(), lr=0.05)))
    g = torch.Generator().manual_seed(200 + data_rank)
    x, y = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
    losses = _train_pipelines(runs, stage_index, 2, x, y, f"pipeline + fully_shard rank {rank}")
    return {"losses": losses, "direct": _direct_bytes(mesh["pp"].get_group())}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hosts", [1, 2])
def test_pipeline_with_fully_shard_on_a_2x2_mesh_is_bitwise_gloo(tmp_path, hosts):
    results = harness.run(_pipeline_fsdp_rank, 4, workdir=tmp_path, timeout=180, env=_hosts(4, hosts, **DIRECT))
    # the stages' pairs ({0, 2}, {1, 3}) share a host unless the 2 hosts ({0, 1}, {2, 3}) split them
    assert all((r["direct"] > 0) == (hosts == 1) for r in results), results
    last = [results[2]["losses"], results[3]["losses"]]
    assert last[0] != last[1] and all(run[-1] < run[0] for run in last), last  # own batches, and learning


class MoEModel(nn.Module):
    """The MoE layer and a head (fully_shard's root must have a forward: a ModuleDict has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.moe, self.head = ExpertParallelMoE(2, 2), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def _expert_fsdp_rank(rank: int, world: int) -> dict:
    """Expert parallelism over "ep" (a row: 2 ranks, 2 experts each) with fully_shard over "dp" (a column, whose
    ranks hold the same experts): every module sharded over "dp"; the router and head, replicated over "ep" too,
    get their shards' gradients averaged over "ep" by an all-gather and a rank-order sum (as _expert_rank)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit

    gloo_mesh, mesh = _meshes(rank, ("dp", "ep"))
    data_rank = rank // 2
    torch.manual_seed(0)
    model = MoEModel()
    expert_offset = torch.Generator().manual_seed(7 + rank % 2)  # an "ep" rank's experts are its own
    with torch.no_grad():
        for p in model.moe.experts.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=expert_offset))
    runs = []
    for m, shard in ((gloo_mesh, torch_fully_shard), (mesh, shardkit.fully_shard)):
        replica = copy.deepcopy(model)
        replica.moe.group = m["ep"].get_group()
        for expert in replica.moe.experts:
            shard(expert, mesh=m["dp"])
        runs.append((shard(replica, mesh=m["dp"]), torch.optim.SGD(replica.parameters(), lr=0.1), m))
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * data_rank + 10 * (rank % 2) + step)
        x, y = torch.randn(6 + 3 * rank, D, generator=g), torch.randn(6 + 3 * rank, 1, generator=g)
        pair = []
        for replica, optimizer, m in runs:
            loss = nn.functional.mse_loss(replica(x), y)
            loss.backward()
            ep = m["ep"].get_group()
            for p in (*replica.moe.router.parameters(), *replica.head.parameters()):
                local = p.grad.to_local()
                gathered = torch.empty(2 * local.shape[0], *local.shape[1:])
                dist.all_gather_into_tensor(gathered, local.contiguous(), group=ep)
                local.copy_(gathered.view(2, *local.shape).sum(dim=0) / 2)
            optimizer.step()
            optimizer.zero_grad()
            pair.append((loss.detach(), _full(replica)))
        (ref_loss, ref_params), (loss_now, params_now) = pair
        assert torch.equal(ref_loss, loss_now), f"rank {rank} step {step}: loss {loss_now} vs {ref_loss}"
        _assert_bitwise(params_now, ref_params, f"expert parallel + fully_shard rank {rank} step {step}")
        losses.append(loss_now.item())
    return {"losses": losses, "router": _full(runs[1][0].moe.router)["weight"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hosts", [1, 2])
def test_expert_parallel_with_fully_shard_on_a_2x2_mesh_is_bitwise_gloo(tmp_path, hosts):
    results = harness.run(_expert_fsdp_rank, 4, workdir=tmp_path, timeout=180, env=_hosts(4, hosts))
    # The router, replicated over the whole mesh, stays equal on every rank (its gradient was averaged over both).
    assert all(torch.equal(r["router"], results[0]["router"]) for r in results)
    assert len({tuple(r["losses"]) for r in results}) == 4  # every rank trains on its own tokens

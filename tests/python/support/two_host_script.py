"""One rank of the namespace multi-host test (test_two_hosts.py starts it under torchrun, on each "host").

    two_host_script.py OUT_DIR [--collectives]

Every rank writes OUT_DIR/rank{R}.json: what it can see of its host (hostname, host id, the device of
/dev/shm, the topology the shardkit backend built) and the outcome of each check ("ok" or the failure),
and OUT_DIR/params-rank{R}.pt: the parameters after a few shardkit DDP steps. Rank 0 also writes the
parameters that training reaches when the four ranks' gradients are summed in a given order without any
collective (reference-flat.pt: ((g0+g1)+g2)+g3, one host; reference-hier.pt: (g0+g1)+(g2+g3), two hosts of
two, each host's partial sum first), so the test can tell an order difference from a wrong result.

Checks only compare after all of their collectives were issued on every rank, so a wrong value in one
check leaves the collective sequence intact and the later checks still run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python: the shared cases

import shardkit  # noqa: E402
from shardkit.backend import host_id, host_topology
from support.collective_cases import assert_close, make_input, reference_reduce
from support.ddp_cases import batch, loss_fn, mlp, sgd

STEPS = 4
R = dist.ReduceOp


# --- collectives ----------------------------------------------------------------------------------------

def check_all_reduce(rank: int, world: int) -> None:
    cases = [(torch.float32, op, n) for op in (R.SUM, R.AVG, R.MAX) for n in (1000, 300_001)]
    cases += [(torch.int64, R.SUM, 1000), (torch.float64, R.SUM, 1000)]
    results = []
    for dtype, op, n in cases:
        t = make_input(rank, n, dtype, salt=int(op))
        dist.all_reduce(t, op=op)
        results.append(t)
    for (dtype, op, n), t in zip(cases, results):
        inputs = [make_input(r, n, dtype, salt=int(op)) for r in range(world)]
        assert_close(t, reference_reduce(inputs, op), world, f"all_reduce {dtype} {op} n={n}")


def check_broadcast(rank: int, world: int) -> None:
    results = []
    for root in range(world):
        t = make_input(rank, 70_000, torch.float32, salt=root)
        dist.broadcast(t, src=root)
        results.append(t)
    for root, t in enumerate(results):
        assert torch.equal(t, make_input(root, 70_000, torch.float32, salt=root)), f"broadcast from rank {root}"


def check_all_gather(rank: int, world: int) -> None:
    n = 1000
    as_list = [torch.empty(n) for _ in range(world)]
    dist.all_gather(as_list, make_input(rank, n, torch.float32))
    as_tensor = torch.empty(world * n)
    dist.all_gather_into_tensor(as_tensor, make_input(rank, n, torch.float32, salt=1))
    for r in range(world):
        assert torch.equal(as_list[r], make_input(r, n, torch.float32)), f"all_gather: rank {r}'s piece"
        assert torch.equal(as_tensor[r * n:(r + 1) * n], make_input(r, n, torch.float32, salt=1)), \
            f"all_gather_into_tensor: rank {r}'s piece"


def check_reduce_scatter(rank: int, world: int) -> None:
    n = 1000
    out_tensor = torch.empty(n)
    dist.reduce_scatter_tensor(out_tensor, make_input(rank, world * n, torch.float32))
    out_list = torch.empty(n)
    dist.reduce_scatter(out_list, list(make_input(rank, world * n, torch.float32, salt=1).chunk(world)))
    for salt, out in ((0, out_tensor), (1, out_list)):
        full = reference_reduce([make_input(r, world * n, torch.float32, salt=salt) for r in range(world)], R.SUM)
        assert_close(out, full[rank * n:(rank + 1) * n], world, f"reduce_scatter (salt {salt})")


# The forms torch's _coalescing_manager issues when the backend does not coalesce by itself: the ops are
# recorded and sent as one allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced at exit.
COALESCED_SIZES = (1000, 7, 70_000)


def check_coalesced_all_gather(rank: int, world: int) -> None:
    outs = [torch.empty(world * n) for n in COALESCED_SIZES]
    with dist._coalescing_manager(async_ops=True) as cm:
        for i, (out, n) in enumerate(zip(outs, COALESCED_SIZES)):
            dist.all_gather_into_tensor(out, make_input(rank, n, torch.float32, salt=i))
    cm.wait()
    for i, (out, n) in enumerate(zip(outs, COALESCED_SIZES)):
        expected = torch.cat([make_input(r, n, torch.float32, salt=i) for r in range(world)])
        wrong = (out != expected).view(world, n).any(1).nonzero().flatten().tolist()
        assert not wrong, f"coalesced all_gather_into_tensor #{i} (n={n}): wrong pieces of ranks {wrong}"


def check_coalesced_reduce_scatter(rank: int, world: int) -> None:
    outs = [torch.empty(n) for n in COALESCED_SIZES]
    with dist._coalescing_manager(async_ops=True) as cm:
        for i, (out, n) in enumerate(zip(outs, COALESCED_SIZES)):
            dist.reduce_scatter_tensor(out, make_input(rank, world * n, torch.float32, salt=i))
    cm.wait()
    for i, (out, n) in enumerate(zip(outs, COALESCED_SIZES)):
        full = reference_reduce([make_input(r, world * n, torch.float32, salt=i) for r in range(world)], R.SUM)
        expected = full[rank * n:(rank + 1) * n]
        err = (out.double() - expected.double()).abs().max().item()
        assert_close(out, expected, world, f"coalesced reduce_scatter_tensor #{i} (n={n}, max error {err:.3g})")


# --- training -------------------------------------------------------------------------------------------

def train_ddp(rank: int) -> dict[str, torch.Tensor]:
    model = shardkit.DistributedDataParallel(mlp())
    opt = sgd(model.parameters())
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def train_reference(world: int, hosts: list[list[int]]) -> dict[str, torch.Tensor]:
    """The same training without collectives: each rank's gradients computed here, summed host by host in
    rank order, then the hosts' sums in host order, divided by the world size (as the reducer does)."""
    model = mlp()
    opt = sgd(model.parameters())
    params = list(model.parameters())
    for step in range(STEPS):
        per_rank = []
        for r in range(world):
            model.zero_grad()
            x, y = batch(r, step)
            loss_fn(model(x), y).backward()
            per_rank.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            host_sums = []
            for ranks in hosts:
                acc = per_rank[ranks[0]][i].clone()
                for r in ranks[1:]:
                    acc += per_rank[r][i]
                host_sums.append(acc)
            total = host_sums[0]
            for s in host_sums[1:]:
                total = total + s
            p.grad = total / world
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- driver ---------------------------------------------------------------------------------------------

def run_check(fn, rank: int, world: int) -> str:
    try:
        fn(rank, world)
        return "ok"
    except Exception:  # noqa: BLE001 - the outcome is the report; pytest decides what it means
        return traceback.format_exc(limit=3)


def run_rank(out: Path, collectives: bool) -> None:
    """One rank's whole job on a shardkit default group that is already set up: reports, checks, training.

    main() runs it under torchrun (the two hosts); test_two_hosts runs it in harness ranks too (the one-host
    baseline, where the launcher is not what is compared), so both sides train and report with the same code."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = host_topology()
    report = {
        "rank": rank, "world": world, "hostname": socket.gethostname(), "host_id": host_id(),
        "shm_dev": os.stat("/dev/shm").st_dev, "host_id_override": os.environ.get("SHARDKIT_HOST_ID"),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "topology": {"host_of": topo.host_of, "local_of": topo.local_of, "num_hosts": topo.num_hosts},
        "checks": {},
    }
    checks = report["checks"]
    if collectives:
        for fn in (check_all_reduce, check_broadcast, check_all_gather, check_reduce_scatter):
            checks[fn.__name__] = run_check(fn, rank, world)
    torch.save(train_ddp(rank), out / f"params-rank{rank}.pt")
    if collectives:  # last: while broken, they must not disturb training's collectives
        for fn in (check_coalesced_all_gather, check_coalesced_reduce_scatter):
            checks[fn.__name__] = run_check(fn, rank, world)
    if rank == 0:
        torch.save(train_reference(world, [[r] for r in range(world)]), out / "reference-flat.pt")
        halves = [list(range(world // 2)), list(range(world // 2, world))]
        torch.save(train_reference(world, halves), out / "reference-hier.pt")
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--collectives", action="store_true", help="run the collective checks too")
    args = parser.parse_args()
    dist.init_process_group("shardkit", timeout=timedelta(seconds=90))
    run_rank(args.out, args.collectives)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

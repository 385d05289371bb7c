"""Inputs and float64/exact references for the collective tests (imported by the ranks too)."""

from __future__ import annotations

import torch
import torch.distributed as dist

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]

# Sizes in elements: empty, tiny, one slot-ish, and larger than the 1 MiB slot (chunked path).
SIZES = [0, 1, 1000, 70_000, 300_001]

# Where the ranks sit: (world size, host of each rank). Simulated hosts share this machine but not their
# shared-memory segments (SHARDKIT_HOST_ID): collectives run hierarchically, through gloo between hosts. Equal hosts
# of consecutive ranks use rails for large ops (2x2hosts, 3x2hosts), the others the leader scheme, which
# 2x2hosts-leaders asks for where rails would run (SCHEMES).
TOPOLOGIES = {
    "1host-w1": (1, None),
    "1host-w2": (2, None),
    "1host-w3": (3, None),
    "1host-w4": (4, None),
    "2x2hosts": (4, [0, 0, 1, 1]),
    "2x2hosts-leaders": (4, [0, 0, 1, 1]),
    "3x2hosts": (6, [0, 0, 1, 1, 2, 2]),
    "2x2hosts-interleaved": (4, [0, 1, 0, 1]),
    "3hosts-uneven": (4, [0, 0, 1, 2]),
}
# SHARDKIT_INTER_HOST of the topologies that set it.
SCHEMES = {"2x2hosts-leaders": "leaders"}


def topology_env(hosts: list[int] | None, scheme: str | None = None) -> list[dict[str, str]] | None:
    """Per-rank environment placing rank r on host hosts[r] (None: every rank on this one host), with
    SHARDKIT_INTER_HOST=scheme where given."""
    if hosts is None:
        return None
    return [{"SHARDKIT_HOST_ID": f"host{h}", **({"SHARDKIT_INTER_HOST": scheme} if scheme else {})} for h in hosts]


def run_on(ranks, topology: str, fn, *args, timeout: float = 240):
    """ranks.run(fn, ...) on the ranks and hosts of TOPOLOGIES[topology]."""
    world, hosts = TOPOLOGIES[topology]
    return ranks.run(fn, world, *args, timeout=timeout, env=topology_env(hosts, SCHEMES.get(topology)))


def make_input(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s deterministic input; any rank can rebuild any other rank's."""
    g = torch.Generator().manual_seed(7919 * salt + 104729 * rank + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (n,), generator=g).to(dtype)  # products of 4 ranks stay in int8 range


def ops_for(dtype: torch.dtype) -> list:
    R = dist.ReduceOp
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    if dtype == torch.bool:
        return [R.SUM, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def reference_reduce(inputs: list[torch.Tensor], op) -> torch.Tensor:
    """The reduction computed in float64 (floats) or exactly (integers), rounded once to the dtype."""
    dtype = inputs[0].dtype
    R = dist.ReduceOp
    if dtype == torch.bool:
        stacked = torch.stack(inputs).to(torch.uint8)
        if op in (R.SUM, R.MAX, R.BOR):
            return stacked.amax(0).bool() if stacked.numel() else stacked.sum(0).bool()
        if op in (R.MIN, R.BAND, R.PRODUCT):  # a product of bools is their AND
            return stacked.amin(0).bool() if stacked.numel() else stacked.sum(0).bool()
        return (stacked.sum(0) % 2).bool()
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stacked = torch.stack([t.to(wide) for t in inputs])
    if op == R.SUM:
        out = stacked.sum(0)
    elif op == R.AVG:
        out = stacked.sum(0) / len(inputs)
    elif op == R.PRODUCT:
        out = stacked.prod(0)
    elif op == R.MIN:
        out = stacked.amin(0) if stacked.shape[1] else stacked.sum(0)
    elif op == R.MAX:
        out = stacked.amax(0) if stacked.shape[1] else stacked.sum(0)
    else:
        out = stacked[0].clone()
        for t in stacked[1:]:
            out = {R.BAND: out & t, R.BOR: out | t, R.BXOR: out ^ t}[op]
    return out.to(dtype)


def tolerance(dtype: torch.dtype, world_size: int) -> dict:
    """f32/f64 results are the fixed-order sum, a few ulps from the float64 reference; 16-bit types
    accumulate in f32 and round once, so they are within one rounding of it."""
    if dtype == torch.float16:
        return {"rtol": 2e-3, "atol": 1e-3}
    if dtype == torch.bfloat16:
        return {"rtol": 1.6e-2, "atol": 1e-2}
    if dtype == torch.float32:
        return {"rtol": 1e-6, "atol": 1e-6}
    if dtype == torch.float64:
        return {"rtol": 1e-12, "atol": 1e-12}
    return {"rtol": 0, "atol": 0}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, world_size: int, what: str) -> None:
    if actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}",
                                   **tolerance(actual.dtype, world_size))
    else:
        assert torch.equal(actual, expected), f"{what}: {actual[:8]} != {expected[:8]}"

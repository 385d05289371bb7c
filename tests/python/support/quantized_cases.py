"""Quantized inter-host collectives (shardkit.Quantized), run inside the ranks: results against a reference quantizer
written here in torch (the contract of csrc/core/quantize.h, shared with no shardkit code) and float64 sums, and the
bytes each rank sent between hosts counted exactly."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import shardkit
from shardkit.backend import host_topology, inter_host_bytes, inter_host_scheme
from shardkit.quantized import inter_host_format
from support.collective_cases import make_input

QMAX = {"int8": 127.0, "int4": 7.0}
# The rails' pipeline piece, in f32 elements (HierarchicalEngine::kRailPieceBytes); the sizes below fit one.
PIECE_F32 = (2 << 20) // 4


def record_bytes(count: int, bits: str, block: int) -> int:
    """A record's size, from the header's layout: one f32 scale per block, then 1 byte (int8) or half a byte (int4)
    per element."""
    return 4 * math.ceil(count / block) + (count if bits == "int8" else (count + 1) // 2)


def round_trip(x: torch.Tensor, bits: str, block: int) -> torch.Tensor:
    """What the receivers of x's record decode (f32, x's blocks from its first element): scale = absmax / qmax,
    code = round-half-even(x * (qmax / absmax)) clamped, value = code * scale; all f32 arithmetic."""
    qmax = torch.tensor(QMAX[bits], dtype=torch.float32)
    out = torch.empty_like(x)
    for begin in range(0, x.numel(), block):
        part = x[begin:begin + block]
        absmax = part.abs().max()
        if absmax == 0:
            out[begin:begin + block] = 0
            continue
        codes = torch.clamp(torch.round(part * (qmax / absmax)), -qmax, qmax)
        out[begin:begin + block] = codes * (absmax / qmax)
    return out


def _parts(m: int, hosts: int) -> list[int]:
    """Sizes of a slice's parts, one per host (the allreduce's owners): m*j//H boundaries."""
    return [m * (j + 1) // hosts - m * j // hosts for j in range(hosts)]


def quantized_ops(rank: int, world: int, expected_scheme: str, n: int, bits: str, block: int) -> bool:
    """all_gather_into_tensor, reduce_scatter_tensor and all_reduce of f32 under shardkit.Quantized(bits, block) on
    this topology, each against its reference, with this rank's inter-host bytes counted exactly; an int32
    all-gather in the same scope stays exact."""
    assert inter_host_scheme() == expected_scheme, inter_host_scheme()
    topo = host_topology()
    hosts, me = topo.num_hosts, topo.host_of[rank]
    local = [r for r in range(world) if topo.host_of[r] == me]
    max_local = max(topo.local_size(r) for r in range(world))
    leader = topo.local_of[rank] == 0
    rails = expected_scheme == "rails"
    comm = shardkit.Quantized(weights=bits, grads=bits, block=block)

    # all-gather: every rank holds every input as decoded from its own record, bit for bit.
    inputs = [make_input(r, n, torch.float32, salt=11) for r in range(world)]
    out = torch.empty(world * n)
    before = inter_host_bytes()
    with inter_host_format(comm):
        dist.all_gather_into_tensor(out, inputs[rank])
    sent = inter_host_bytes() - before
    expected = torch.cat([round_trip(x, bits, block) for x in inputs])
    assert torch.equal(out, expected), f"all_gather_into_tensor: {(out - expected).abs().max()} off the reference"
    assert not torch.equal(out, torch.cat(inputs)), "all_gather_into_tensor: the values crossed exact"
    use_rails = rails and world * n * 4 >= 256 << 10
    want = ((hosts - 1) * record_bytes(n, bits, block) if use_rails
            else (hosts - 1) * max_local * record_bytes(n, bits, block) if leader else 0)
    assert sent == want, f"all_gather_into_tensor sent {sent} bytes between hosts, expected {want}"

    # reduce-scatter: within half a step of every other host's partial sum, not exact; this rank's bytes exact.
    full = [make_input(r, world * n, torch.float32, salt=12) for r in range(world)]
    got = torch.empty(n)
    before = inter_host_bytes()
    with inter_host_format(comm):
        dist.reduce_scatter_tensor(got, full[rank])
    sent = inter_host_bytes() - before
    mine = slice(rank * n, (rank + 1) * n)
    exact = sum(f[mine].double() for f in full)
    # A quantization block may span several ranks' blocks (the leader scheme sends a host's blocks as one record):
    # bound each host's step by its largest partial sum anywhere.
    partials = [sum(full[r].double() for r in range(world) if topo.host_of[r] == h) for h in range(hosts)]
    step = sum(p.abs().max() / QMAX[bits] for h, p in enumerate(partials) if h != me)  # a bound on the error
    error = (got.double() - exact).abs().max()
    assert error <= step / 2 + 1e-4, f"reduce_scatter_tensor: off by {error}, bound {step / 2}"
    assert error > 1e-5, "reduce_scatter_tensor: the partial sums crossed exact"
    use_rails = rails and world * n * 4 >= 256 << 10
    want = ((hosts - 1) * record_bytes(n, bits, block) if use_rails
            else (hosts - 1) * record_bytes(max_local * n, bits, block) if leader else 0)
    assert sent == want, f"reduce_scatter_tensor sent {sent} bytes between hosts, expected {want}"

    # allreduce: every rank the same bits, within the quantization's bound of the sum.
    data = [make_input(r, world * n, torch.float32, salt=13) for r in range(world)]
    t = data[rank].clone()
    before = inter_host_bytes()
    with inter_host_format(comm):
        dist.all_reduce(t)
    sent = inter_host_bytes() - before
    everyone = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(everyone, t)
    assert all(torch.equal(e, t) for e in everyone), "all_reduce: ranks hold different bits"
    exact = sum(d.double() for d in data)
    bound = sum(d.abs().max() for d in data) / QMAX[bits] * hosts  # partials' and the sum's half-steps, loosely
    error = (t.double() - exact).abs().max()
    assert 1e-5 < error <= bound, f"all_reduce: off by {error}, bound {bound}"
    count = world * n
    if rails and count * 4 >= 256 << 10:
        parts = _parts(math.ceil(count / len(local)), hosts)
    else:
        parts = _parts(count, hosts) if leader else None
    want = 0 if parts is None else (sum(record_bytes(p, bits, block) for h, p in enumerate(parts) if h != me)
                                    + (hosts - 1) * record_bytes(parts[me], bits, block))
    assert sent == want, f"all_reduce sent {sent} bytes between hosts, expected {want}"

    # reduce to the last rank: only root's tensor changes, within the partial sums' half-steps; every other host's
    # leader sends its partial sum's record to root's host's leader.
    root = world - 1
    t = data[rank].clone()
    before = inter_host_bytes()
    with inter_host_format(comm):
        dist.reduce(t, dst=root)
    sent = inter_host_bytes() - before
    if rank == root:
        partials = [sum(data[r].double() for r in range(world) if topo.host_of[r] == h) for h in range(hosts)]
        step = sum(p.abs().max() / QMAX[bits] for h, p in enumerate(partials) if h != topo.host_of[root])
        error = (t.double() - sum(d.double() for d in data)).abs().max()
        assert 1e-5 < error <= step / 2 + 1e-4, f"reduce: off by {error}, bound {step / 2}"
    else:
        assert torch.equal(t, data[rank]), "reduce changed a tensor that is not root's"
    want = record_bytes(count, bits, block) if leader and me != topo.host_of[root] else 0
    assert sent == want, f"reduce sent {sent} bytes between hosts, expected {want}"

    # Non-floating data in the same scope moves exact.
    ints = [make_input(r, n, torch.int32, salt=14) for r in range(world)]
    out = torch.empty(world * n, dtype=torch.int32)
    with inter_host_format(comm):
        dist.all_gather_into_tensor(out, ints[rank])
    assert torch.equal(out, torch.cat(ints)), "an int32 all-gather was changed"
    return True


def disagreeing_formats(rank: int, world: int) -> None:
    """Host 1 asks for int4 where host 0 asks for int8: the leaders' check must refuse it, naming both."""
    from shardkit.backend import compare_identities_across_hosts

    compare_identities_across_hosts(None)
    bits = "int8" if host_topology().host_of[rank] == 0 else "int4"
    out = torch.empty(world * 1000)
    with inter_host_format(shardkit.Quantized(weights=bits, block=64)):
        dist.all_gather_into_tensor(out, torch.ones(1000))

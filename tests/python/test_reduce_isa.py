"""SHARDKIT_REDUCE_ISA picks the reduction kernels; ranks on different kernels still agree bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.collective_cases import make_input, reference_reduce


def _input_with_specials(rank, dtype):
    """Rank ``rank``'s input: random values with NaN, inf, overflowing and subnormal elements mixed in."""
    t = make_input(rank, 4099, dtype, salt=5)
    info = torch.finfo(dtype)
    t[7::97] = float("nan") if rank == 0 else 1.0
    t[11::89] = float("inf") if rank == 1 else -2.0
    t[13::83] = info.max  # on both ranks: the sum overflows to inf
    t[17::79] = info.smallest_normal / 4  # a subnormal in every dtype, and so is the sum
    return t


def _small_allreduces(rank, world):
    """Allreduces of at most 32 KB, where every rank reduces all slots itself with its own kernels; returns
    this rank's kernel name and its result bytes."""
    from shardkit import _C

    results = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = _input_with_specials(rank, dtype)
        expected = reference_reduce([_input_with_specials(r, dtype) for r in range(world)], dist.ReduceOp.SUM)
        dist.all_reduce(t)
        torch.testing.assert_close(t, expected, equal_nan=True, rtol=0, atol=0,
                                   msg=lambda m: f"all_reduce {dtype}: {m}")
        results[str(dtype)] = t.view(torch.int16 if t.element_size() == 2 else torch.int32).tolist()
    return _C.reduce_isa(), results


@pytest.mark.timeout(180)
def test_rank_on_scalar_kernels_agrees_bitwise_with_rank_on_the_fastest(ranks):
    env = [{"SHARDKIT_REDUCE_ISA": "scalar"}, {"SHARDKIT_REDUCE_ISA": ""}]  # "" means: choose automatically
    (isa0, bytes0), (isa1, bytes1) = ranks.run(_small_allreduces, 2, env=env, timeout=150)
    assert isa0 == "scalar"
    assert isa1 in ("avx512_bf16", "avx512", "avx2", "scalar")
    for dtype, values in bytes0.items():
        assert values == bytes1[dtype], f"{dtype}: rank 0 ({isa0}) and rank 1 ({isa1}) results differ"


BAD_VALUES = ["sse9", "AVX2"]  # unknown, and a known name in the wrong case


def _reduce_isa_error(rank, world):
    """What the first reduce_isa() of this rank raises. The choice is a C++ static set at its first use, which the
    forkserver's preload (import shardkit) does not reach: each rank reads its own SHARDKIT_REDUCE_ISA. Had the
    preload set it, reduce_isa() would return a name here and the test would fail, not pass."""
    from shardkit import _C

    try:
        return f"no error: {_C.reduce_isa()}"
    except ValueError as error:
        return str(error)


@pytest.mark.timeout(120)
def test_a_bad_value_fails_naming_the_variable_and_value(ranks):
    env = [{"SHARDKIT_REDUCE_ISA": value} for value in BAD_VALUES]
    assert ranks.run(_reduce_isa_error, len(BAD_VALUES), backend=None, env=env, timeout=100) == [
        f"shardkit reduce: unknown ISA '{value}' (from SHARDKIT_REDUCE_ISA) "
        "(expected avx512_bf16, avx512, avx2 or scalar)" for value in BAD_VALUES
    ]

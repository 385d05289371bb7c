"""shardkit.Quantized: block-quantized bytes between hosts (csrc/core/quantize.h, hierarchical_engine.h), on
simulated hosts of every scheme: results against a reference quantizer and float64, exact byte counts, refusals."""

from __future__ import annotations

import pytest

import shardkit
from shardkit import _C
from support.collective_cases import TOPOLOGIES, run_on
from support.harness import RanksFailed
from support.quantized_cases import disagreeing_formats, quantized_ops, record_bytes

# (topology, its scheme, elements per rank): sizes that take the rails (an op of 256 KiB or more) and below them.
CASES = [("2x2hosts", "rails", 100_003), ("2x2hosts", "rails", 1_000), ("2x2hosts-leaders", "leaders", 100_003),
         ("3x2hosts", "rails", 50_001), ("3hosts-uneven", "leaders", 30_001), ("2x2hosts-interleaved", "leaders", 999)]


@pytest.mark.parametrize("topology, scheme, n", CASES, ids=[f"{t}-{n}" for t, _, n in CASES])
def test_quantized_collectives_int8(ranks, topology, scheme, n):
    assert run_on(ranks, topology, quantized_ops, scheme, n, "int8", 64, timeout=240) == [True] * TOPOLOGIES[topology][0]


@pytest.mark.parametrize("topology, scheme", [("2x2hosts", "rails"), ("3hosts-uneven", "leaders")])
def test_quantized_collectives_int4(ranks, topology, scheme):
    assert run_on(ranks, topology, quantized_ops, scheme, 70_001, "int4", 256, timeout=240) == \
        [True] * TOPOLOGIES[topology][0]


def test_hosts_asking_for_different_formats_fail_naming_both(ranks):
    with pytest.raises(RanksFailed) as failed:
        run_on(ranks, "2x2hosts", disagreeing_formats, timeout=120)
    message = str(failed.value)
    assert "inter-host bytes: all-gathers int8 (blocks of 64)" in message, message
    assert "inter-host bytes: all-gathers int4 (blocks of 64)" in message, message


def test_record_sizes_follow_the_layout():
    for count, bits, block in ((1, "int8", 8), (1000, "int8", 256), (1001, "int4", 64), (70_000, "int4", 1000)):
        assert _C.quantized_bytes(count, _C.QuantFormat(8 if bits == "int8" else 4, block)) == \
            record_bytes(count, bits, block)


@pytest.mark.parametrize("kwargs, message", [
    ({"weights": "int2"}, "shardkit.Quantized: weights='int2' is not a wire format; use 'int8', 'int4' or None (exact)"),
    ({"grads": "fp8"}, "shardkit.Quantized: grads='fp8' is not a wire format; use 'int8', 'int4' or None (exact)"),
    ({"block": 4}, "shardkit.Quantized: block=4 must be an int from 8 to 1048576"),
    ({"block": 256.0}, "shardkit.Quantized: block=256.0 must be an int from 8 to 1048576"),
])
def test_bad_formats_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as error:
        shardkit.Quantized(**kwargs)
    assert str(error.value) == message

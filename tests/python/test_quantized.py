"""shardkit.Quantized: block-quantized bytes between hosts (csrc/core/quantize.h, hierarchical_engine.h), on
simulated hosts of every scheme: results against a reference quantizer and float64, exact byte counts, refusals."""

from __future__ import annotations

import pytest

import shardkit
from shardkit import _C
from support.collective_cases import TOPOLOGIES, run_on
from support.harness import RanksFailed
from support.quantized_cases import disagreeing_formats, quantized_ops, record_bytes
from support.quantized_training import refusals, secondary_copy_in_host, train_quantized

# (topology, its scheme, elements per rank): sizes that take the rails (an op of 256 KiB or more) and below them.
CASES = [("2x2hosts", "rails", 100_003), ("2x2hosts", "rails", 1_000), ("2x2hosts-leaders", "leaders", 100_003),
         ("3x2hosts", "rails", 50_001), ("3hosts-uneven", "leaders", 30_001), ("2x2hosts-interleaved", "leaders", 999)]


@pytest.mark.parametrize("topology, scheme, n", CASES, ids=[f"{t}-{n}" for t, _, n in CASES])
def test_quantized_collectives_int8(ranks, topology, scheme, n):
    results = run_on(ranks, topology, quantized_ops, scheme, n, "int8", 64, timeout=240)
    assert results == [True] * TOPOLOGIES[topology][0]


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
    ({"weights": "int2"},
     "shardkit.Quantized: weights='int2' is not a wire format; use 'int8', 'int4' or None (exact)"),
    ({"grads": "fp8"}, "shardkit.Quantized: grads='fp8' is not a wire format; use 'int8', 'int4' or None (exact)"),
    ({"block": 4}, "shardkit.Quantized: block=4 must be an int from 8 to 1048576"),
    ({"block": 256.0}, "shardkit.Quantized: block=256.0 must be an int from 8 to 1048576"),
])
def test_bad_formats_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as error:
        shardkit.Quantized(**kwargs)
    assert str(error.value) == message


# (front, topology, gradients' format, the quantized run's bytes between hosts over the exact run's where every op
# rides the rails (both runs counted whole; int8 records are 1.016 bytes per 4), else None). ZeRO-1's all-gathers of
# parameters stay exact: on 3 hosts of 2 its allreduces send 2/3 of its bytes, so 2/3 * 0.254 + 1/3.
TRAINING = [("fully_shard", "2x2hosts", "int8", 0.254), ("fully_shard", "2x2hosts-leaders", "int4", None),
            ("fsdp1", "2x2hosts", "int8", 0.254), ("ddp", "2x2hosts", "int8", 0.254),
            ("zero1", "3x2hosts", "int8", 0.503), ("zero2", "3hosts-uneven", "int8", None)]


@pytest.mark.parametrize("front, topology, grads, ratio", TRAINING, ids=[f"{f}-{t}-{g}" for f, t, g, _ in TRAINING])
def test_training_quantized_follows_the_exact_run(ranks, front, topology, grads, ratio):
    steps = 30
    results = run_on(ranks, topology, train_quantized, front, grads, steps, timeout=300)
    for rank, result in enumerate(results):
        exact, quantized = result["exact"], result["quantized"]
        assert exact[-1] < 0.8 * exact[0], exact  # the task is learnt: the comparison means something
        assert quantized != exact, f"rank {rank}: the quantized run's losses equal the exact run's"
        last = sum(quantized[-5:]) / 5
        want = sum(exact[-5:]) / 5
        assert abs(last - want) <= 0.02 * want, f"rank {rank}: final loss {last} vs {want} exact ({quantized})"
        if front in ("ddp", "zero1", "zero2"):
            assert result["replicas_agree"], f"rank {rank}: DDP replicas differ after quantized allreduces"
    if ratio is not None:
        sent = sum(r["quantized_bytes"] for r in results) / sum(r["exact_bytes"] for r in results)
        assert abs(sent - ratio) < 0.01, f"int8 sent {sent:.3f} of the exact run's bytes between hosts, not {ratio}"
    else:
        assert all(r["quantized_bytes"] > 0 for r in results[::2]), results  # the leaders sent records


def test_what_quantized_cannot_serve_is_refused_naming_it(ranks):
    messages = ranks.run(refusals, 2, timeout=120)[0]
    assert messages == [
        "shardkit DDP: comm=shardkit.Quantized(weights='int8') with zero_stage=1 would round the parameters "
        "themselves: ZeRO's all-gather writes into the owners' master copy. Use weights=None (gradients only, "
        "zero_stage=1), or shardkit.fully_shard(..., comm=...), whose all-gathers fill a separate buffer",
        "shardkit FSDP: comm=shardkit.Quantized(...) quantizes the shardkit backend's inter-host bytes; this group's "
        "backend is 'gloo'. Use dist.init_process_group('shardkit'), or drop comm",
        "shardkit DDP: comm must be a shardkit.Quantized or None, got 'int8'",
        "shardkit DDP register_comm_hook: this DDP was built with comm=shardkit.Quantized(...), which quantizes the "
        "buckets' own allreduces; a comm hook replaces them. Use one or the other",
        "shardkit.fully_shard: comm=shardkit.Quantized(...) quantizes the shardkit backend's inter-host bytes; this "
        "group's backend is 'gloo'. Use dist.init_process_group('shardkit'), or drop comm",
        "shardkit.fully_shard: comm=shardkit.Quantized(...) has nothing to quantize here: the group's ranks share one "
        "host, and bytes inside a host move exact",
    ]


def test_a_secondary_copy_in_the_host_keeps_the_backward_gathers_off_the_link(ranks):
    for phases in run_on(ranks, "2x2hosts", secondary_copy_in_host, 2, timeout=180):
        full, in_host = phases["True"], phases["2"]
        assert in_host["forward"] == full["forward"] > 0, phases
        # The blocks' backward all-gathers no longer cross (the root's unit is not resharded after forward anyway):
        # what is left of the backward is the reduce-scatters, which send what the forward's all-gathers sent.
        assert in_host["backward"] < full["backward"], phases
        assert in_host["backward"] == full["forward"], phases

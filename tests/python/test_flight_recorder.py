"""The flight recorder (csrc/comm/trace.h, shardkit/_trace.py): what each rank's trace file holds, when it is written,
and what ``python -m shardkit trace`` makes of the ranks' files."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardkit import _trace
from support.cli import shardkit_here


def _group_entries(dump, name="0"):
    return [e for e in dump["entries"] if e["process_group"][0] == name]


def _summary(entry):
    return (entry["profiling_name"], entry["collective_seq_id"], entry["input_sizes"], entry["input_dtypes"],
            entry["output_sizes"], entry["output_dtypes"], entry["state"])


# --- (1) a rank that sleeps past the group's timeout --------------------------------------------------------------

def _sleeps_before_all_reduce(rank, world):
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(2), src=0)
    if rank == 0:
        time.sleep(2.5)  # "stuck in its data loader" past the 1 s group timeout
    with pytest.raises(RuntimeError) as info:
        dist.all_reduce(torch.ones(16))
    return str(info.value)


def test_timeout_writes_every_ranks_trace_and_the_cli_names_the_late_rank(ranks):
    messages = ranks.run(_sleeps_before_all_reduce, 2, timeout=60, pg_timeout=1.0)
    traces = ranks.workdir / "traces"
    for rank, message in enumerate(messages):
        path = traces / f"shardkit_trace_rank_{rank}"
        assert f"flight recorder: this rank's last collectives are in {path}" in message, message
        assert f"python -m shardkit trace {traces}" in message
        assert path.exists()
    assert "allreduce #3" in messages[1] and "Timed out after 1000 ms" in messages[1]

    dumps = _trace.load_dir(traces)
    assert [e["state"] for e in _group_entries(dumps[1])] == ["completed", "completed", "failed"]
    assert [e["state"] for e in _group_entries(dumps[0])] == ["completed", "completed", "failed"]
    (report,) = _trace.analyze(dumps)
    assert report.behind == [0] and report.behind_in == "all_reduce #3"
    assert report.last_completed == {0: "broadcast #2", 1: "broadcast #2"}
    assert report.divergence is None

    # The command the message names, through its entry point in this process (other tests start `python -m shardkit`).
    cli = shardkit_here("trace", str(traces))
    assert cli.returncode == 0, cli.stderr
    assert "behind: rank 0, in all_reduce #3: it issued the op" in cli.stdout, cli.stdout
    assert "rank 1: last completed broadcast #2; last recorded all_reduce #3 (failed)" in cli.stdout
    assert "sequences: the same ops on every rank" in cli.stdout


# --- (2) a rank that skips a collective ----------------------------------------------------------------------------

def _skips_a_broadcast(rank, world):
    dist.all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError) as info:
        if rank == 0:
            dist.broadcast(torch.ones(8), src=0)
        dist.all_reduce(torch.ones(4))
    return str(info.value)


def test_a_skipped_collective_is_named_where_the_sequences_diverge(ranks):
    messages = ranks.run(_skips_a_broadcast, 2, timeout=60)
    assert all("ranks disagree on collective #2" in m and "flight recorder" in m for m in messages)
    (report,) = _trace.analyze(_trace.load_dir(ranks.workdir / "traces"))
    assert report.divergence == 2
    assert report.divergence_ops == {
        0: "broadcast #2 (in [[8]] ['Float'], out [[8]])",
        1: "all_reduce #2 (in [[4]] ['Float'], out [[4]])",
    }
    assert "  sequences diverge at #2: rank 0: broadcast #2 (in [[8]] ['Float'], out [[8]]); rank 1: all_reduce #2 " \
           "(in [[4]] ['Float'], out [[4]]) (a rank skipped, added or changed a collective)" in report.lines()


# --- (3) dump_traces(): exact content; (6) torch's analyzer reads it -------------------------------------------------

def _known_sequence(rank, world):
    import shardkit

    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.zeros(2, 3, dtype=torch.int64), src=0)
    dist.all_gather_into_tensor(torch.empty(6, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))
    dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    dist.barrier()
    from shardkit._collective_identity import collectives_for

    with collectives_for("fully_shard unit 'blocks.0'"):  # what FSDP and DDP name their collectives' parts
        dist.all_reduce(torch.ones(1))
    path = shardkit.dump_traces()
    return path, _trace.load(path)


KNOWN = [
    ("shardkit:all_reduce", 1, [[4]], ["Float"], [[4]], ["Float"], "completed"),
    ("shardkit:broadcast", 2, [[2, 3]], ["Long"], [[2, 3]], ["Long"], "completed"),
    ("shardkit:_all_gather_base", 3, [[3]], ["BFloat16"], [[6]], ["BFloat16"], "completed"),
    ("shardkit:_reduce_scatter_base", 4, [[4]], ["Double"], [[2]], ["Double"], "completed"),
    ("shardkit:barrier", 5, [], [], [], [], "completed"),
    ("shardkit:all_reduce", 6, [[1]], ["Float"], [[1]], ["Float"], "completed"),
]


def test_dump_traces_holds_the_ops_exactly_and_torchs_analyzer_reads_it(ranks, tmp_path):
    outcomes = ranks.run(_known_sequence, 2, timeout=60)
    for rank, (path, dump) in enumerate(outcomes):
        assert path == str(ranks.workdir / "traces" / f"shardkit_trace_rank_{rank}")
        assert dump["version"] == "2.10" and dump["shardkit_rank"] == rank
        assert dump["shardkit_reason"] == "shardkit.dump_traces()"
        assert dump["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
        assert dump["pg_status"]["0"] == {"last_enqueued_collective": 6, "last_started_collective": 6,
                                          "last_completed_collective": 6}
        entries = _group_entries(dump)
        assert [_summary(e) for e in entries] == KNOWN
        for entry in entries:
            assert entry["time_created_ns"] <= entry["time_discovered_started_ns"] <= \
                entry["time_discovered_completed_ns"]
            assert entry["retired"] is True
        assert [e["shardkit_unit"] for e in entries] == [None] * 5 + ["fully_shard unit 'blocks.0'"]

    # torch's analyzer, on the copies --for-torch writes (it accepts only the backends it lists)
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    exported = tmp_path / "for_torch"
    _trace.export_for_torch(ranks.workdir / "traces", exported)
    args = JobConfig().parse_args([str(exported)])
    details, version = read_dir(args)
    db = build_db(details, args, version)
    assert [c.collective_name for c in db.collectives] == [
        "gloo:all_reduce", "gloo:broadcast", "gloo:_all_gather_base", "gloo:_reduce_scatter_base", "gloo:barrier",
        "gloo:all_reduce"]
    assert all(c.pass_check for c in db.collectives)
    assert [c.collective_seq_id for c in db.collectives] == [1, 2, 3, 4, 5, 6]


def test_a_file_that_names_a_global_is_refused(tmp_path):
    import pickle

    bad = tmp_path / "shardkit_trace_rank_0"
    bad.write_bytes(pickle.dumps({"entries": [], "pg_config": {}, "x": Path("/")}))
    with pytest.raises(pickle.UnpicklingError, match="names pathlib.*PosixPath.*nothing was run"):
        _trace.load(bad)


# --- (4) the ring keeps the last N; 0 records nothing ---------------------------------------------------------------

def _wraps(rank, world):
    import shardkit

    for n in range(1, 6):
        dist.all_reduce(torch.ones(n))
    os.environ["SHARDKIT_TRACE_BUFFER"] = "0"
    silent = dist.new_group([0, 1])  # records nothing
    dist.all_reduce(torch.ones(1), group=silent)
    return _trace.load(shardkit.dump_traces())


def test_the_ring_keeps_the_last_n_collectives(ranks):
    for dump in ranks.run(_wraps, 2, timeout=60, env={"SHARDKIT_TRACE_BUFFER": "3"}):
        assert list(dump["pg_config"]) == ["0"]  # the new group, with SHARDKIT_TRACE_BUFFER=0, is not in it
        assert [(e["collective_seq_id"], e["input_sizes"]) for e in dump["entries"]] == [(3, [[3]]), (4, [[4]]),
                                                                                          (5, [[5]])]


def _bad_buffer(rank, world):
    from datetime import timedelta

    with pytest.raises(RuntimeError) as info:
        dist.init_process_group("shardkit", init_method=f"file://{os.environ['STORE']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=20))
    return str(info.value)


def test_a_bad_buffer_size_is_refused_naming_it(ranks):
    env = {"SHARDKIT_TRACE_BUFFER": "lots", "STORE": str(ranks.workdir / "bad_store")}
    for message in ranks.run(_bad_buffer, 1, timeout=60, backend=None, env=env):
        assert "SHARDKIT_TRACE_BUFFER must be a count of collectives from 0 (off) to 10000000, got 'lots'" in message


# --- (5) SIGUSR1 ---------------------------------------------------------------------------------------------------

def _sigusr1(rank, world, store):
    from datetime import timedelta

    from shardkit import _C

    seen = []
    if rank == 0:  # the user's own handler, installed first: shardkit leaves it be
        signal.signal(signal.SIGUSR1, lambda *_: seen.append(True))
    dist.init_process_group("shardkit", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(7))
    ours = _C.trace_signal_handler_installed()
    path = Path(os.environ["SHARDKIT_TRACE_DIR"]) / f"shardkit_trace_rank_{rank}"
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + (20 if rank == 1 else 1)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    return ours, bool(seen), _trace.load(path) if path.exists() else None


def test_sigusr1_dumps_where_the_user_has_no_handler(ranks):
    (ours0, seen0, dump0), (ours1, seen1, dump1) = ranks.run(_sigusr1, 2, str(ranks.workdir / "store"), timeout=60,
                                                             backend=None)
    assert (ours0, seen0, dump0) == (False, True, None)
    assert ours1 and not seen1
    assert dump1["shardkit_reason"] == "SIGUSR1"
    assert [_summary(e) for e in _group_entries(dump1)] == [
        ("shardkit:all_reduce", 1, [[7]], ["Float"], [[7]], ["Float"], "completed")]


# --- two simulated hosts: the hierarchical engine's ops are recorded too ---------------------------------------------

def _two_hosts(rank, world):
    import shardkit

    dist.all_reduce(torch.ones(8))
    dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
    return _trace.load(shardkit.dump_traces())


def test_two_simulated_hosts_record_the_hierarchical_ops(ranks):
    env = [{"SHARDKIT_HOST_ID": f"host{r // 2}"} for r in range(4)]
    dumps = dict(enumerate(ranks.run(_two_hosts, 4, timeout=90, env=env)))
    for dump in dumps.values():
        assert dump["pg_config"]["0"]["ranks"] == "[0, 1, 2, 3]"
        assert [_summary(e) for e in _group_entries(dump)] == [
            ("shardkit:all_reduce", 1, [[8]], ["Float"], [[8]], ["Float"], "completed"),
            ("shardkit:_all_gather_base", 2, [[4]], ["Float"], [[16]], ["Float"], "completed"),
            ("shardkit:_reduce_scatter_base", 3, [[8]], ["Float"], [[2]], ["Float"], "completed"),
        ]
    (report,) = _trace.analyze(dumps)
    assert report.behind == [] and report.divergence is None
    assert report.last_completed == {r: "_reduce_scatter_base #3" for r in range(4)}

"""The flight recorder's Python face: ``shardkit.dump_traces()``, reading trace files, and ``python -m shardkit trace``.

Every shardkit group records its last collectives on each rank (csrc/comm/trace.h: ``SHARDKIT_TRACE_BUFFER``
entries, default 2000), and the process writes all its groups' records to one file per rank,
``<dir>/shardkit_trace_rank_<global rank>`` (``SHARDKIT_TRACE_DIR``, default ``<temp dir>/shardkit_traces/<job>``),
when an op times out, is aborted or loses a peer, on SIGUSR1 (where the process has no handler of its own) and on
:func:`dump_traces`. The file is a pickle of plain values in the layout of torch's flight recorder (version, pg_config,
pg_status, entries with torch's field names, plus ``shardkit_*`` fields); :func:`load` reads it with an unpickler that
admits no global at all, never with plain pickle.

``python -m shardkit trace DIR`` compares the ranks' files: per group, what every rank last completed, which rank is
behind and in which collective (the op and its number, as error messages name it), and where the ranks' sequences
diverge (the first number at which their ops differ: a rank that skipped or added a collective). ``--for-torch OUT``
writes copies that torch's own analyzer (``python -m torch.distributed.flight_recorder.fr_trace OUT``) reads: it
accepts only the backends it lists (nccl, gloo, ...) in an op's ``profiling_name``, so the copies name shardkit's ops
``gloo:<op>`` (shardkit's CPU ops have gloo's semantics) and an op torch does not know (``shared_buffer``, a
collective with no payload on the wire) ``gloo:barrier``.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _C

_FILE = re.compile(r"^shardkit_trace_rank_(\d+)$")
TORCH_KNOWN_OPS = frozenset({
    "broadcast", "reduce", "all_gather", "all_reduce", "_all_gather_base", "all_gather_into_tensor_coalesced",
    "reduce_scatter", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "gather", "scatter", "all_to_all",
    "all_to_all_single", "barrier", "allreduce_coalesced", "ALLGATHER_coalesced",
})


def dump_traces(reason: str = "shardkit.dump_traces()") -> str:
    """Writes every shardkit group's flight recorder of this process into this rank's trace file and returns its path
    (``SHARDKIT_TRACE_DIR``, default ``<temp dir>/shardkit_traces/<job>``). Any rank may call it at any time; it issues
    no collective. Raises where no shardkit group records (none created, or ``SHARDKIT_TRACE_BUFFER=0``)."""
    return _C.dump_traces(reason)


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, booleans and None; refuses every global (a trace file names
    none)."""

    def __init__(self, raw: bytes, source: str) -> None:
        super().__init__(io.BytesIO(raw))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"shardkit trace: {self._source} names {module}.{name}; a shardkit trace file "
                                     "holds plain values only, so it is not one (refused, nothing was run)")


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One trace file, as the dict it holds (never through plain pickle)."""
    raw = pathlib.Path(path).read_bytes()
    try:
        dump = _PlainUnpickler(raw, str(path)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as error:
        raise ValueError(f"shardkit trace: {path} is not a readable trace file: {error}") from error
    if not isinstance(dump, dict) or "entries" not in dump or "pg_config" not in dump:
        raise ValueError(f"shardkit trace: {path} is not a shardkit trace file (no entries / pg_config)")
    return dump


def load_dir(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every ``shardkit_trace_rank_<r>`` file in ``directory``, by global rank."""
    folder = pathlib.Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"shardkit trace: {folder} is not a directory")
    dumps = {}
    for path in sorted(folder.iterdir()):
        match = _FILE.match(path.name)
        if match:
            dumps[int(match.group(1))] = load(path)
    if not dumps:
        raise FileNotFoundError(f"shardkit trace: no shardkit_trace_rank_<rank> file in {folder}")
    return dumps


def op_name(entry: Mapping[str, Any]) -> str:
    """The op as torch names it (``all_reduce``), without the backend prefix."""
    return str(entry["profiling_name"]).split(":", 1)[-1]


def _signature(entry: Mapping[str, Any]) -> str:
    return repr((op_name(entry), entry["input_sizes"], entry["input_dtypes"], entry["output_sizes"],
                 entry["output_dtypes"]))


def _describe(entry: Mapping[str, Any], sizes: bool = False) -> str:
    text = f"{op_name(entry)} #{entry['collective_seq_id']}"
    if entry.get("shardkit_unit"):  # the part of the model it moved, where its issuer named one
        text += f" [{entry['shardkit_unit']}]"
    if sizes:
        text += f" (in {entry['input_sizes']} {entry['input_dtypes']}, out {entry['output_sizes']})"
    return text


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


@dataclass
class GroupReport:
    """What ``python -m shardkit trace`` says of one group."""

    name: str
    ranks: list[int]
    missing: list[int] = field(default_factory=list)          # members with no trace file
    last_completed: dict[int, str] = field(default_factory=dict)  # rank -> "all_reduce #4", or "nothing"
    last_entry: dict[int, str] = field(default_factory=dict)      # rank -> "all_reduce #5 (failed)"
    behind: list[int] = field(default_factory=list)
    behind_in: str = ""       # the collective the ranks behind had not reached in time ("all_reduce #5")
    behind_why: str = ""
    divergence: int | None = None   # the first number at which the ranks' ops differ
    divergence_ops: dict[int, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"group {self.name!r} ({_ranks(self.ranks)}):"]
        if self.missing:
            out.append(f"  no trace file from {_ranks(self.missing)}: it wrote none (it issued no shardkit collective "
                       "after the failure, and got no SIGUSR1) - likely stuck outside shardkit")
        for rank in sorted(self.last_completed):
            out.append(f"  rank {rank}: last completed {self.last_completed[rank]}; last recorded "
                       f"{self.last_entry[rank]}")
        if self.behind:
            out.append(f"  behind: {_ranks(self.behind)}, in {self.behind_in}: {self.behind_why}")
        else:
            out.append("  behind: no rank")
        if self.divergence is None:
            out.append("  sequences: the same ops on every rank")
        else:
            ops = "; ".join(f"rank {r}: {op}" for r, op in sorted(self.divergence_ops.items()))
            out.append(f"  sequences diverge at #{self.divergence}: {ops} (a rank skipped, added or changed a "
                       "collective)")
        return out


def analyze(dumps: Mapping[int, Mapping[str, Any]]) -> list[GroupReport]:
    """Compares the ranks' trace files group by group (see the module docstring)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for dump in dumps.values():
        for name, config in dump["pg_config"].items():
            members = [int(r) for r in str(config["ranks"]).strip("[]").split(",") if r.strip()]
            groups.setdefault((str(name), str(config["ranks"])), members)
    reports = []
    for (name, ranks_text), members in sorted(groups.items()):
        per_rank: dict[int, dict[int, Mapping[str, Any]]] = {}
        for rank in members:
            found = dumps.get(rank)
            if found is None or name not in found["pg_config"] or str(found["pg_config"][name]["ranks"]) != ranks_text:
                continue
            per_rank[rank] = {int(e["collective_seq_id"]): e for e in found["entries"]
                              if e["process_group"][0] == name}
        report = GroupReport(name=name, ranks=members, missing=[r for r in members if r not in dumps])
        if not any(per_rank.values()):
            continue
        for rank, entries in per_rank.items():
            done = [e for e in entries.values() if e["state"] == "completed"]
            report.last_completed[rank] = _describe(max(done, key=lambda e: e["collective_seq_id"])) if done else \
                "nothing recorded"
            last = entries[max(entries)] if entries else None
            report.last_entry[rank] = f"{_describe(last)} ({last['state']})" if last else "nothing"
        _find_divergence(report, per_rank)
        _find_behind(report, per_rank)
        reports.append(report)
    return reports


def _find_divergence(report: GroupReport, per_rank: Mapping[int, Mapping[int, Mapping[str, Any]]]) -> None:
    numbers = sorted(set().union(*(set(entries) for entries in per_rank.values())))
    for seq in numbers:
        present = {rank: entries[seq] for rank, entries in per_rank.items() if seq in entries}
        if len(present) < 2:
            continue
        if len({_signature(e) for e in present.values()}) > 1:
            report.divergence = seq
            report.divergence_ops = {rank: _describe(e, sizes=True) for rank, e in present.items()}
            return


def _find_behind(report: GroupReport, per_rank: Mapping[int, Mapping[int, Mapping[str, Any]]]) -> None:
    reached = {rank: max(entries) for rank, entries in per_rank.items() if entries}
    if not reached:
        return
    if report.missing and reached:
        furthest = max(reached.values())
        waiting = [r for r, seq in reached.items() if seq == furthest]
        entry = per_rank[waiting[0]][furthest]
        report.behind, report.behind_in = list(report.missing), _describe(entry)
        report.behind_why = (f"{_ranks(waiting)} recorded it ({entry['state']}); the ranks behind left no trace")
        return
    furthest = max(reached.values())
    lagging = sorted(r for r, seq in reached.items() if seq < furthest)
    if lagging:
        ahead = sorted(r for r, seq in reached.items() if seq == furthest)
        entry = per_rank[ahead[0]][furthest]
        first_missing = min(reached[r] for r in lagging) + 1
        waiting_entry = per_rank[ahead[0]].get(first_missing, entry)
        report.behind, report.behind_in = lagging, _describe(waiting_entry)
        report.behind_why = ", ".join(f"rank {r} last issued #{reached[r]}" for r in lagging) + \
            f"; {_ranks(ahead)} reached #{furthest} ({entry['state']})"
        return
    # Every rank issued the furthest op: the one that issued the first op not completed everywhere last, after a
    # peer had already given up on it, arrived late.
    open_ops = [seq for seq in sorted(set().union(*(set(e) for e in per_rank.values())))
                if any(entries.get(seq, {}).get("state") != "completed" for entries in per_rank.values())]
    if not open_ops:
        return
    seq = open_ops[0]
    present = {rank: entries[seq] for rank, entries in per_rank.items() if seq in entries}
    last_rank = max(present, key=lambda r: present[r]["time_created_ns"])
    others = {r: e for r, e in present.items() if r != last_rank}
    gave_up = [e["time_discovered_completed_ns"] for e in others.values()
               if e["state"] == "failed" and e["time_discovered_completed_ns"]]
    late = present[last_rank]
    if gave_up and late["time_created_ns"] >= min(gave_up):
        first_in = min(others.values(), key=lambda e: e["time_created_ns"])
        report.behind, report.behind_in = [last_rank], _describe(late)
        report.behind_why = (f"it issued the op {(late['time_created_ns'] - first_in['time_created_ns']) / 1e9:.2f} s "
                             f"after the first rank, when {_ranks(sorted(others))} had already given up on it "
                             f"(timeout {late['timeout_ms']} ms)")
    elif any(e["state"] in ("scheduled", "started") for e in present.values()):
        waiting = sorted(r for r, e in present.items() if e["state"] in ("scheduled", "started"))
        report.behind, report.behind_in = [last_rank], _describe(late)
        report.behind_why = f"the last to issue it; {_ranks(waiting)} still in it"


def export_for_torch(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> list[pathlib.Path]:
    """Copies of ``source``'s trace files into ``target`` that torch's analyzer reads (see the module docstring)."""
    out = pathlib.Path(target)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for rank, dump in load_dir(source).items():
        copy = dict(dump)
        entries = []
        for entry in dump["entries"]:
            entry = dict(entry)
            name = op_name(entry)
            entry["profiling_name"] = "gloo:" + (name if name in TORCH_KNOWN_OPS else "barrier")
            entries.append(entry)
        copy["entries"] = entries
        path = out / f"shardkit_trace_rank_{rank}"
        path.write_bytes(pickle.dumps(copy, protocol=2))
        written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="the trace directory (SHARDKIT_TRACE_DIR; the error message names it)")
    parser.add_argument("--for-torch", metavar="OUT", default=None,
                        help="also write copies torch's analyzer reads "
                             "(python -m torch.distributed.flight_recorder.fr_trace OUT)")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    dumps = load_dir(args.directory)
    print(f"shardkit flight recorder: {len(dumps)} trace file(s) in {args.directory} ({_ranks(sorted(dumps))})")
    for rank, dump in sorted(dumps.items()):
        reason = str(dump.get("shardkit_reason", "?"))
        print(f"  rank {rank}: written for: {reason if len(reason) <= 200 else reason[:197] + '...'}")
    for report in analyze(dumps):
        print("\n".join(report.lines()))
    if args.for_torch:
        written = export_for_torch(args.directory, args.for_torch)
        print(f"copies for torch's analyzer: {len(written)} file(s) in {args.for_torch}")
    return 0

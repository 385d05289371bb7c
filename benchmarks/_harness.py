"""The benchmarks' harness: what every script does around what it measures.

Every benchmark compares shardkit with an anchor (gloo, torch DDP, FSDP2, plain DCP, ...) measured in the same
job on the same machine, so the numbers that matter are ratios. Around that measurement each script does the
same things, and they live here:

- the machine and its load: :func:`machine_info`, :func:`announce` (the header line and the busy-machine warning),
  :class:`ForeignLoad` and :func:`load_note` (other processes' CPU during a run);
- launching ranks: :func:`launch_ranks` (spawned processes, file:// rendezvous), :func:`launch_attempts` (again
  with fewer rows when a row breaks the job), :func:`probe` (one fresh-process probe, its failure recorded);
  inside a rank, :func:`init_groups` (default group shardkit, a gloo group beside it), :func:`agree_outcome`,
  :func:`rank0_progress`; on namespace hosts, :func:`bed_run`;
- interleaved repeats: :func:`rotated` / :func:`interleaved_rounds` (round r starts at configuration r mod K, so
  drift on a shared machine hits every configuration alike), :func:`time_collective` / :func:`time_interleaved`
  for collectives, :func:`agree_max` / :func:`agree_max_rows` (the slowest rank's time);
- medians and ratios: :func:`quartiles`, :func:`round_ratios`, :func:`paired_summary`, :func:`describe_paired`,
  :func:`row_ratio`;
- the results file: :func:`add_target` (PASS / MISS / SKIP), :func:`write_json`, :func:`merge_results`,
  :func:`save_results`, :func:`utc_now`, :func:`wrote`.

Absolute numbers are recorded with the machine they came from (:func:`machine_info`). Measurement helpers that
are not about running a benchmark (sizes, tables, memory, plots) are in ``_common``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import multiprocessing as _mp
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --- machine description ----------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for entry in Path("/proc/cpuinfo").read_text().splitlines():
            if entry.startswith("model name"):
                return entry.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for entry in Path("/proc/meminfo").read_text().splitlines():
            if entry.startswith("MemTotal:"):
                return round(int(entry.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, usable cores, memory, software versions, date."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "mem_total_gib": _mem_total_gib(),
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine skews every number
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


class ForeignLoad:
    """How much CPU other processes used while a block ran, in cores (e.g. 0.8 of 2).

    Benchmarks here run on small shared machines; a number measured while a compiler ran next to it is
    not comparable with a quiet one. Measured as the machine's busy time (/proc/stat) minus this process's
    and its reaped children's (the ranks, once joined). Linux only; None elsewhere.

        with ForeignLoad() as load: ...
        load.cores
    """

    def __init__(self) -> None:
        self.cores: float | None = None

    @staticmethod
    def _machine_busy_s() -> float | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal without idle and iowait
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)

    def __enter__(self) -> ForeignLoad:
        self._start = (time.monotonic(), self._machine_busy_s(), self._own_s())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        busy1 = self._machine_busy_s()
        wall = time.monotonic() - wall0
        if busy0 is not None and busy1 is not None and wall > 0:
            self.cores = max(0.0, ((busy1 - busy0) - (self._own_s() - own0)) / wall)


def announce(title: str, machine: Mapping[str, Any], detail: str, *, cores_in_warning: bool = False) -> None:
    """The run's first line, ``title — CPU, N cores, torch V; detail``, and a warning when the machine is already
    busy (1-minute load above half its cores): other work skews every number."""
    print(header(title, machine, detail))
    warn_if_busy(machine, cores_in_warning=cores_in_warning)


def header(title: str, machine: Mapping[str, Any], detail: str) -> str:
    return f"{title} — {machine['cpu_model']}, {machine['usable_cores']} cores, torch {machine['torch']}; {detail}"


def warn_if_busy(machine: Mapping[str, Any], *, cores_in_warning: bool = False) -> None:
    if machine["load_avg_1m"] > 0.5 * machine["usable_cores"]:
        on = f" on {machine['usable_cores']} cores" if cores_in_warning else ""
        print(f"warning: the machine is busy before the run (1-minute load {machine['load_avg_1m']:.1f}{on}): "
              f"expect noisy numbers")


def load_note(cores: float | None, machine: Mapping[str, Any] | None, during: str,
              noisy: str = " — numbers are noisy") -> str | None:
    """"other processes used 0.12 of 2 cores on average during the timed job — numbers are noisy" (the warning
    above 0.1 cores; without ``machine`` the count of cores is left out), or None where it was not measured."""
    if cores is None:
        return None
    of = "" if machine is None else f" of {machine['usable_cores']}"
    return f"other processes used {cores:.2f}{of} cores on average during {during}" + (noisy if cores > 0.1 else "")


# --- launching ranks --------------------------------------------------------------------------------------

def rank0_progress(rank: int, prefix: str = "") -> Callable[..., None]:
    """``progress(text, end="\\n")``: on rank 0, ``prefix + text`` to stderr at once (stdout keeps the results, and a
    run of minutes shows where it is); on the other ranks nothing."""

    def progress(text: str, end: str = "\n") -> None:
        if rank == 0:
            print(prefix + text, end=end, file=sys.stderr, flush=True)

    return progress


class RanksFailed(RuntimeError):
    """A rank raised, crashed or did not finish in time."""


def _rank_entry(fn: Callable[..., Any], rank: int, world: int, store: str, env: Mapping[str, str],
                args: tuple[Any, ...], results: Any) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    try:
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        results.put((rank, True, fn(rank, world, store, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse a clean shutdown
                pass


def launch_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600.0,
                 env: Mapping[str, str] | None = None, daemon: bool = True) -> list[Any]:
    """Run ``fn(rank, world, store_path, *args)`` in ``world`` fresh processes; return their values by rank.

    ``store_path`` names a file in a private temp dir for ``init_method=f"file://{store_path}"`` (no ports).
    Processes are spawned (not forked) so each rank starts clean; the environment gets
    ``OMP_NUM_THREADS=1`` unless ``env`` says otherwise. ``daemon=False`` lets a rank start processes of its own
    (torch's process-based ``dcp.async_save``); such a rank left running is still killed at the timeout. A rank
    that raises, dies or overruns ``timeout`` fails the whole launch with every failing rank's story.
    """
    ctx = _mp.get_context("spawn")
    full_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp:
        store = str(Path(tmp) / "store")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, store, full_env, args, results), daemon=daemon)
                 for r in range(world)]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            (values if ok else errors)[rank] = payload
        for rank, p in enumerate(procs):
            p.join(timeout=10.0 if rank in values or rank in errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
            if rank not in values and rank not in errors:
                errors[rank] = (f"no result (exit code {p.exitcode}"
                                f"{', killed after the timeout' if time.monotonic() >= deadline else ''})")
        results.close()
    if errors:
        story = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RanksFailed(f"{len(errors)} of {world} ranks failed:\n{story}")
    return [values[r] for r in range(world)]


def launch_attempts(fn: Callable[..., Any], world: int, attempts: Sequence[Any], args_of: Callable[[Any], tuple],
                    *, timeout: float, retry_note: Callable[[Any], str]) -> tuple[list[Any], Any, str | None]:
    """:func:`launch_ranks` of ``fn(rank, world, store, *args_of(attempt))`` for the first attempt whose job does
    not fail (attempts: e.g. every row, then fewer: a row that fails on one rank only leaves the other waiting
    in a collective, and the job dies). Returns (the ranks' values, the attempt that ran, the last line of the
    failure before it or None). Between attempts ``retry_note(next attempt)`` goes to stderr with the failure;
    when the last attempt fails too, its RanksFailed propagates."""
    last_error = None
    for n, attempt in enumerate(attempts):
        try:
            return launch_ranks(fn, world, *args_of(attempt), timeout=timeout), attempt, last_error
        except RanksFailed as error:
            if n + 1 == len(attempts):
                raise
            print(f"{retry_note(attempts[n + 1])}:\n{error}", file=sys.stderr, flush=True)
            last_error = str(error)
    raise ValueError("launch_attempts: no attempt given")


def probe(row: dict[str, Any], name: str, fn: Callable[..., Any], world: int, *args: Any, timeout: float,
          prefix: str = "") -> None:
    """One fresh-process probe of a row that the timed job ran: its per-rank values in ``row["rss_by_rank"]``;
    a failure (unexpected: the row ran) is reported and kept in ``row["rss_error"]``, and the run goes on."""
    print(f"{prefix}RSS probe ({name}) …", file=sys.stderr, flush=True)
    try:
        row["rss_by_rank"] = launch_ranks(fn, world, *args, timeout=timeout)
    except RanksFailed as error:
        row["rss_error"] = str(error)
        print(f"RSS probe ({name}) failed:\n{error}", file=sys.stderr)


def bed_run(script: Sequence[str], out: Path, *, hosts: int, ranks_per_host: int, rate_mbit: float, timeout: float,
            logs: Path, what: str) -> dict[str, Any]:
    """``script`` (a rank script and its arguments) under torchrun on every host of a fresh namespace test bed
    (tests/python/support/hostbed.py: ``hosts`` hosts on one bridge, links shaped to ``rate_mbit``; needs root),
    ``ranks_per_host`` ranks each, one thread per rank. Returns the JSON the script wrote to ``out``, with the
    bed's description under "bed"; a failed launch raises with its story, ``what`` naming the run."""
    from support.hostbed import HostBed  # the caller puts tests/python on sys.path

    env = {k: v for k, v in os.environ.items() if k not in ("SHARDKIT_HOST_ID", "GLOO_SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    with HostBed(hosts, rate_mbit) as bed:
        commands = [bed.torchrun(h, ranks_per_host, list(script)) for h in range(hosts)]
        result = bed.launch(commands, env=env, timeout=timeout, logs=logs)
        described = bed.describe()
    if not result.ok:
        raise RuntimeError(f"{what} failed:\n{result.story()}")
    data = json.loads(out.read_text())
    data["bed"] = described
    return data


def init_groups(rank: int, world: int, store: str, timeout_s: float | None = None, *, gloo: bool = True,
                gloo_timeout: bool = False) -> Any:
    """Inside a launched rank: the default process group on shardkit (file:// rendezvous at ``store``), and a gloo
    group over the same ranks, returned (None with ``gloo=False``), which the benchmarks use to line ranks up and
    agree on times without going through the backend they measure. ``gloo_timeout`` gives it ``timeout_s`` too."""
    import shardkit  # noqa: F401  (registers the backend)

    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("shardkit", init_method=f"file://{store}", rank=rank, world_size=world, **kwargs)
    if not gloo:
        return None
    return dist.new_group(backend="gloo", **(kwargs if gloo_timeout else {}))


def agree_outcome(result: Any, what: str, group: Any) -> Any:
    """``result`` (a built configuration, or a str saying why not) once every rank agrees on which of the two it
    is; a rank that built what another could not raises, naming ``what``."""
    flag = torch.tensor([isinstance(result, str)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    if int(flag) not in (0, dist.get_world_size()):
        raise RuntimeError(f"rank {dist.get_rank()}: ranks disagree on whether {what} can be built "
                           f"(here: {result if isinstance(result, str) else 'built'})")
    return result


# --- timing -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TimingConfig:
    max_iters: int = 1000     # calls per repetition for small, fast ops
    reps: int = 5             # repetitions; the reported time is their median
    point_s: float = 0.5      # target time of all repetitions of one point together
    warmup_s: float = 0.05    # minimum warm-up time (at least one call) before the repetitions


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: float            # median over repetitions of (loop time / iters), max over ranks
    iters: int                # calls per repetition
    samples: list[float]      # per-repetition seconds per call, each the max over ranks


def agree_max(values: Sequence[float], group: Any) -> list[float]:
    """Element-wise max over the ranks of ``group`` (all ranks pass equally long lists)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _iterations(call: Callable[[], Any], sync_group: Any, cfg: TimingConfig) -> int:
    """Warm ``call`` up and choose its calls per repetition: batches of 1, 4, 16, ... calls until a batch takes
    long enough to time (agreed over ``sync_group``, so every rank runs the same number)."""
    batch, warmed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(batch):
            call()
        elapsed = agree_max([time.perf_counter() - start], sync_group)[0]
        warmed += elapsed
        if warmed >= cfg.warmup_s or batch >= cfg.max_iters:
            break
        batch *= 4
    return max(1, min(cfg.max_iters, int(cfg.point_s / cfg.reps / max(elapsed / batch, 1e-9))))


def time_collective(call: Callable[[], Any], barrier: Callable[[], Any], sync_group: Any,
                    cfg: TimingConfig) -> Timing:
    """Time ``call`` (one blocking collective) on every rank of the job; all ranks must call this together.

    Every decision that changes how many collectives run (warm-up length, iterations) is taken from
    times agreed with ``agree_max`` over ``sync_group``, so all ranks issue the same sequence and none
    waits forever. ``barrier`` belongs to the backend being measured, so the timed loop starts with that
    backend's ranks lined up rather than with one backend waiting on the other.
    """
    return time_interleaved({"call": call}, {"call": barrier}, sync_group, cfg)["call"]


def time_interleaved(calls: Mapping[str, Callable[[], Any]], barriers: Mapping[str, Callable[[], Any]],
                     sync_group: Any, cfg: TimingConfig) -> dict[str, Timing]:
    """Time several collectives against each other: repetition r of every call runs before r + 1 of any.

    For ratios between calls (one dtype against another, one backend against another) on a machine whose
    load drifts: each call's samples are spread over the same stretch of time, so a busy spell slows all of
    them rather than whichever happened to run then. The order rotates from one repetition to the next, so
    no call always runs first (measured: a 1-2% edge on a 2-core VM). ``barriers[name]`` lines up that
    call's ranks before each of its repetitions. Iterations per call are chosen as in :func:`time_collective`.
    """
    iters = {name: _iterations(call, sync_group, cfg) for name, call in calls.items()}
    own: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(cfg.reps):
        for name in rotated(list(calls), rep):
            barriers[name]()
            start = time.perf_counter()
            for _ in range(iters[name]):
                calls[name]()
            own[name].append((time.perf_counter() - start) / iters[name])
    timings = {}
    for name in calls:
        samples = agree_max(own[name], sync_group)  # a collective is as slow as its slowest rank
        timings[name] = Timing(seconds=statistics.median(samples), iters=iters[name], samples=samples)
    return timings


def agree_max_rows(samples: Mapping[str, Sequence[Sequence[float]]], group: Any) -> dict[str, list[list[float]]]:
    """:func:`agree_max` of per-configuration tables (``{key: [row of floats per round]}``), in one collective:
    the same shape back, every number the slowest rank's. Every rank passes the same keys and row lengths."""
    flat = agree_max([x for rows in samples.values() for row in rows for x in row], group)
    out, i = {}, 0
    for key, rows in samples.items():
        out[key] = []
        for row in rows:
            out[key].append(flat[i: i + len(row)])
            i += len(row)
    return out


# --- interleaved rounds ---------------------------------------------------------------------------------

def rotated(keys: Sequence[Any], r: int) -> list[Any]:
    """Round r starts at configuration r mod K, so no configuration always runs first."""
    shift = r % max(1, len(keys))
    return list(keys[shift:]) + list(keys[:shift])


def interleaved_rounds(keys: Sequence[Any], warmup: int, rounds: int, progress: Callable[..., None] | None = None,
                       *, first: int = 0, label: str = "  round", done: str = "",
                       order: Callable[[Sequence[Any], int], list[Any]] = rotated
                       ) -> Iterator[tuple[int, list[Any], bool]]:
    """``for r, keys_in_order, timed in interleaved_rounds(...)``: rounds ``first`` .. ``warmup + rounds - 1``, each
    with every configuration once, in ``order(keys, r)`` (:func:`rotated` by default), ``timed`` from round
    ``warmup`` on, so a drift on the machine hits all configurations alike. After each round's body,
    ``progress(f"{label} {r + 1}/{total}{done}")`` with " (warm-up)" before the timed rounds."""
    total = warmup + rounds
    for r in range(first, total):
        yield r, order(keys, r), r >= warmup
        if progress is not None:
            progress(f"{label} {r + 1}/{total}{done}{'' if r >= warmup else ' (warm-up)'}")


# --- medians and ratios --------------------------------------------------------------------------------

def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); one value is all three."""
    values = list(values)
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def round_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """num / den of each round: interleaved rounds make a round's two samples comparable (same machine state)."""
    return [a / b for a, b in zip(num, den) if b > 0]


def paired_summary(num: Sequence[float], den: Sequence[float]) -> dict[str, float] | None:
    """The per-round ratios' median and middle half ({"median", "q1", "q3"}), to tell a ratio near its limit
    from noise; None without a round."""
    values = round_ratios(num, den)
    if not values:
        return None
    q1, median, q3 = quartiles(values)
    return {"median": median, "q1": q1, "q3": q3}


def describe_paired(values: Sequence[float] | None, what: str = "per-round median") -> str:
    """"; per-round median 0.98×, middle half 0.95–1.01×" (empty without values)."""
    if not values:
        return ""
    q1, median, q3 = quartiles(values)
    return f"; {what} {median:.3f}×, middle half {q1:.3f}–{q3:.3f}×"


def row_ratio(rows: Mapping[str, Mapping[str, Any]], num: str, den: str, field: str = "step_s") -> float | None:
    """``rows[num][field] / rows[den][field]`` (a ratio of medians), None unless both rows ran ("ok")."""
    if rows.get(num, {}).get("status") != "ok" or rows.get(den, {}).get("status") != "ok":
        return None
    return rows[num][field] / rows[den][field]


# --- results ----------------------------------------------------------------------------------------------

def add_target(checks: list[dict[str, Any]], name: str, value: float | None, limit: float,
               higher_is_better: bool, unit: str) -> None:
    """Print one target and append it to ``checks``: PASS or MISS against ``limit``, SKIP if not measured."""
    if value is None:
        status, shown = "SKIP", "not measured"
    else:
        ok = value >= limit if higher_is_better else value <= limit
        status, shown = ("PASS" if ok else "MISS"), f"{value:.3g}{unit}"
    checks.append({"target": name, "status": status, "value": value, "limit": limit})
    print(f"[{status}] {name}: {shown}")


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def merge_results(path: Path, new: Mapping[str, Any], row_keys: Mapping[str, Callable[[dict[str, Any]], Any]]
                  ) -> dict[str, Any]:
    """``new`` laid over the results already in ``path``, so a partial run does not drop other series.

    Top-level values of ``new`` replace the old ones, except: a list named in ``row_keys`` keeps the old
    entries whose key (``row_keys[name](entry)``) no new entry has, then adds the new ones; a dict merges
    key by key (e.g. per world size). A missing or unreadable file counts as empty.
    """
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    merged: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
    for name, value in new.items():
        previous = merged.get(name)
        if name in row_keys and isinstance(previous, list):
            key = row_keys[name]
            fresh = {key(entry) for entry in value}
            merged[name] = [entry for entry in previous if key(entry) not in fresh] + list(value)
        elif isinstance(value, dict) and isinstance(previous, dict):
            merged[name] = {**previous, **value}
        else:
            merged[name] = value
    return merged


def utc_now() -> str:
    """When a run finished, for the results file (UTC, seconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def save_results(path: Path, payload: Mapping[str, Any],
                 row_keys: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None,
                 same_if: str | None = None) -> dict[str, Any]:
    """Write ``payload`` to the results file ``path``; with ``row_keys``, laid over what the file holds
    (:func:`merge_results`), so a partial run keeps the other series, and with ``same_if`` only when the file's
    ``payload[same_if]`` is the same (e.g. the same model's results). Returns what was written."""
    written = dict(payload)
    if row_keys is not None:
        merged = merge_results(path, payload, row_keys)
        if same_if is None or merged.get(same_if) == payload.get(same_if):
            written = merged
    write_json(path, written)
    return written


def wrote(*paths: Path | None) -> str:
    """"wrote A and B" for the files a run wrote (None: not written, e.g. no matplotlib for the plot)."""
    return "wrote " + " and ".join(str(p) for p in paths if p is not None)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One benchmark job: the model (the benchmark's own ModelConfig), rounds, and the configurations (keys)."""

    model: Any
    warmup: int
    rounds: int
    keys: tuple[str, ...]
    pg_timeout_s: float = 300.0


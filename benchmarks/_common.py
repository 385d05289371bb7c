"""Shared pieces of the shardkit benchmarks: rank launcher, timing loop, formatting, JSON and plots.

Every benchmark compares shardkit with an anchor (gloo, torch DDP, ...) measured in the same job on the
same machine, so the numbers that matter are ratios; absolute numbers are recorded with the machine they
came from (:func:`machine_info`).
"""

from __future__ import annotations

import ctypes
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
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS_DIR = Path(__file__).resolve().parent / "results"

_SIZE_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
                  "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# --- sizes and formatting ---------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864 (binary units, as nccl-tests uses)."""
    raw = text.strip().upper()
    digits = raw.rstrip("KMGIB")
    suffix = raw[len(digits):]
    try:
        value = float(digits) * _SIZE_SUFFIXES[suffix]
    except (ValueError, KeyError):
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4096, 4K, 64M, 1G") from None
    return int(value)


def synthetic_token_batches(vocab: int, batch: int, seq: int, rank: int, steps: int
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded random token sequences, different per rank and step; the target is the next token.

    The same (rank, step) gives the same batch in every configuration and every process, so configurations
    trained on them can be compared parameter for parameter (or loss for loss)."""
    batches = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1234 + 1000 * rank + step)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def format_size(nbytes: int) -> str:
    """4096 -> ``"4K"``, 67108864 -> ``"64M"``; sizes that are not whole units keep bytes."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return f"{nbytes}B"


def format_us(seconds: float) -> str:
    """Latency in microseconds with precision that suits its magnitude."""
    us = seconds * 1e6
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns are left-aligned, the rest right-aligned (numbers)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


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

    def __enter__(self) -> "ForeignLoad":
        self._start = (time.monotonic(), self._machine_busy_s(), self._own_s())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        busy1 = self._machine_busy_s()
        wall = time.monotonic() - wall0
        if busy0 is not None and busy1 is not None and wall > 0:
            self.cores = max(0.0, ((busy1 - busy0) - (self._own_s() - own0)) / wall)


def filesystem_of(path: str) -> str:
    """``fstype on device`` of the mount holding ``path`` (longest mount point that prefixes it)."""
    best = ("", "unknown", "unknown")
    try:
        real = os.path.realpath(path)
        for entry in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = entry.split()[:3]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                best = (mount, fstype, device)
    except (OSError, ValueError):
        pass
    return f"{best[1]} on {best[2]} (mounted at {best[0] or '?'})"


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
                 env: Mapping[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, store_path, *args)`` in ``world`` fresh processes; return their values by rank.

    ``store_path`` names a file in a private temp dir for ``init_method=f"file://{store_path}"`` (no ports).
    Processes are spawned (not forked) so each rank starts clean; the environment gets
    ``OMP_NUM_THREADS=1`` unless ``env`` says otherwise. A rank that raises, dies or overruns ``timeout``
    fails the whole launch with every failing rank's story.
    """
    ctx = _mp.get_context("spawn")
    full_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp:
        store = str(Path(tmp) / "store")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, store, full_env, args, results), daemon=True)
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


def time_collective(call: Callable[[], Any], barrier: Callable[[], Any], sync_group: Any,
                    cfg: TimingConfig) -> Timing:
    """Time ``call`` (one blocking collective) on every rank of the job; all ranks must call this together.

    Every decision that changes how many collectives run (warm-up length, iterations) is taken from
    times agreed with ``agree_max`` over ``sync_group``, so all ranks issue the same sequence and none
    waits forever. ``barrier`` belongs to the backend being measured, so the timed loop starts with that
    backend's ranks lined up rather than with one backend waiting on the other.
    """
    # Warm-up and estimate: run batches of 1, 4, 16, ... calls until a batch takes long enough to time.
    batch, per_call, warmed = 1, 0.0, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(batch):
            call()
        elapsed = agree_max([time.perf_counter() - start], sync_group)[0]
        per_call, warmed = elapsed / batch, warmed + elapsed
        if warmed >= cfg.warmup_s or batch >= cfg.max_iters:
            break
        batch *= 4
    iters = max(1, min(cfg.max_iters, int(cfg.point_s / cfg.reps / max(per_call, 1e-9))))

    samples = []
    for _ in range(cfg.reps):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        samples.append((time.perf_counter() - start) / iters)
    # A collective is as slow as its slowest rank.
    samples = agree_max(samples, sync_group)
    return Timing(seconds=statistics.median(samples), iters=iters, samples=samples)


def time_interleaved(calls: Mapping[str, Callable[[], Any]], barriers: Mapping[str, Callable[[], Any]],
                     sync_group: Any, cfg: TimingConfig) -> dict[str, Timing]:
    """Time several collectives against each other: repetition r of every call runs before r + 1 of any.

    For ratios between calls (one dtype against another, one backend against another) on a machine whose
    load drifts: each call's samples are spread over the same stretch of time, so a busy spell slows all of
    them rather than whichever happened to run then. The order rotates from one repetition to the next, so
    no call always runs first (measured: a 1-2% edge on a 2-core VM). ``barriers[name]`` lines up that
    call's ranks before each of its repetitions. Iterations per call are chosen as in :func:`time_collective`.
    """
    iters: dict[str, int] = {}
    for name, call in calls.items():  # warm-up and per-call estimate, as time_collective does
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
        iters[name] = max(1, min(cfg.max_iters, int(cfg.point_s / cfg.reps / max(elapsed / batch, 1e-9))))

    own: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for rep in range(cfg.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            barriers[name]()
            start = time.perf_counter()
            for _ in range(iters[name]):
                calls[name]()
            own[name].append((time.perf_counter() - start) / iters[name])
    timings = {}
    for name in calls:
        samples = agree_max(own[name], sync_group)
        timings[name] = Timing(seconds=statistics.median(samples), iters=iters[name], samples=samples)
    return timings


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


@dataclasses.dataclass(frozen=True)
class Series:
    """One line of a plot: ``label`` in the legend; lines sharing ``color_key`` share a colour."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color_key: str
    linestyle: str = "-"
    marker: str = "o"


def plot_panels(path: Path, panels: Mapping[str, Sequence[Series]], *, xlabel: str, ylabel: str,
                suptitle: str = "", loglog: bool = True, xtick_labels: Callable[[float], str] | None = None
                ) -> Path | None:
    """One subplot per panel, side by side; returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a display
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None

    keys = sorted({s.color_key for series in panels.values() for s in series})
    colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(keys)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.0), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels.items()):
        for s in series:
            ax.plot(s.xs, s.ys, label=s.label, color=colours[s.color_key], linestyle=s.linestyle,
                    marker=s.marker, markersize=4)
        if loglog:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        if xtick_labels is not None:
            ticks = sorted({x for s in series for x in s.xs})
            ax.set_xticks(ticks)
            ax.set_xticklabels([xtick_labels(x) for x in ticks])
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    return _save_figure(fig, path, suptitle)


# --- memory ------------------------------------------------------------------------------------------------

def unique_storage_bytes(tensors: Any, exclude: Any = ()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped), skipping those of ``exclude``.

    Views of one flat buffer count once, with the buffer's full size: the memory really allocated, not the
    sum of the views' sizes.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rss_parts_bytes() -> dict[str, int]:
    """This process's resident memory now by kind (/proc/self/status RssAnon, RssFile, RssShmem; Linux only).

    ``anon`` is private heap (tensors), ``shmem`` shared-memory segments this process touched, ``file``
    mapped files — mostly library code paged in as kernels are first used, which is no model memory.
    """
    parts: dict[str, int] = {}
    try:
        for entry in Path("/proc/self/status").read_text().splitlines():
            for field, name in (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem")):
                if entry.startswith(field):
                    parts[name] = int(entry.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return parts


def live_rss_bytes() -> dict[str, int]:
    """:func:`rss_parts_bytes` plus ``live``: private + shared-memory RSS, the memory a rank's tensors and
    segments really occupy (mapped library code excluded)."""
    parts = rss_parts_bytes()
    return {"live": parts.get("anon", 0) + parts.get("shmem", 0), **parts}


def return_large_frees_to_os(threshold: int = 128 << 10) -> bool:
    """Fix glibc's mmap threshold, so allocations of ``threshold`` bytes and more are mmap'ed and go back to
    the OS when freed, and RSS tracks the live tensors. glibc otherwise raises the threshold as large blocks
    are freed, and freed tensors stay resident in the heap. Returns False where it cannot be set (not glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def pss_bytes() -> int:
    """This process's proportional set size of private and shared memory now (/proc/self/smaps_rollup Pss_Anon +
    Pss_Shmem; 0 where unreadable): a shared page counts 1/k in each of the k processes that map it. RSS counts
    it whole in each, so ranks that read one another's shared memory (zero-copy buffers) look bigger by RSS than
    the memory they occupy together."""
    total = 0
    try:
        for entry in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if entry.startswith(("Pss_Anon:", "Pss_Shmem:")):
                total += int(entry.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return 0
    return total


class PeakPss:
    """The largest :func:`pss_bytes` seen while the ``with`` block runs, sampled every ``interval_s`` by a thread
    (there is no kernel peak for PSS, as ru_maxrss is for RSS; a peak between two samples can be missed)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, pss_bytes())
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "PeakPss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, pss_bytes())


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (getrusage ru_maxrss; monotone over the process's life)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def plot_bar_panels(path: Path, panels: Mapping[str, tuple[Sequence[str], Mapping[str, Sequence[float]]]], *,
                    ylabels: Mapping[str, str], suptitle: str = "", grouped: Sequence[str] = ()) -> Path | None:
    """One bar chart per panel, side by side: ``{title: (categories, {segment: values per category})}``.

    Several segments stack on one bar (e.g. parameters, gradients, optimizer state), labelled with its total;
    in the panels named in ``grouped`` they stand side by side instead (e.g. fp32 and bf16 of one row).
    NaN values draw no bar.
    Returns the path, or None when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None

    fig, axes = plt.subplots(1, len(panels), figsize=(7.0 * len(panels), 5.5), squeeze=False)
    for ax, (title, (categories, segments)) in zip(axes[0], panels.items()):
        xs = list(range(len(categories)))
        side = title in grouped
        width = 0.8 / len(segments) if side and segments else 0.8
        bottom = [0.0] * len(categories)
        top = 0.0
        for i, (label, values) in enumerate(segments.items()):
            heights = [0.0 if v != v else v for v in values]  # NaN -> no bar
            at = [x - 0.4 + width * (i + 0.5) for x in xs] if side else xs
            ax.bar(at, heights, width=width, bottom=None if side else bottom, label=label,
                   color=plt.get_cmap("tab10")(i % 10))
            if side:
                for x, h in zip(at, heights):
                    if h > 0:
                        ax.annotate(f"{h:.0f}", (x, h), ha="center", va="bottom", fontsize=6)
                top = max([top, *heights])
            else:
                bottom = [b + h for b, h in zip(bottom, heights)]
        if not side:
            for x, total in zip(xs, bottom):
                if total > 0:
                    ax.annotate(f"{total:.0f}", (x, total), ha="center", va="bottom", fontsize=7)
            top = max(bottom, default=0.0)
        ax.set_ylim(0, top * (1.45 if len(segments) > 1 else 1.12) or 1.0)  # room for the legend
        ax.set_xticks(xs)
        ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabels.get(title, ""))
        ax.grid(True, axis="y", alpha=0.3)
        if len(segments) > 1:
            ax.legend(fontsize=8, ncol=2, loc="upper center")
    return _save_figure(fig, path, suptitle)


def _save_figure(fig, path: Path, suptitle: str | None) -> Path:
    """Title, lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One benchmark job: the model (the benchmark's own ModelConfig), rounds, and the configurations (keys)."""

    model: Any
    warmup: int
    rounds: int
    keys: tuple[str, ...]
    pg_timeout_s: float = 300.0

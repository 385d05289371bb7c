"""Measurement helpers shared by the shardkit benchmarks: sizes and formatting, synthetic tokens, filesystems,
memory (tensor bytes, RSS, PSS) and plots.

How a benchmark runs (launching ranks, interleaved rounds, medians and ratios, the results file) is in
``_harness``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20

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


def mib(nbytes: float | None) -> str:
    """Bytes as MiB with one decimal ("-" for None)."""
    return "-" if nbytes is None else f"{nbytes / MiB:,.1f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns are left-aligned, the rest right-aligned (numbers)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


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

    def __enter__(self) -> PeakPss:
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


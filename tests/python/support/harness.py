"""Multi-rank test launcher: run a function on N ranks and collect what each returned or raised.

Ranks are processes started through a forkserver that has torch and shardkit preloaded (fast, and safe
from fork-after-threads), rendezvous through a ``file://`` store in a per-test temp dir (no ports), and
are killed after a hard timeout: a hang fails the test with every unfinished rank's Python stack
(faulthandler dumps it just before the deadline) instead of stalling CI.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

_CONTEXT = mp.get_context("forkserver")
# torch._dynamo: constructing any optimizer imports it (~3 s per rank otherwise). DCP, DTensor and FSDP2: shardkit
# loads them at first use (checkpoints, fully_shard, state dicts), which most tests reach; preloaded, no rank pays.
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
                                 "torch.distributed.checkpoint.state_dict", "torch.distributed.tensor",
                                 "torch.distributed.fsdp", "shardkit"])


@dataclasses.dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error: str | None = None  # formatted traceback when the function raised
    exitcode: int | None = None
    finished: bool = False  # the rank reported a result (value or error) before the deadline

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None


class RanksFailed(AssertionError):
    """Some rank raised, crashed or hung; the message holds every failing rank's story."""


def _rank_main(fn, rank, world_size, args, kwargs, store_path, backend, pg_timeout, env, results, stack_file,
               dump_after):
    os.environ.update(env[rank] if isinstance(env, list) else env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    with open(stack_file, "w") as stacks:
        faulthandler.enable(file=stacks)  # a crash (SIGSEGV, SIGABRT) leaves its Python stack for the report too
        faulthandler.dump_traceback_later(dump_after, exit=False, file=stacks)
        try:
            import torch.distributed as dist

            if backend is not None:
                dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                        world_size=world_size, timeout=timedelta(seconds=pg_timeout))
            value = fn(rank, world_size, *args, **kwargs)
            # Pickled here, by value: a tensor put on the queue as it is travels as a file descriptor of shared
            # memory that the parent fetches from this process later, which fails ("Connection reset by peer") when
            # this rank has exited first.
            results.put((rank, True, pickle.dumps(value)))
        except BaseException:  # noqa: BLE001 - the test decides what an exception means
            results.put((rank, False, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
            try:
                import torch.distributed as dist

                if backend is not None and dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse a clean shutdown
                pass


def launch(fn: Callable[..., Any], world_size: int, *args: Any, workdir: Path, timeout: float = 60.0,
           backend: str | None = "shardkit", pg_timeout: float | None = None,
           env: dict[str, str] | list[dict[str, str]] | None = None, **kwargs: Any) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; never raises for rank failures.

    ``backend=None`` skips init_process_group. The process group's own timeout is ``pg_timeout``
    (default: the hard timeout), so a collective that waits on a dead peer fails inside the rank.
    ``env`` is set in every rank before anything else; a list gives each rank its own. The flight recorder's
    trace files go to ``workdir/traces`` unless ``env`` names another SHARDKIT_TRACE_DIR.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    traces = {"SHARDKIT_TRACE_DIR": str(workdir / "traces")}
    env = [{**traces, **own} for own in env] if isinstance(env, list) else {**traces, **(env or {})}
    store_path = workdir / f"store-{time.monotonic_ns()}"
    results = _CONTEXT.Queue()
    dump_after = max(1.0, timeout - 2.0)
    processes = []
    for rank in range(world_size):
        stack_file = workdir / f"rank{rank}.stacks"
        proc = _CONTEXT.Process(
            target=_rank_main,
            args=(fn, rank, world_size, args, kwargs, str(store_path), backend, pg_timeout or timeout,
                  env if isinstance(env, list) else dict(env or {}), results, str(stack_file), dump_after),
            daemon=True,
        )
        proc.start()
        processes.append(proc)

    outcomes = [RankOutcome(rank) for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    pending = world_size
    while pending and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
            continue
        outcome = outcomes[rank]
        outcome.finished = True
        if ok:
            outcome.value = pickle.loads(payload)  # noqa: S301 - our own ranks' values
        else:
            outcome.error = payload
        pending -= 1
    timed_out = pending and time.monotonic() >= deadline
    for rank, proc in enumerate(processes):
        # Ranks that reported get a moment to shut their process group down; hung ones are killed now.
        proc.join(timeout=5.0 if outcomes[rank].finished else 0.2)
        if proc.is_alive():
            proc.kill()
            proc.join()
        outcomes[rank].exitcode = proc.exitcode
        if not outcomes[rank].finished:
            stack_file = workdir / f"rank{rank}.stacks"
            stacks = stack_file.read_text() if stack_file.exists() else ""
            how = (f"timed out after {timeout:.0f} s and was killed" if timed_out and proc.exitcode == -9
                   else f"exited with code {proc.exitcode} without a result")
            outcomes[rank].error = f"rank {rank} {how}\n{stacks}"
    results.close()
    return outcomes


def script_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float) -> None:
    """A test script's ranks (a script some test runs as a program, e.g. inside a namespace): ``fn`` on
    ``world_size`` ranks from the forkserver, each rank's value printed as a JSON line, a failed rank's traceback
    to stderr; exits 1 if any rank failed, else 0."""
    import json
    import tempfile

    workdir = Path(tempfile.mkdtemp())
    outcomes = launch(fn, world_size, str(workdir / "store"), *args, backend=None, workdir=workdir, timeout=timeout)
    for outcome in outcomes:
        if outcome.ok:
            print(json.dumps(outcome.value), flush=True)
        else:
            print(outcome.error, file=sys.stderr, flush=True)
    sys.exit(0 if all(outcome.ok for outcome in outcomes) else 1)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """``got`` is ``want``: bitwise for tensors (dtype, shape and bytes: NaN, -0.0 and denormals included), the same
    class and keys or length for dicts, lists and tuples (recursively), equal values for the rest; the message names
    the path where they first differ."""
    import torch

    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype} {got.shape}"
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*as_bytes), f"{where}: bytes differ: {got} != {want}"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items, not {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def survivors(outcomes: list[RankOutcome], victim: int) -> list[RankOutcome]:
    """The outcomes of every rank but ``victim``, after checking that the victim was SIGKILLed (a test killed it)
    and that every other rank finished without raising."""
    assert outcomes[victim].exitcode == -signal.SIGKILL, f"rank {victim} (the victim): {outcomes[victim]}"
    others = [o for o in outcomes if o.rank != victim]
    for outcome in others:
        assert outcome.ok, f"rank {outcome.rank}: {outcome.error or outcome}"
    return others


def run(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Like :func:`launch`, but every rank must succeed; returns the ranks' values in rank order."""
    outcomes = launch(fn, world_size, *args, **kwargs)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        story = "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in failed)
        raise RanksFailed(f"{len(failed)} of {world_size} ranks failed:\n{story}")
    return [o.value for o in outcomes]


def readme_blocks(heading: str) -> list[tuple[str, str]]:
    """The fenced code blocks, as (language, code), of the README section whose ``## `` heading starts with
    ``heading``: what a test runs exactly as the README shows it."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index(f"\n## {heading}"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.M | re.S)


def assert_readme_shows_example(heading: str, example: Path, nproc: int) -> None:
    """The README section shows ``example``'s code (the file is two comment lines, then exactly the README's
    code) and the torchrun command that runs it from the repository root."""
    (code_lang, code), (cmd_lang, cmd) = readme_blocks(heading)
    assert (code_lang, cmd_lang) == ("python", "bash")
    assert code == example.read_text().split("\n", 2)[2]
    assert cmd == f"torchrun --standalone --nproc_per_node={nproc} examples/{example.name}\n"


def free_port() -> int:
    """A TCP port nobody listens on now (for launchers that need one: ``accelerate launch``, a multi-host
    torchrun); there is a small window before the caller binds it, which a retry would cover."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float = 120.0,
                 env: dict[str, str] | None = None, python: Path | str = sys.executable,
                 cwd: Path | None = None, torchrun_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` under real ``torchrun --standalone`` (a free port is picked); returns its output.

    ``python`` is the interpreter whose torch and shardkit run (default: this one); ``cwd`` the job's directory;
    ``torchrun_args`` torchrun's own options (``--max-restarts``), before the script.
    """
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_args, str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)

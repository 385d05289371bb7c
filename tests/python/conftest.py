"""Shared fixtures: the multi-rank launcher (see harness.py) bound to the test's temp dir."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so ranks (forkserver children) can import test modules

from support import harness  # noqa: E402

# Four ranks share two cores in CI: keep each rank's intra-op pool to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# This session's segments carry this tag, so the leak check below ignores other jobs on the machine.
SHM_TAG = f"pytest{os.getpid()}"
os.environ["SHARDKIT_SHM_TAG"] = SHM_TAG


class Ranks:
    """`ranks.run(fn, world_size, ...)` / `ranks.launch(...)` with the per-test workdir filled in."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.run = functools.partial(harness.run, workdir=workdir)
        self.launch = functools.partial(harness.launch, workdir=workdir)


@pytest.fixture
def ranks(tmp_path: Path) -> Ranks:
    return Ranks(tmp_path)


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test must leave /dev/shm as it found it."""
    def ours() -> set[str]:
        if not os.path.isdir("/dev/shm"):
            return set()
        return {n for n in os.listdir("/dev/shm") if f"shardkit-{SHM_TAG}-" in n}

    before = ours()
    yield
    if os.path.isdir("/dev/shm"):
        leaked = ours() - before
        assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"

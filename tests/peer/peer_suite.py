"""One backend's run of torch's own peer suite, ``DistributedTest._DistTestBase`` from the installed wheel.

torch drives that suite from ``test/distributed/test_distributed_spawn.py`` (not shipped in the wheel): it
reads ``BACKEND`` and ``WORLD_SIZE`` from the environment at import time, and a test class that mixes
``TestDistBackend`` (one process per rank, ``init_process_group(BACKEND, init_method="file://...")``) into
``DistributedTest._DistTestBase`` starts the ranks in ``setUp``. This module builds the same class, with
the ranks started by ``fork`` (default; seconds per test instead of re-importing torch per rank) or
``spawn``, and runs it under unittest, writing one JSON record per test.

The mode comes from ``SHARDKIT_PEER_MODE`` (read at import, so spawned ranks re-importing this module as
``__mp_main__`` see the same set-up):

  gloo             BACKEND=gloo: the oracle. shardkit is not even imported.
  shardkit         BACKEND=shardkit: torch's test code as shipped, so its name checks
                   (``BACKEND != "gloo"``, ``require_backend_is_available``, ``DistTestCases`` sets) skip.
  shardkit-lifted  BACKEND=gloo for every check in the test code (decorators, test bodies,
                   ``os.environ["BACKEND"]``), but every process group the tests create as "gloo" is
                   created as "shardkit" (in ``distributed_c10d._new_process_group_helper``, which
                   init_process_group and new_group both go through). ``dist.get_backend()`` therefore
                   answers "shardkit": tests comparing it with BACKEND fail, which is the point.

Usage (normally through run_peer_suite.py):
  SHARDKIT_PEER_MODE=shardkit python tests/peer/peer_suite.py --json out.json [-k NAME ...] [--shard 1/2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import unittest

MODES = ("gloo", "shardkit", "shardkit-lifted")
MODE = os.environ.get("SHARDKIT_PEER_MODE", "shardkit")
if MODE not in MODES:
    raise SystemExit(f"SHARDKIT_PEER_MODE must be one of {MODES}, got {MODE!r}")

os.environ["BACKEND"] = "shardkit" if MODE == "shardkit" else "gloo"
os.environ.setdefault("WORLD_SIZE", "3")
os.environ.setdefault("TEMP_DIR", "")  # replaced per test by TestDistBackend.setUp

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

if MODE != "gloo":
    import shardkit  # noqa: E402,F401  registers the "shardkit" backend in this process and in every rank

if MODE == "shardkit-lifted":
    _create_group = c10d._new_process_group_helper

    def _new_process_group_as_shardkit(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        if str(backend) == "gloo":
            backend = dist.Backend("shardkit")
        return _create_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)

    c10d._new_process_group_helper = _new_process_group_as_shardkit

from torch.testing._internal.distributed import distributed_test  # noqa: E402

START_METHOD = os.environ.get("SHARDKIT_PEER_START", "fork")

torch.backends.cuda.matmul.allow_tf32 = False  # as test_distributed_spawn.py does


class TestPeerSuite(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context(START_METHOD).Process)


class _RecordingResult(unittest.TextTestResult):
    """Keeps outcome, seconds and error text of every test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, detail=""):
        self.records.append({"test": test.id().split(".")[-1], "outcome": outcome, "detail": detail,
                             "seconds": round(time.monotonic() - self._started, 2)})

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", "".join(traceback.format_exception(*err))[-20000:])

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", "".join(traceback.format_exception(*err))[-20000:])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "xfail")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "xpass")


def _select(names: list[str], patterns: list[str], shard: str | None) -> list[str]:
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        names = names[index - 1::count]
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where to write the per-test records")
    parser.add_argument("-k", action="append", default=[], help="run tests whose name contains this")
    parser.add_argument("--shard", help="I/N: every N-th test, starting at the I-th (1-based)")
    args = parser.parse_args()

    names = _select(unittest.TestLoader().getTestCaseNames(TestPeerSuite), args.k, args.shard)
    suite = unittest.TestSuite(TestPeerSuite(name) for name in names)
    runner = unittest.TextTestRunner(resultclass=_RecordingResult, verbosity=2, stream=sys.stdout)
    started = time.monotonic()
    result = runner.run(suite)
    with open(args.json, "w") as f:
        json.dump({"mode": MODE, "backend_env": os.environ["BACKEND"], "start_method": START_METHOD,
                   "world_size": int(os.environ["WORLD_SIZE"]), "seconds": round(time.monotonic() - started, 1),
                   "records": result.records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

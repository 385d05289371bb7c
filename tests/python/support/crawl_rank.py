"""One rank of test_hostbed's slow-link test, started by torchrun on each namespace host:

    crawl_rank.py OUT_DIR TIMEOUT_S MIB

After a small warm-up allreduce (connections made), one allreduce of MIB MiB on the shardkit backend (rails across
the hosts) in a group made with a timeout of TIMEOUT_S, over links shaped to a crawl. The default group starts with
a generous timeout: a group's start-up has the same deadline as its operations (as with gloo), and four ranks
starting python on two cores arrive at it seconds apart; the short-deadline group is made once all are there.
Writes OUT_DIR/rank<R>.json: how long it took, whether the result was right, or the error that ended it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import shardkit  # noqa: F401  (registers the backend)


def main() -> None:
    out_dir, timeout_s, mib = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("shardkit", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.ones(16))
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    dist.all_reduce(torch.ones(16), group=group)
    data = torch.full(((mib << 20) // 4,), float(rank + 1))
    result = {"error": None, "seconds": None, "right": None}
    start = time.monotonic()
    try:
        dist.all_reduce(data, group=group)
        result["right"] = bool((data == world * (world + 1) / 2).all())
    except Exception as error:  # what the test is about
        result["error"] = str(error)
    result["seconds"] = time.monotonic() - start
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a failed group is aborted: nothing more to tear down


if __name__ == "__main__":
    main()

"""One rank of test_hostbed's link-cut test, started by torchrun on each namespace host:

    link_cut_rank.py OUT_DIR TIMEOUT_S

allreduces 16 MiB on the shardkit backend (rails across the hosts) over and over, with a group timeout of TIMEOUT_S;
after its second op it leaves OUT_DIR/ready<R> for the test, which then cuts a link. It writes OUT_DIR/rank<R>.json:
the error that ended the loop (None if none did within the loop's bound) and when it was raised (time.time()).
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
    out_dir, timeout_s = Path(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("shardkit", timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    data = torch.ones(4 << 20)
    result = {"error": None, "raised_at": None, "ops": 0}
    try:
        deadline = time.monotonic() + 4 * timeout_s
        while time.monotonic() < deadline:
            dist.all_reduce(data)
            data.fill_(1)
            result["ops"] += 1
            if result["ops"] == 2:
                (out_dir / f"ready{rank}").touch()
    except Exception as error:  # what the test is about
        result.update(error=str(error), raised_at=time.time())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the group is aborted: nothing more to tear down over a cut link


if __name__ == "__main__":
    main()

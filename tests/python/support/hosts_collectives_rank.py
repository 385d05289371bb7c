"""One rank of test_hostbed's collective checks on namespace hosts, started by torchrun on each host:

    hosts_collectives_rank.py OUT_DIR EXPECTED_SCHEME

runs support.host_collectives (every collective, then the large ops that rails carry) on the shardkit backend,
then writes OUT_DIR/rank<R>.json: the host topology it found, the inter-host scheme, and what of shardkit's is left
in this host's /dev/shm after destroy_process_group (each host has its own).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python, for `support`

import torch.distributed as dist  # noqa: E402

import shardkit  # noqa: E402,F401  (registers the backend)
from shardkit.backend import host_topology, inter_host_scheme  # noqa: E402
from support.host_collectives import every_collective, large_ops  # noqa: E402


def main() -> None:
    out_dir, expected_scheme = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("shardkit", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"host_of": list(host_topology().host_of), "scheme": inter_host_scheme(),
              "every_collective": every_collective(rank, world),
              "large_ops": large_ops(rank, world, expected_scheme)}
    dist.destroy_process_group()
    result["left_in_dev_shm"] = sorted(name for name in os.listdir("/dev/shm") if "shardkit" in name)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""``python -m shardkit checkpoint info|consolidate``: a checkpoint read in a plain process (no process group)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._reader import consolidate, info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    info_parser = actions.add_parser("info", help="what a DCP checkpoint directory holds")
    info_parser.add_argument("directory", type=Path)
    info_parser.set_defaults(run=_info_main)
    cons = actions.add_parser("consolidate", help="a DCP checkpoint directory -> one torch.save file")
    cons.add_argument("directory", type=Path)
    cons.add_argument("output", type=Path)
    cons.add_argument("--no-optim", action="store_true", help="leave the optimizer state (key 'optim') out")
    cons.set_defaults(run=_consolidate_main)


def _fail(error: BaseException) -> int:
    print(f"shardkit checkpoint: error: {error}", file=sys.stderr)
    return 1


def _info_main(args: argparse.Namespace) -> int:
    try:
        facts = info(args.directory)
    except (OSError, RuntimeError) as error:
        return _fail(error)
    print(f"checkpoint {args.directory}: saved by {facts['saved_by_ranks']} ranks ({facts['files']} data files, "
          f"{facts['file_bytes']} bytes on disk)")
    print(f"tensors: {facts['tensors']} holding {facts['elements']} elements ({facts['bytes']} bytes)")
    for top, count in facts["by_top_level_key"].items():
        print(f"  {top}: {count} tensors")
    return 0


def _consolidate_main(args: argparse.Namespace) -> int:
    try:
        counts = consolidate(args.directory, args.output, optim=not args.no_optim)
    except (OSError, RuntimeError) as error:
        return _fail(error)
    print(f"wrote {args.output}: {counts['tensors']} tensors, {counts['objects']} other entries")
    return 0

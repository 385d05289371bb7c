"""``python -m shardkit checkpoint info [--verify] | consolidate``: a checkpoint read in a plain process (no
process group). ``info --verify`` first verifies every file (checkpoint.verify) and exits with 1, naming the bad
files, when verification fails."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from ._errors import UnverifiedCheckpointWarning
from ._reader import consolidate, info
from ._verify import verify


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    info_parser = actions.add_parser("info", help="what a DCP checkpoint directory holds")
    info_parser.add_argument("directory", type=Path)
    info_parser.add_argument("--verify", action="store_true",
                             help="verify every file's size and CRC32C against the checkpoint's manifest first")
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
        verified = _verify_quietly(args.directory) if args.verify else None
        facts = info(args.directory)
    except (OSError, RuntimeError, ValueError) as error:
        return _fail(error)
    print(f"checkpoint {args.directory}: saved by {facts['saved_by_ranks']} ranks ({facts['files']} data files, "
          f"{facts['file_bytes']} bytes on disk)")
    print(f"tensors: {facts['tensors']} holding {facts['elements']} elements ({facts['bytes']} bytes)")
    for top, count in facts["by_top_level_key"].items():
        print(f"  {top}: {count} tensors")
    if facts["save_id"] is None:
        print("no shardkit manifest (a plain torch.distributed.checkpoint.save): contents cannot be verified")
    else:
        print(f"shardkit manifest: save {facts['save_id']}")
    if verified is not None:
        what = "size and CRC32C" if verified["checksums"] else "size (no checksums to compare)"
        print(f"verified: {verified['files']} files, {verified['bytes']} bytes, each file's {what} as written")
    return 0


def _verify_quietly(directory: Path) -> dict:
    """checkpoint.verify, its warning printed as one line on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnverifiedCheckpointWarning)
        verified = verify(directory)
    for warning in caught:
        print(f"shardkit checkpoint: warning: {warning.message}", file=sys.stderr)
    return verified


def _consolidate_main(args: argparse.Namespace) -> int:
    try:
        counts = consolidate(args.directory, args.output, optim=not args.no_optim)
    except (OSError, RuntimeError) as error:
        return _fail(error)
    print(f"wrote {args.output}: {counts['tensors']} tensors, {counts['objects']} other entries")
    return 0

"""``python -m shardkit <command>``: command-line tools: ``estimate`` (memory math) and ``checkpoint``
(``info`` / ``consolidate`` of a torch.distributed.checkpoint directory)."""

from __future__ import annotations

import argparse
import sys

from shardkit import checkpoint, estimate


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one line on stderr (no usage block) and exits with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    # "shardkit" is also installed as a console script (pyproject.toml [project.scripts]).
    parser = _Parser(prog="shardkit", description="shardkit command-line tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    estimate_parser = commands.add_parser(
        "estimate",
        help="GPU memory per strategy (DDP, ZeRO-1/2/3, CPU offload) and which one to use",
        description="GPU memory per strategy (DDP, ZeRO-1/2/3, CPU offload) from the ZeRO "
        "paper's bytes-per-parameter math, and the strategy the guides' decision rule picks.",
    )
    estimate.add_arguments(estimate_parser)
    estimate_parser.set_defaults(run=estimate.main)

    checkpoint_parser = commands.add_parser(
        "checkpoint",
        help="inspect or consolidate a torch.distributed.checkpoint directory (no process group needed)",
        description="info: what a DCP checkpoint holds; consolidate: one plain torch.save state dict.",
    )
    checkpoint.add_arguments(checkpoint_parser)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

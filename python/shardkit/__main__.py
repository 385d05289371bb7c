"""``python -m shardkit <command>``: command-line tools: ``estimate`` (memory math), ``checkpoint``
(``info [--verify]`` / ``consolidate`` of a torch.distributed.checkpoint directory), ``scale`` (a training
script at several world sizes) and ``trace`` (the ranks' flight-recorder files compared: who is behind, where they
diverge; shardkit/_trace.py)."""

from __future__ import annotations

import argparse
import sys

from shardkit import _trace, checkpoint, estimate, scale


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
        help="inspect, verify or consolidate a torch.distributed.checkpoint directory (no process group needed)",
        description="info: what a DCP checkpoint holds (--verify: every file checked against its checksums first); "
        "consolidate: one plain torch.save state dict.",
    )
    checkpoint.add_arguments(checkpoint_parser)

    scale_parser = commands.add_parser(
        "scale",
        help="run a training script at several world sizes and strategies: throughput, scaling efficiency, memory",
        description="Runs SCRIPT under torchrun at each world size (and each --strategy), reads the JSON line it "
        "prints per step (as examples/train_gpt.py --json does) and reports throughput, scaling efficiency "
        "throughput(N) / (N x throughput(1)) and per-rank memory.",
        usage="shardkit scale [--worlds N ...] [--strategies S ...] [--out DIR] -- SCRIPT [ARGS ...]",
    )
    scale.add_arguments(scale_parser)

    trace_parser = commands.add_parser(
        "trace",
        help="compare the ranks' flight-recorder files: which rank is behind, in which collective, where they diverge",
        description="Reads the shardkit_trace_rank_<r> files a failed or hung job wrote (SHARDKIT_TRACE_DIR; the "
        "error message names the directory) and says, per group, what every rank last completed, which rank is "
        "behind and in which collective, and where the ranks' sequences of collectives diverge.",
    )
    _trace.add_arguments(trace_parser)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Memory math for choosing a data-parallel strategy: ``python -m shardkit estimate``.

This is the arithmetic the ZeRO paper (Rajbhandari et al., 2020: figure 1, section 3.1) and the
DeepSpeed / FSDP users' guides teach, nothing more. It uses only the standard library, so it runs
without torch or a GPU.

Model states per parameter, in bytes (Psi = parameter count, N = GPUs):

    precision      weights  grads  optimizer state
    fp32              4       4    adam: m + v = 8          sgd: momentum = 4
    bf16 / fp16       2       2    adam + fp32 master: 4 + 8 = 12 (the paper's K = 12)
      (mixed)                      adam, no master copy: 8  sgd + master: 4 + 4,  no master: 4

In fp32 the weights are the master copy, so ``master_weights`` only matters for mixed precision.
"sgd" means SGD with momentum (one fp32 buffer).

Bytes per GPU, with w, g, o the bytes per parameter above:

    DDP                        (w + g + o) * Psi
    ZeRO-1  (optimizer state)  (w + g) * Psi + o * Psi / N
    ZeRO-2  (+ gradients)      w * Psi + (g + o) * Psi / N         ~ FSDP SHARD_GRAD_OP
    ZeRO-3  (+ parameters)     (w + g + o) * Psi / N               = FSDP FULL_SHARD
    ZeRO-3 + CPU offload       (w + g) * Psi / N on the GPU; the optimizer state (master copy
                               included) lives in host RAM: o * Psi / N per GPU, reported as
                               ``cpu_bytes`` (a host with k GPUs needs k times that).

Activations are not modelled: they depend on batch size, sequence length, architecture and
checkpointing. Measure one micro-batch (peak ``torch.cuda.max_memory_allocated()`` minus the model
states) and pass it as ``activation_gb``; it is added, per GPU, to every strategy. Also not counted:
the CUDA context, allocator fragmentation, communication buckets, and ZeRO-3's working set of
gathered layers. Use ``headroom_gb`` to keep a margin for them.

Communication per step is what each GPU sends, as a multiple of Psi, in the large-N limit the paper
uses (a ring all-reduce sends 2 (N-1)/N Psi): 2 Psi for DDP, ZeRO-1 and ZeRO-2 (reduce-scatter +
all-gather), 3 Psi for ZeRO-3 (parameters are all-gathered again in backward). Bytes are at gradient
precision. Offload's host <-> GPU copies are not included.

GB means 10**9 bytes throughout (not GiB).
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

GB = 10**9

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw", "sgd")

# Strategy keys, in the order they are reported, with display names.
STRATEGIES: dict[str, str] = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3 / FULL_SHARD",
    "zero3_offload": "ZeRO-3 + CPU offload",
}

# Named models and their exact parameter counts (embeddings included; GPT-2 ties its output layer to
# the embedding, LLaMA does not). Plain sizes ("7b", "7.5b", "13b", "70b") are parsed as numbers.
PRESETS: dict[str, int] = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "zero-paper-7.5b": 7_500_000_000,  # the ZeRO paper's running example
}

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"^([+-]?[0-9][0-9_]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)([kmbt]?)$")


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state; ``optimizer`` includes the fp32 master copy."""

    weights: int
    grads: int
    optimizer: int
    master: int  # the part of ``optimizer`` that is the fp32 master copy (0 if none)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True)
class StrategyMemory:
    """Per-GPU memory of one strategy, in bytes, plus its per-step communication."""

    strategy: str  # a key of STRATEGIES
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    cpu_bytes: float  # host RAM per GPU (ZeRO-3 + CPU offload only)
    comm_factor: int  # each GPU sends comm_factor * Psi elements per step
    comm_bytes: float

    @property
    def name(self) -> str:
        return STRATEGIES[self.strategy]

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def weights_gb(self) -> float:
        return self.weights_bytes / GB

    @property
    def grads_gb(self) -> float:
        return self.grads_bytes / GB

    @property
    def optimizer_gb(self) -> float:
        return self.optimizer_bytes / GB

    @property
    def activation_gb(self) -> float:
        return self.activation_bytes / GB

    @property
    def cpu_gb(self) -> float:
        return self.cpu_bytes / GB

    @property
    def comm_gb(self) -> float:
        return self.comm_bytes / GB


def bytes_per_param(
    precision: str = "bf16", optimizer: str = "adam", master_weights: bool = True
) -> BytesPerParam:
    """Bytes per parameter for weights, gradients and optimizer state (see the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    state = 8 if optimizer in ("adam", "adamw") else 4  # fp32 m and v, or fp32 momentum
    if precision == "fp32":
        return BytesPerParam(weights=4, grads=4, optimizer=state, master=0)
    master = 4 if master_weights else 0
    return BytesPerParam(weights=2, grads=2, optimizer=master + state, master=master)


def model_states(
    num_params: int,
    num_gpus: int,
    precision: str = "bf16",
    optimizer: str = "adam",
    master_weights: bool = True,
    activation_gb: float = 0.0,
) -> dict[str, StrategyMemory]:
    """Per-GPU memory of every strategy, keyed and ordered as STRATEGIES.

    >>> model_states(7_500_000_000, 64, "fp16")["zero2"].total_gb
    16.640625
    """
    num_params = _positive_int("num_params", num_params)
    num_gpus = _positive_int("num_gpus", num_gpus)
    if not (math.isfinite(activation_gb) and activation_gb >= 0):
        raise ValueError(f"activation_gb must be a finite number >= 0, got {activation_gb!r}")

    bpp = bytes_per_param(precision, optimizer, master_weights)
    n = num_gpus
    w = bpp.weights * num_params  # ints: exact
    g = bpp.grads * num_params
    o = bpp.optimizer * num_params
    act = activation_gb * GB
    comm_2 = 2 * g
    comm_3 = 3 * g

    rows = [
        StrategyMemory("ddp", w, g, o, act, 0, 2, comm_2),
        StrategyMemory("zero1", w, g, o / n, act, 0, 2, comm_2),
        StrategyMemory("zero2", w, g / n, o / n, act, 0, 2, comm_2),
        StrategyMemory("zero3", w / n, g / n, o / n, act, 0, 3, comm_3),
        StrategyMemory("zero3_offload", w / n, g / n, 0, act, o / n, 3, comm_3),
    ]
    return {row.strategy: row for row in rows}


def fits(state: StrategyMemory, gpu_memory_gb: float, headroom_gb: float = 0.0) -> bool:
    """Whether ``state`` (activations included) plus ``headroom_gb`` fits in ``gpu_memory_gb``."""
    return state.total_gb + headroom_gb <= gpu_memory_gb


# The decision rule's rungs, in the order they are tried: the least sharding first.
# ZeRO-1 is no rung: ZeRO-2 needs less memory for the same communication.
_RULE = ("ddp", "zero2", "zero3", "zero3_offload")


def recommend(
    states: dict[str, StrategyMemory], gpu_memory_gb: float, headroom_gb: float = 0.0
) -> str | None:
    """The guides' rule: the first of DDP, ZeRO-2, ZeRO-3, ZeRO-3 + offload that fits, else None."""
    for key in _RULE:
        if fits(states[key], gpu_memory_gb, headroom_gb):
            return key
    return None


def parse_param_count(text: str) -> int:
    """A parameter count from a preset name (PRESETS) or a number: "7e9", "7b", "1.5B", "124M",
    "6_738_415_616". Suffixes k, M, B, T are powers of 1000; the count must be whole and > 0.
    A name that is no preset gets the closest one suggested in the ValueError."""
    key = text.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    match = _COUNT_RE.match(key)
    if match is None:
        presets = ", ".join(PRESETS)
        close = difflib.get_close_matches(key, PRESETS, n=1)
        if close:
            raise ValueError(
                f"unknown model {text!r}: did you mean {close[0]}? "
                f"(presets: {presets}; or a number like 7e9, 7b, 1.5b, 124M)"
            )
        raise ValueError(
            f"unknown model or parameter count {text!r}: use a number like 7e9, 7b, 1.5b, 124M "
            f"or a preset ({presets})"
        )
    try:
        value = Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation:
        raise ValueError(f"cannot read {text!r} as a parameter count") from None
    if value != value.to_integral_value():
        raise ValueError(f"parameter count must be a whole number, got {text!r}")
    if value <= 0:
        raise ValueError(f"parameter count must be positive, got {text!r}")
    return int(value)


def format_report(
    num_params: int,
    num_gpus: int,
    gpu_memory_gb: float,
    precision: str = "bf16",
    optimizer: str = "adam",
    master_weights: bool = True,
    activation_gb: float = 0.0,
    headroom_gb: float = 0.0,
) -> str:
    """The text ``python -m shardkit estimate`` prints: header, table, recommendation."""
    states = model_states(num_params, num_gpus, precision, optimizer, master_weights, activation_gb)
    bpp = bytes_per_param(precision, optimizer, master_weights)
    choice = recommend(states, gpu_memory_gb, headroom_gb)

    if precision == "fp32":
        mode = "fp32"
    else:
        master = "with" if master_weights else "without"
        mode = f"{precision} mixed precision, {master} fp32 master weights"
    opt_parts = ["m + v 8" if optimizer in ("adam", "adamw") else "momentum 4"]
    if bpp.master:
        opt_parts.insert(0, f"master {bpp.master}")
    lines = [
        f"{num_params:,} parameters, {num_gpus} GPU(s) x {gpu_memory_gb:g} GB, {mode}, {optimizer}",
        f"bytes/parameter: weights {bpp.weights} + grads {bpp.grads} + optimizer {bpp.optimizer} "
        f"({', '.join(opt_parts)}) = {bpp.total}",
        "",
    ]

    header = ("strategy", "weights", "grads", "optimizer", "activations", "total GB/GPU", "fits",
              "comm/step")
    rows = []
    for s in states.values():
        rows.append((
            s.name,
            f"{s.weights_gb:.1f}",
            f"{s.grads_gb:.1f}",
            f"{s.optimizer_gb:.1f}",
            f"{s.activation_gb:.1f}",
            f"{s.total_gb:.1f}",
            "yes" if fits(s, gpu_memory_gb, headroom_gb) else "no",
            f"{s.comm_factor}x = {s.comm_gb:.1f} GB",
        ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = [r[0].ljust(widths[0])] + [c.rjust(wd) for c, wd in zip(r[1:-2], widths[1:-2])]
        cells += [r[-2].ljust(widths[-2]), r[-1]]
        lines.append("  ".join(cells).rstrip())

    lines.append("")
    lines.append("GB = 1e9 bytes, per GPU. comm/step = what each GPU sends per step: a multiple")
    lines.append("of the parameter count, at gradient precision.")
    offload = states["zero3_offload"]
    lines.append(
        f"ZeRO-3 + CPU offload keeps {offload.cpu_gb:.1f} GB of optimizer state per GPU in host "
        f"RAM ({offload.cpu_gb * num_gpus:.1f} GB across all {num_gpus} GPUs)."
    )
    lines.append(_recommendation_line(states, choice, gpu_memory_gb, headroom_gb))
    return "\n".join(lines)


# What the recommendation line calls each rung: the FSDP sharding strategy that matches it, too.
_RECOMMENDATION_NAMES = {
    "ddp": "DDP",
    "zero2": "ZeRO-2 / FSDP SHARD_GRAD_OP",
    "zero3": "ZeRO-3 / FSDP FULL_SHARD",
    "zero3_offload": "ZeRO-3 + CPU offload",
}


def _recommendation_line(
    states: dict[str, StrategyMemory], choice: str | None, gpu_memory_gb: float, headroom_gb: float
) -> str:
    """The report's last line. Each GB/GPU figure stands right after the name of its strategy: the
    chosen one's, then that of the rung before it, which did not fit (named as in the table)."""
    budget = f"{gpu_memory_gb:g} GB" + (f" - {headroom_gb:g} GB headroom" if headroom_gb else "")
    if choice is None:
        offload = states["zero3_offload"]
        return (f"recommended: none - does not fit: even {offload.name} needs "
                f"{offload.total_gb:.1f} GB/GPU, more than {budget}; add GPUs or reduce "
                f"activations.")
    chosen = (f"recommended: {_RECOMMENDATION_NAMES[choice]} ({states[choice].total_gb:.1f} GB/GPU "
              f"within {budget})")
    if choice == "ddp":
        return f"{chosen} - the model states fit on every GPU; no sharding needed"
    rejected = states[_RULE[_RULE.index(choice) - 1]]
    return f"{chosen} - {rejected.name} does not fit ({rejected.total_gb:.1f} GB/GPU)"


def _positive_int(name: str, value: object) -> int:
    """``value`` as an int if it is a positive whole number (7.5e9 is accepted), else ValueError."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# --- command line: `python -m shardkit estimate` (see __main__.py) ------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``estimate`` flags to ``parser``."""
    parser.add_argument(
        "--params", required=True, type=_param_count_arg, metavar="COUNT|PRESET",
        help="parameter count (7e9, 7b, 1.5B, 124M, 6_738_415_616) or a preset: "
        + ", ".join(f"{k} ({v:,})" for k, v in PRESETS.items()),
    )
    parser.add_argument("--gpus", type=_positive_int_arg, default=1, metavar="N",
                        help="number of GPUs (data-parallel world size; default: 1, like "
                        "torchrun's --nproc-per-node)")
    parser.add_argument(
        "--gpu-memory-gb", type=_gb_arg(allow_zero=False), default=80.0, metavar="GB",
        help="memory per GPU in GB = 1e9 bytes (default: 80); a card's exact figure is "
        "torch.cuda.get_device_properties(0).total_memory / 1e9",
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="fp32, or bf16/fp16 mixed precision (default: bf16)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                        help="adam/adamw (m and v in fp32) or sgd with momentum (default: adam)")
    parser.add_argument(
        "--master-weights", action=argparse.BooleanOptionalAction, default=True,
        help="keep an fp32 master copy of the weights in mixed precision (default: yes; "
        "ignored for fp32)",
    )
    parser.add_argument(
        "--activation-gb", type=_gb_arg(allow_zero=True), default=0.0, metavar="GB",
        help="activation memory per GPU, added to every strategy (default: 0; not modelled: "
        "measure one micro-batch)",
    )
    parser.add_argument(
        "--headroom-gb", type=_gb_arg(allow_zero=True), default=0.0, metavar="GB",
        help="memory per GPU to keep free for the CUDA context, buffers and fragmentation "
        "(default: 0)",
    )


def main(args: argparse.Namespace) -> int:
    """Prints the report for parsed ``estimate`` arguments; returns the exit code."""
    print(format_report(
        num_params=args.params,
        num_gpus=args.gpus,
        gpu_memory_gb=args.gpu_memory_gb,
        precision=args.precision,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        activation_gb=args.activation_gb,
        headroom_gb=args.headroom_gb,
    ))
    return 0


def _param_count_arg(text: str) -> int:
    try:
        return parse_param_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _gb_arg(allow_zero: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
        if not ok:
            kind = "a number >= 0" if allow_zero else "a positive number"
            raise argparse.ArgumentTypeError(f"must be {kind} of GB, got {text!r}")
        return value

    return parse

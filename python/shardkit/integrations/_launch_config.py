"""accelerate's config file, as shardkit's Accelerator reads it: what ``accelerate launch`` hands a process.

``accelerate launch --config_file cfg.yaml train.py`` does not pass the file to the processes it starts; it turns
the file into environment variables (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``, ``FSDP_TRANSFORMER_CLS_TO_WRAP``,
...), which accelerate's own ``Accelerator`` reads to build its FSDP plugin. shardkit's Accelerator reads the same
variables, when no ``ShardkitPlugin`` is given, and makes them shardkit's choice instead:

    distributed_type: FSDP, fsdp_version: 2   ->  ShardkitPlugin(strategy="fully_shard")
    distributed_type: FSDP, fsdp_version: 1   ->  ShardkitPlugin(strategy="fsdp")  (the FSDP1 front; FULL_SHARD)
    fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap: A,B
                                              ->  auto_wrap=["A", "B"]   (NO_WRAP: the whole model one unit)
    fsdp_reshard_after_forward: true|false    ->  reshard_after_forward (fully_shard)
    distributed_type: MULTI_GPU (or --multi_gpu), on GPUs or CPUs  ->  ShardkitPlugin() (shardkit's DDP)

A setting shardkit does not carry out (size-based wrapping, parameter offload, activation checkpointing, another
FSDP1 sharding strategy, a DeepSpeed config) raises, naming it, instead of being dropped. An explicit
``shardkit_plugin=`` wins over the file, as accelerate's own plugin arguments do.

``distributed_type: MULTI_CPU`` is accelerate's launch through ``mpirun`` (``--mpirun_hostfile``): without one,
``accelerate launch`` starts a single process on each machine, which would then train alone. That case is refused
with the command that starts N processes on one machine (``launch_problem``).

Library-neutral: only ``os.environ``-like mappings in, plain values out (no accelerate import).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# Where a launcher that starts the processes itself puts each one's rank (torchrun; Open MPI, MVAPICH, Intel MPI).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK")


def _flag(environ: Mapping[str, str], name: str, default: bool = False) -> bool:
    value = environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"shardkit Accelerator: {name}={value!r} from accelerate's config is neither true nor false")


def _unsupported(setting: str, value: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"shardkit Accelerator: accelerate's config sets {setting}: {value}, which shardkit's "
                               f"wrapping does not carry out; {instead}")


def plugin_options(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The ShardkitPlugin arguments that accelerate's config file (as ``accelerate launch`` exported it) asks for;
    None where it asks for no sharding (plain DDP: shardkit's default plugin)."""
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        raise _unsupported("distributed_type", "DEEPSPEED", "shardkit's ZeRO is ShardkitPlugin(strategy='zero1' | "
                           "'zero2') (or fully_shard for stage 3), launched with --multi_gpu or torchrun")
    if not _flag(environ, "ACCELERATE_USE_FSDP"):
        return None
    version = environ.get("FSDP_VERSION", "1").strip() or "1"
    if version not in ("1", "2"):
        raise ValueError(f"shardkit Accelerator: FSDP_VERSION={version!r} from accelerate's config; expected 1 or 2")
    options: dict[str, Any] = {"strategy": "fully_shard" if version == "2" else "fsdp"}
    policy = environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").strip().upper() or "NO_WRAP"
    if policy == "TRANSFORMER_BASED_WRAP":
        names = [n.strip() for n in environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if n.strip()]
        if not names:
            raise _unsupported("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP without "
                               "fsdp_transformer_layer_cls_to_wrap", "name the block classes in the config, or pass "
                               "ShardkitPlugin(auto_wrap=...)")
        options["auto_wrap"] = names
    elif policy != "NO_WRAP":
        raise _unsupported("fsdp_auto_wrap_policy", policy, "use TRANSFORMER_BASED_WRAP (block classes) or NO_WRAP")
    if _flag(environ, "FSDP_OFFLOAD_PARAMS"):
        raise _unsupported("fsdp_offload_params", "true", "shardkit's integrations do not offload")
    if _flag(environ, "FSDP_ACTIVATION_CHECKPOINTING"):
        raise _unsupported("fsdp_activation_checkpointing", "true", "apply torch's checkpoint_wrapper to the blocks "
                           "yourself before prepare")
    if version == "2":
        options["reshard_after_forward"] = _flag(environ, "FSDP_RESHARD_AFTER_FORWARD", default=True)
    else:
        strategy = environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper() or "FULL_SHARD"
        if strategy not in ("FULL_SHARD", "1"):
            raise _unsupported("fsdp_sharding_strategy", strategy, "the accelerate integration's fsdp strategy is "
                               "FULL_SHARD (use shardkit.FullyShardedDataParallel directly for the others)")
    return options


def consumed(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The variables that would make accelerate build its own FSDP / DeepSpeed plugin, once shardkit has read them
    (the Accelerator switches them off in this process, so accelerate's state does not wrap a second time)."""
    return [name for name in ("ACCELERATE_USE_FSDP",) if _flag(environ, name)]


def launch_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this process cannot train as launched (else None): ``accelerate launch`` with ``distributed_type:
    MULTI_CPU`` and no ``--mpirun_hostfile`` started this one process alone although the config asked for more
    (accelerate exports MASTER_ADDR only then, and no launcher gave the process a rank)."""
    asked_for_more = "MASTER_ADDR" in environ and _flag(environ, "ACCELERATE_USE_CPU")
    if not asked_for_more or any(environ.get(name) for name in _RANK_VARIABLES):
        return None
    return ("accelerate launch started this process alone: a MULTI_CPU config starts one process per machine and "
            "expects mpirun (--mpirun_hostfile) to start the others. To start N processes on this machine, run "
            "`accelerate launch --multi_gpu --num_processes N train.py` (torchrun underneath; it works on CPUs too), "
            "set distributed_type: MULTI_GPU in the config, or use torchrun")

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

A flag that names the kind of launch (``--multi_gpu``, ``--use_deepspeed``, ...) wins over the file's
``distributed_type``: ``accelerate launch --multi_gpu --config_file fsdp.yaml`` exports no FSDP variable at all, so
the processes see a plain DDP launch. Where the process was started by ``accelerate launch`` (its parent, on Linux)
with a config file (named, or accelerate's default one) whose ``distributed_type`` is FSDP, and no FSDP variable
arrived, ``ignored_fsdp_config`` says so, and the Accelerator warns before it runs DDP (``IGNORED_FSDP_WARNING``).

``distributed_type: MULTI_CPU`` is accelerate's launch through ``mpirun`` (``--mpirun_hostfile``): without one,
``accelerate launch`` starts a single process on each machine, which would then train alone. That case is refused
with the command that starts N processes on one machine (``launch_problem``).

Library-neutral: only ``os.environ``-like mappings (and the launcher's command line) in, plain values out (no
accelerate import).
"""

from __future__ import annotations

import os
import sys
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


# --- a config file accelerate launch ignored ---------------------------------------------------------------------
# The flags that, given on the command line, make accelerate launch ignore the config file's distributed_type
# (accelerate/commands/launch.py, _validate_launch_command).
_KIND_FLAGS = ("--multi_gpu", "--tpu", "--tpu_use_cluster", "--use_deepspeed", "--use_megatron_lm")

IGNORED_FSDP_WARNING = (
    "shardkit Accelerator: accelerate launch was given {flag} and the config file {path}, whose distributed_type: FSDP "
    "it then ignores (a flag naming the kind of launch wins over the file), so no FSDP setting reached this process "
    "and shardkit runs DDP (ShardkitPlugin(strategy='ddp')), not sharded. To shard as the file says, launch without "
    "{flag} (the file's distributed_type: FSDP starts the processes under torchrun as well), or pass "
    "shardkit_plugin=ShardkitPlugin(strategy='fully_shard') to the Accelerator.")


def launcher_command(pid: int | None = None) -> tuple[list[str], str] | None:
    """(the command line, the working directory) of the process that started this one (or of ``pid``), where it is
    ``accelerate launch`` and /proc tells; else None."""
    pid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = [a.decode(errors="replace") for a in file.read().split(b"\0") if a]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    for i, arg in enumerate(argv[:-1]):
        program = os.path.basename(arg)
        if (program == "accelerate" or arg in ("accelerate.commands.accelerate_cli", "accelerate.commands.launch")) \
                and argv[i + 1] == "launch":
            return argv[i + 2:], cwd
        if arg == "accelerate.commands.launch":  # python -m accelerate.commands.launch
            return argv[i + 1:], cwd
    return None


def _launcher_options(argv: list[str], cwd: str, script: str | None) -> list[str]:
    """The launcher's own arguments: those before the training script (``script``, this process's ``sys.argv[0]``),
    with ``--x=v`` split and hyphens spelled as underscores (accelerate takes both)."""
    end = len(argv)
    if script:
        target = os.path.realpath(script)
        end = next((i for i, a in enumerate(argv) if os.path.realpath(os.path.join(cwd, a)) == target), end)
    options = []
    for arg in argv[:end]:
        key, equals, value = arg.partition("=")
        if key.startswith("--"):
            key = "--" + key[2:].replace("-", "_")
        options += [key, value] if equals else [key]
    return options


def _config_distributed_type(path: str) -> str | None:
    """The ``distributed_type`` of accelerate's config file at ``path`` (YAML or JSON), upper-case; None where the
    file cannot be read (the launcher would have failed on it)."""
    try:
        with open(path) as file:
            text = file.read()
        if path.endswith(".json"):
            import json

            config = json.loads(text)
        else:
            import yaml  # accelerate's own dependency

            config = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - an unreadable file (the launcher would have refused it): nothing to say
        return None
    value = config.get("distributed_type") if isinstance(config, dict) else None
    return str(value).upper() if value is not None else None


def _default_config_file(environ: Mapping[str, str]) -> str:
    """accelerate's default config file (accelerate/commands/config/config_args.py's path)."""
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")


def ignored_fsdp_config(environ: Mapping[str, str] = os.environ,
                        launcher: tuple[list[str], str] | None = None) -> str | None:
    """The warning (``IGNORED_FSDP_WARNING``) where ``accelerate launch`` (``launcher``: its arguments and working
    directory; default: this process's parent, if it is one) had a config file saying ``distributed_type: FSDP``
    and a flag that overrode it, so that no FSDP variable reached this process; else None."""
    if _flag(environ, "ACCELERATE_USE_FSDP"):
        return None
    launcher = launcher if launcher is not None else launcher_command()
    if launcher is None:
        return None
    argv, cwd = launcher
    options = _launcher_options(argv, cwd, sys.argv[0] if sys.argv and sys.argv[0] else None)
    flag = next((f for f in _KIND_FLAGS if f in options), None)
    if flag is None:
        return None
    if "--config_file" in options and options.index("--config_file") + 1 < len(options):
        path = os.path.join(cwd, options[options.index("--config_file") + 1])
    elif "--cpu" in options:
        return None  # accelerate reads no default config under --cpu
    else:
        path = _default_config_file(environ)
    if _config_distributed_type(path) != "FSDP":
        return None
    return IGNORED_FSDP_WARNING.format(flag=flag, path=path)

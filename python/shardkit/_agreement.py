"""Ranks agree on the arguments that decide a wrapper's collectives, before it issues any that depends on them.

gloo and NCCL pair collectives by issue order, so ranks that built a wrapper with different communication
arguments (FSDP's sharding_strategy or mixed precision, DDP's bucket_cap_mb or zero_stage, ...) would pair
different collectives: a hang, an unpacking error deep inside, or silently wrong numbers. Instead every rank
first sends its arguments, as printable values, to every other in one object all-gather (shardkit._exchange),
and each rank raises the same error naming the ranks and the values that differ.

The exchange runs over the world group whenever the wrapper spans every rank of it, whatever group object each
rank passed, so that ranks passing different groups (or none) still meet in it; a wrapper over some of the ranks
exchanges over its own group(s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from . import _exchange, _torch_compat


def describe_group(group: dist.ProcessGroup | None) -> str:
    """A process group as ranks compare it: the same group object (or None for the default group) gives the same
    text on every rank of it."""
    group = group if group is not None else _torch_compat.default_group()
    return f"group '{group.group_name}' over ranks {dist.get_process_group_ranks(group)} ({dist.get_backend(group)})"


def describe_groups(process_group: Any) -> str:
    """A wrapper's ``process_group`` argument as ranks compare it: a group (or None, the default one) as
    describe_group; a (shard, replicate) pair by its groups' sizes and backends (each rank has a pair of its own:
    mismatched_pairs checks that they fit together); anything else without addresses (the wrapper refuses it, alike
    on every rank)."""
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return describe_group(process_group)
    if _is_group_pair(process_group):
        shard, replicate = process_group
        return (f"(a shard group of {dist.get_world_size(shard)} ranks ({dist.get_backend(shard)}), a replicate "
                f"group of {dist.get_world_size(replicate)} ranks ({dist.get_backend(replicate)}))")
    if isinstance(process_group, tuple):
        return f"({', '.join('None' if g is None else describe_groups(g) for g in process_group)})"
    return type(process_group).__name__


def pair_members(process_group: Any) -> tuple[list[int], list[int]] | None:
    """The global ranks of a (shard, replicate) pair's groups, for mismatched_pairs; None for anything else."""
    if not _is_group_pair(process_group):
        return None
    shard, replicate = process_group
    return dist.get_process_group_ranks(shard), dist.get_process_group_ranks(replicate)


def mismatched_pairs(everyone: dict[int, tuple[list[int], list[int]] | None]) -> list[str]:
    """Where ranks passed (shard, replicate) pairs ({global rank: pair_members}), every member of a rank's shard
    (replicate) group must name the same shard (replicate) group, else a rank issues collectives on a group its
    peer never uses: the first such difference, as a disagreement on process_group."""
    for rank, members in sorted(everyone.items()):
        for which, (kind, ranks) in enumerate(zip(("shard", "replicate"), members or ())):
            for peer in ranks:
                theirs = everyone.get(peer)
                if theirs is not None and theirs[which] != ranks:
                    return [f"ranks disagree on process_group: rank {rank}'s {kind} group holds ranks {ranks}, but "
                            f"rank {peer}'s holds ranks {theirs[which]}"]
    return []


def _is_group_pair(process_group: Any) -> bool:
    return isinstance(process_group, tuple) and len(process_group) == 2 and all(
        isinstance(g, dist.ProcessGroup) for g in process_group)


def exchange_groups(groups: Sequence[Any]) -> list[dist.ProcessGroup]:
    """Where ranks exchange their arguments, chosen from this rank's own ``groups`` (the wrapper's group, or its
    (shard, replicate) pair; None or anything else: the default group): the world group when they span every rank
    (one group of the world's size, or a pair whose sizes multiply to it), else those groups, in order."""
    given = [g for g in groups if isinstance(g, dist.ProcessGroup)]
    world = _torch_compat.default_group()
    if not given or math.prod(dist.get_world_size(g) for g in given) == dist.get_world_size():
        return [world]
    return given


def gather(mine: Any, groups: Sequence[dist.ProcessGroup]) -> dict[int, Any]:
    """{global rank: its ``mine``} for every rank of ``groups``: one object all-gather per group, in the given order
    (a collective: every rank of each group calls it with the same groups)."""
    everyone: dict[int, Any] = {}
    for group in groups:
        everyone.update(zip(dist.get_process_group_ranks(group), _exchange.all_gather_object(mine, group)))
    return everyone


def disagreements(everyone: dict[int, dict[str, str]]) -> list[str]:
    """``"ranks disagree on NAME: rank 0 A, ranks 1, 2 B"`` for every argument whose value differs between ranks
    (``everyone``: {global rank: {argument name: printable value}}), in the arguments' order."""
    names = list(dict.fromkeys(name for arguments in everyone.values() for name in arguments))
    found = []
    for name in names:
        ranks_by_value: dict[str, list[int]] = {}
        for rank in sorted(everyone):
            ranks_by_value.setdefault(everyone[rank].get(name, "(not given)"), []).append(rank)
        if len(ranks_by_value) > 1:
            found.append(f"ranks disagree on {name}: "
                         + ", ".join(f"{name_ranks(ranks)} {value}" for value, ranks in ranks_by_value.items()))
    return found


def name_ranks(ranks: Sequence[int]) -> str:
    """'rank 3' or 'ranks 0, 2'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def non_default_fields(value: Any) -> str:
    """A dataclass as its class name and the fields that differ from their defaults: ``MixedPrecision(param_dtype=
    torch.bfloat16)``; anything else as repr()."""
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is None:
        return repr(value)
    changed = [f"{name}={getattr(value, name)!r}" for name, field in fields.items()
               if getattr(value, name) != field.default]
    return f"{type(value).__name__}({', '.join(changed)})"

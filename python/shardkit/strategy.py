"""``shardkit.auto`` (defined here): wrap a model with the data-parallel strategy the memory math picks, through
the front that ``front_for`` names for it (the one table of that choice: the integrations' ``strategy="auto"``
wraps by it too).

    model, optimizer = shardkit.auto(model, torch.optim.AdamW, lr=3e-4)

1. Count the trainable parameters (Psi), read the precision from their dtype (fp32, or bf16/fp16 held in that
   dtype: no fp32 master copy) and the optimizer's state from its class (Adam-like: 8 bytes per parameter,
   SGD with momentum: 4, without: 0 -- counted as 4, the estimator's smallest).
2. The budget per rank: ``memory_budget_gb`` if given; else, for a model on a CUDA device, that device's free
   memory; for a CPU model, the host's available memory (``MemAvailable``) divided by the ranks on this host
   (counted from the ranks' host identities, in the same exchange: no launcher variable needed, so srun and
   Kubeflow launches count right too). Every rank then takes the smallest of all ranks' budgets (one object
   exchange), so all choose the same strategy.
3. The estimator's rule (shardkit.estimate.recommend, the ZeRO paper's and the users' guides' arithmetic):
   the first of DDP, ZeRO-2, ZeRO-3 (FSDP FULL_SHARD) and ZeRO-3 + CPU offload whose model states plus
   ``headroom_gb`` fit the budget. Activations are not modelled: pass a measured ``activation_gb``.
4. Wrap with the front ``front_for`` names and build the optimizer:
     ddp    shardkit.DistributedDataParallel(model)            + optimizer_class(model.parameters(), ...)
     zero2  shardkit.DistributedDataParallel(model, zero_stage=2) + ZeroRedundancyOptimizer(..., optimizer_class)
     zero3  shardkit.fully_shard on each unit, then on the root (torch FSDP2's semantics: the model is sharded in
            place and returned, its parameters DTensors) + optimizer_class(model.parameters(), ...)
     zero3_offload  shardkit.FullyShardedDataParallel(model, auto_wrap_policy,
            cpu_offload=CPUOffload(offload_params=True)) + optimizer_class(model.parameters(), ...): shards,
            gradients and the optimizer's state in host memory, compute on the model's GPU (the FSDP1 front's
            offload is the one shardkit builds and tests on CUDA; a CPU model has nothing to offload from:
            ``auto`` raises saying so, with the table).
   When nothing fits, it raises with the table too. The decision is logged (logger ``shardkit.auto``, rank 0)
   with the table behind it, and returned as ``model.shardkit_plan`` (an ``AutoPlan``; ``.front`` names the
   front). ``plan()`` is the decision alone, without torch.distributed.

Counted conservatively: a bf16/fp16 model's optimizer state is counted as fp32 moments (8 bytes per parameter
for Adam) though torch's optimizers keep it in the parameters' dtype.

The sharded units (fully_shard's calls, the FSDP1 front's units): ``auto_wrap_policy`` if given (an FSDP1-style
policy or a set of module classes, as ``shardkit.wrap`` applies it); else the classes of the modules held in the
model's ``nn.ModuleList``s (a transformer's blocks), else a size-based policy of Psi / 8 parameters per unit, so
that a rank gathers one slice of the model at a time, as the ZeRO-3 row of the estimate assumes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _exchange, _topology, _torch_compat, estimate

__all__ = ["AutoPlan", "agreed_plan", "auto", "front_for", "plan"]

log = logging.getLogger("shardkit.auto")

_ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor", "Lamb", "LAMB")

# The front that carries out each of the estimator's choices (the keys of shardkit.estimate.STRATEGIES), named as
# the integrations' strategies are: shardkit's DDP for ddp and zero2; for ZeRO-3 fully_shard, the front shardkit
# leads with (README, docs/fully_shard.md); for ZeRO-3 + CPU offload the FSDP1 front, whose offload
# (csrc/fsdp/offload.h) is the one shardkit tests on CUDA.
_FRONTS = {"ddp": "ddp", "zero2": "zero2", "zero3": "fully_shard", "zero3_offload": "fsdp"}


def front_for(strategy: str) -> str:
    """The front that wraps a model for the estimator's choice ``strategy`` ("ddp" | "zero2" | "zero3" |
    "zero3_offload"): "ddp", "zero2", "fully_shard" or "fsdp". ``shardkit.auto`` and the integrations'
    ``strategy="auto"`` both ask here, so they wrap alike."""
    try:
        return _FRONTS[strategy]
    except KeyError:
        raise ValueError(f"shardkit.auto: no front for strategy {strategy!r}; the estimator's strategies are "
                         f"{sorted(_FRONTS)}") from None


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """What ``auto`` decided and why: the inputs of the estimate, its table and the chosen strategy."""

    strategy: str  # "ddp" | "zero2" | "zero3" | "zero3_offload" (a key of shardkit.estimate.STRATEGIES)
    num_params: int
    world_size: int
    precision: str  # "fp32" | "bf16" | "fp16"
    optimizer: str  # "adam" | "sgd" (the estimator's names)
    budget_gb: float  # per rank, the smallest over the ranks
    headroom_gb: float
    activation_gb: float
    report: str  # the estimator's table and recommendation

    @property
    def front(self) -> str:
        """The front that wraps the model for ``strategy`` (``front_for``): "ddp" | "zero2" | "fully_shard" |
        "fsdp"."""
        return front_for(self.strategy)


def plan(num_params: int, world_size: int, budget_gb: float, precision: str = "fp32", optimizer: str = "adam",
         headroom_gb: float = 0.0, activation_gb: float = 0.0) -> AutoPlan:
    """The decision alone (no torch.distributed): raises RuntimeError when no strategy fits."""
    states = estimate.model_states(num_params, world_size, precision, optimizer, master_weights=False,
                                   activation_gb=activation_gb)
    report = estimate.format_report(num_params, world_size, budget_gb, precision, optimizer, master_weights=False,
                                    activation_gb=activation_gb, headroom_gb=headroom_gb)
    choice = estimate.recommend(states, budget_gb, headroom_gb)
    if choice is None:
        raise RuntimeError(f"shardkit.auto: no strategy fits in {budget_gb:g} GB per rank ({num_params} parameters, "
                           f"{world_size} ranks, {precision}, {optimizer}):\n{report}")
    return AutoPlan(choice, num_params, world_size, precision, optimizer, budget_gb, headroom_gb, activation_gb,
                    report)


def agreed_plan(trainable: Sequence[torch.Tensor], optimizer: str, memory_budget_gb: float | None,
                group: dist.ProcessGroup, *, headroom_gb: float = 0.0, activation_gb: float = 0.0,
                who: str = "shardkit.auto") -> AutoPlan:
    """The plan every rank of ``group`` agrees on (steps 1-3 of the module docstring): ``trainable`` are the model's
    trainable parameters, ``optimizer`` the estimator's name ("adam" | "sgd"), ``memory_budget_gb`` this rank's
    budget (None: the device's free memory). A collective (one object exchange): call it on every rank.
    ``who`` names the caller in errors."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not trainable:
        raise ValueError(f"{who} (rank {rank}): the model has no trainable parameters")
    if memory_budget_gb is not None and not memory_budget_gb > 0:
        raise ValueError(f"{who} (rank {rank}): memory_budget_gb must be positive, got {memory_budget_gb!r}")
    device = trainable[0].device
    # (budget, host): a CPU rank's budget is its host's available memory, shared by the group's ranks on that host.
    mine = (float(memory_budget_gb if memory_budget_gb is not None else _free_memory_gb(device)),
            _topology.host_id() if memory_budget_gb is None and device.type != "cuda" else None)
    everyone = _exchange.all_gather_object(mine, group)
    budget = min(gb / sum(1 for _, other in everyone if other == host) if host is not None else gb
                 for gb, host in everyone)
    if not budget > 0:
        raise ValueError(f"{who} (rank {rank}): no memory to plan with (budgets {[gb for gb, _ in everyone]} GB)")
    return plan(sum(p.numel() for p in trainable), world, budget, _precision(trainable), optimizer, headroom_gb,
                activation_gb)


def log_decision(decided: AutoPlan, chosen: str, rank: int) -> None:
    """Logs (logger ``shardkit.auto``, rank 0 only) what was chosen and the table behind it."""
    if rank == 0:
        log.info("shardkit.auto chose %s (%s GB per rank):\n%s", chosen, f"{decided.budget_gb:g}", decided.report)


def auto(model: nn.Module, optimizer_class: type[torch.optim.Optimizer], memory_budget_gb: float | None = None, *,
         process_group: dist.ProcessGroup | None = None, headroom_gb: float = 0.0, activation_gb: float = 0.0,
         auto_wrap_policy: Callable[..., bool] | set[type[nn.Module]] | None = None,
         **optimizer_kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(wrapped model, optimizer) with the strategy the memory math picks; see the module docstring. For ZeRO-3 the
    wrapped model is ``model`` itself, sharded in place by ``fully_shard`` (an ``FSDPModule``). A collective: call
    it on every rank of ``process_group`` (default: the default group) with the same model."""
    from .ddp import DistributedDataParallel
    from .fsdp import CPUOffload, FullyShardedDataParallel
    from .zero import ZeroRedundancyOptimizer

    group = process_group if process_group is not None else _torch_compat.default_group()
    rank = dist.get_rank(group)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decided = agreed_plan(trainable, _optimizer_kind(optimizer_class), memory_budget_gb, group,
                          headroom_gb=headroom_gb, activation_gb=activation_gb)
    if decided.strategy == "zero3_offload" and trainable[0].device.type != "cuda":
        raise RuntimeError(f"shardkit.auto (rank {rank}): only ZeRO-3 + CPU offload fits in {decided.budget_gb:g} GB "
                           f"per rank, and offloading needs a model on a CUDA device (its parameters are on "
                           f"{trainable[0].device}):\n{decided.report}")
    log_decision(decided, f"{estimate.STRATEGIES[decided.strategy]} ({decided.front})", rank)
    if decided.front == "ddp":
        wrapped: nn.Module = DistributedDataParallel(model, process_group=group)
        optimizer: torch.optim.Optimizer = optimizer_class(wrapped.parameters(), **optimizer_kwargs)
    elif decided.front == "zero2":
        wrapped = DistributedDataParallel(model, process_group=group, zero_stage=2)
        optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class, process_group=group,
                                            **optimizer_kwargs)
    elif decided.front == "fully_shard":
        policy = auto_wrap_policy if auto_wrap_policy is not None else default_wrap_policy(model)
        wrapped = _fully_shard_units(model, policy, group, trainable[0].device.type)
        optimizer = optimizer_class(wrapped.parameters(), **optimizer_kwargs)
    else:  # "fsdp": ZeRO-3 + CPU offload
        policy = auto_wrap_policy if auto_wrap_policy is not None else default_wrap_policy(model)
        wrapped = FullyShardedDataParallel(model, process_group=group, auto_wrap_policy=policy,
                                           cpu_offload=CPUOffload(offload_params=True))
        optimizer = optimizer_class(wrapped.parameters(), **optimizer_kwargs)
    wrapped.shardkit_plan = decided  # type: ignore[assignment]  # nn.Module's __setattr__ is typed for tensors
    return wrapped, optimizer


def _fully_shard_units(model: nn.Module, policy: Callable[..., bool] | set[type[nn.Module]],
                       group: dist.ProcessGroup, device_type: str) -> nn.Module:
    """``model`` sharded in place by ``shardkit.fully_shard``: every unit ``policy`` chooses (as the FSDP1 front
    would choose them), innermost first as FSDP2 requires, then the root, all over ``group`` (a 1-D mesh of the
    model's device type, so the model stays on its device as it would under the FSDP1 front). Returns the model."""
    from torch.distributed.device_mesh import DeviceMesh

    from .fsdp import fully_shard
    from .wrap import as_policy, choose_units

    mesh = DeviceMesh.from_group(group, device_type)
    (_, root), *units = choose_units(model, as_policy(policy), ignored=set())
    for _, unit in reversed(units):  # choose_units lists them in pre-order: an enclosing unit before its own
        fully_shard(unit, mesh=mesh)
    return fully_shard(root, mesh=mesh)


def default_wrap_policy(model: nn.Module) -> Callable[..., bool] | set[type[nn.Module]]:
    """The classes held in the model's ModuleLists (a transformer's blocks); else Psi / 8 parameters per unit."""
    from .wrap import size_based_auto_wrap_policy

    blocks = module_list_blocks(model)
    if blocks:
        return blocks
    numel = sum(p.numel() for p in model.parameters())
    return lambda module, recurse, nonwrapped_numel: size_based_auto_wrap_policy(
        module, recurse, nonwrapped_numel, min_num_params=max(1, numel // 8))


def module_list_blocks(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of the modules (with parameters) held in the model's ModuleLists: a transformer's blocks."""
    return {type(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m
            if any(True for _ in child.parameters())}


def _precision(params: Sequence[torch.Tensor]) -> str:
    dtypes = {p.dtype for p in params}
    if dtypes == {torch.bfloat16}:
        return "bf16"
    if dtypes == {torch.float16}:
        return "fp16"
    return "fp32"  # fp32, or mixed: counted at the larger size


def _optimizer_kind(optimizer_class: type) -> str:
    if any(base.__name__ in _ADAM_LIKE for base in optimizer_class.__mro__):
        return "adam"
    return "sgd"  # momentum (4 bytes); plain SGD needs less, the estimator's smallest row is this one


def _free_memory_gb(device: torch.device) -> float:
    """The device's free memory; for the CPU, the whole host's available memory (agreed_plan shares it out)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / estimate.GB
    with open("/proc/meminfo") as meminfo:
        available_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    return available_kib * 1024 / estimate.GB

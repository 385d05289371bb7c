"""Models, data and the lock-step driver for the FSDP parity tests (imported by the ranks too).

The oracle is torch's DistributedDataParallel on a **gloo** group over every rank (no shardkit code on its
path). The device under test is shardkit's FullyShardedDataParallel, on the default ("shardkit") group or,
with ``dut_backend="gloo"``, on a second gloo group (shardkit FSDP must work on any backend). Both get the
same module (deep copies), their own optimizer and the same per-rank batch, and take turns (torch's
forward+backward, then shardkit's), so their collectives never interleave. After every step the FSDP
model's full state dict (gathered) must equal the DDP model's.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support.ddp_cases import assert_close, gloo_world, loss_fn

D_IN, D, D_OUT = 8, 16, 4


class Block(nn.Module):
    """A residual MLP block (a transformer block's shape without attention)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A token embedding, ``depth`` Blocks of width ``d``, a final norm and an LM head tied to the embedding (the
    tied weight is the root unit's, as torch's guides place it)."""

    def __init__(self, depth: int, vocab: int, d: int) -> None:
        super().__init__()
        self.skip: set[int] = set()  # layers the forward leaves out (a rank taking another branch)
        self.order: list[int] | None = None  # the order the forward runs the layers in (None: as listed)
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        for i in self.order or range(len(self.layers)):
            if i not in self.skip:
                h = self.layers[i](h)
        return self.lm_head(self.norm(h))


class Net(nn.Module):
    """An input layer, ``depth`` Blocks, a head. ``tied``: the first and last blocks share one weight (a
    parameter registered by modules of two different units, which their closest common unit must own)."""

    def __init__(self, depth: int = 3, tied: bool = False, d_in: int = D_IN) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, D, bias=False)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(D, D_OUT)
        if tied:
            self.blocks[-1].up.weight = self.blocks[0].up.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net(seed: int = 0, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def block_policy() -> Callable[..., bool]:
    from shardkit.wrap import transformer_auto_wrap_policy

    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def batch(rank: int, step: int, micro: int = 0, d_in: int = D_IN) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step + 31 * micro + 7)
    n = 3 + rank  # uneven on purpose
    return torch.randn(n, d_in, generator=g), torch.randn(n, D_OUT, generator=g)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


OPTIMIZERS = {"sgd_momentum": sgd, "adamw": adamw}

_DUT_GLOO: list[dist.ProcessGroup] = []


def dut_group(backend: str) -> dist.ProcessGroup | None:
    """The group shardkit FSDP runs on: None (the default shardkit group) or a second gloo group."""
    if backend == "shardkit":
        return None
    if not _DUT_GLOO:
        _DUT_GLOO.append(dist.new_group(backend="gloo"))
    return _DUT_GLOO[0]


class FsdpPair:
    """``self.ref``: torch DDP on gloo; ``self.dut``: shardkit FSDP (``fsdp_kwargs``), same module."""

    def __init__(self, module: nn.Module, make_optimizer: Callable[..., torch.optim.Optimizer] = sgd,
                 dut_backend: str = "shardkit", **fsdp_kwargs: Any) -> None:
        import shardkit

        ref_group = gloo_world()
        group = dut_group(dut_backend)
        self.ref = TorchDDP(copy.deepcopy(module), process_group=ref_group)
        if group is not None:
            fsdp_kwargs.setdefault("process_group", group)
        self.dut = shardkit.FullyShardedDataParallel(copy.deepcopy(module), **fsdp_kwargs)
        self.ref_opt = make_optimizer(self.ref.module.parameters())
        self.dut_opt = make_optimizer(self.dut.parameters())

    def check(self, where: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
        got = self.dut.state_dict()
        want = self.ref.module.state_dict()
        assert list(got) == list(want), f"{where}: state_dict keys differ: {list(got)} vs {list(want)}"
        for key, value in want.items():
            assert_close(got[key], value, f"{where}: {key}", rtol, atol)

    def losses(self, rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(rank, step, micro)
        return loss_fn(self.ref(x), y), loss_fn(self.dut(x), y)

    def step(self, rank: int, step: int, check: bool = True) -> tuple[float, float]:
        self.ref_opt.zero_grad()
        self.dut_opt.zero_grad()
        x, y = batch(rank, step)
        ref_loss = loss_fn(self.ref(x), y)
        ref_loss.backward()
        dut_loss = loss_fn(self.dut(x), y)
        dut_loss.backward()
        self.ref_opt.step()
        self.dut_opt.step()
        if check:
            self.check(f"rank {rank} step {step}")
        return float(ref_loss), float(dut_loss)


# --- checkpoint tests: one global batch per step, split over the ranks; the run that never stopped ------
GLOBAL_ROWS = 12  # one global batch per step, split evenly over 2, 3 or 4 ranks


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4242 + step)
    return torch.randn(GLOBAL_ROWS, 7, generator=g), torch.randn(GLOBAL_ROWS, 4, generator=g)


def train_global(model, optimizer, rank: int, world: int, steps: range) -> None:
    rows = GLOBAL_ROWS // world
    for step in steps:
        x, y = global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
        optimizer.step()


def reference_run() -> tuple[dict, dict, dict]:
    """The run that never stopped: one process, the global batch, the unsharded optimizer. Returns the final
    state dict (after 5 steps), and after 2 steps the optimizer state by parameter name and the state dict."""
    model = net(seed=0, depth=3, d_in=7)
    optimizer = adamw(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    after_two, params_after_two = {}, {}
    for step in range(5):
        x, y = global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if step == 1:
            after_two = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
            params_after_two = {k: v.clone() for k, v in model.state_dict().items()}
    return {k: v for k, v in model.state_dict().items()}, after_two, params_after_two

"""Models, data and the lock-step driver for the DDP parity tests (imported by the ranks too).

Every parity test wraps two deep copies of one module, one in torch's DistributedDataParallel on a **gloo**
group over all ranks (the oracle: no shardkit code on its path, so a backend bug cannot cancel out) and one
in shardkit's on the default ("shardkit") process group, gives each its own optimizer, feeds both the same
per-rank batch and compares gradients after every backward and parameters/buffers after every optimizer
step. The two wrappers take turns (torch's forward+backward, then shardkit's), so their
collectives never interleave and every rank issues them in the same order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

RTOL, ATOL = 1e-5, 1e-6  # fp32 parity
IN, OUT = 8, 4
LR = 0.05


def shardkit_ddp() -> type:
    """shardkit's wrapper; a missing one fails the test (AttributeError), it is never skipped."""
    import shardkit

    return shardkit.DistributedDataParallel


# --- models -------------------------------------------------------------------------------------------

def mlp(seed: int = 0) -> nn.Sequential:
    """1,476 parameters in three Linear layers (names "0.weight", "0.bias", "2.weight", ...)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, OUT))


def wide_mlp(seed: int = 0) -> nn.Sequential:
    """33,924 parameters, IN -> OUT like mlp(): buckets past the shm engine's small-message size (32 KiB), so a
    zero-copy bucket (gradient_as_bucket_view on a shardkit group) takes the in-place algorithm."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 160), nn.ReLU(), nn.Linear(160, 160), nn.ReLU(), nn.Linear(160, 40),
                         nn.ReLU(), nn.Linear(40, OUT))


def bn_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, OUT))


class TwoHeads(nn.Module):
    """A trunk and two heads; ``forward(x, use_b=False)`` leaves ``head_b`` out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, 16)
        self.head_a = nn.Linear(16, OUT)
        self.head_b = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def two_heads(seed: int = 0) -> TwoHeads:
    torch.manual_seed(seed)
    return TwoHeads()


# --- data ---------------------------------------------------------------------------------------------

def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for ``step`` (4 + rank rows: uneven on purpose); any rank can rebuild any other's."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step + 31 * micro + 17)
    n = 4 + rank
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # In f32 (a no-op for f32 outputs): torch 2.11 cannot backward mse_loss of a bf16 output against an f32 target
    # ("Found dtype Float but expected BFloat16"); 2.13 promotes.
    return F.mse_loss(out.float(), y)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"sgd_momentum": sgd, "adamw": adamw}


# --- comparison ---------------------------------------------------------------------------------------

def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(got.detach(), want.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_modules_match(want: nn.Module, got: nn.Module, where: str, *, grads: bool = False,
                         rtol: float = RTOL, atol: float = ATOL) -> None:
    """Parameters and buffers of ``got`` equal ``want``'s (and gradients, including which are None)."""
    want_p, got_p = dict(want.named_parameters()), dict(got.named_parameters())
    assert list(got_p) == list(want_p), f"{where}: parameter names differ: {list(got_p)} vs {list(want_p)}"
    for name, w in want_p.items():
        g = got_p[name]
        assert_close(g, w, f"{where}: parameter {name}", rtol, atol)
        if grads:
            assert (g.grad is None) == (w.grad is None), (
                f"{where}: {name}.grad is {'None' if g.grad is None else 'set'} in shardkit DDP "
                f"but {'None' if w.grad is None else 'set'} in torch DDP")
            if w.grad is not None:
                assert_close(g.grad, w.grad, f"{where}: {name}.grad", rtol, atol)
    want_b, got_b = dict(want.named_buffers()), dict(got.named_buffers())
    assert list(got_b) == list(want_b), f"{where}: buffer names differ"
    for name, w in want_b.items():
        assert_close(got_b[name], w, f"{where}: buffer {name}", rtol, atol)


def error_of(fn: Callable[[], Any], kind: type[BaseException], rank: int) -> str:
    """The message of the ``kind`` exception ``fn()`` raises; fails the rank if it raises nothing."""
    try:
        fn()
    except kind as e:
        return str(e)
    raise AssertionError(f"rank {rank}: {fn} did not raise {kind.__name__}")


# --- the lock-step driver -----------------------------------------------------------------------------

_GLOO_WORLD: list[dist.ProcessGroup] = []


def gloo_world() -> dist.ProcessGroup:
    """A gloo group over every rank, created once per process (new_group is a collective: every rank asks for
    it at the same point, the first Pair)."""
    if not _GLOO_WORLD:
        _GLOO_WORLD.append(dist.new_group(backend="gloo"))
    return _GLOO_WORLD[0]


class Pair:
    """One module wrapped twice: ``self.ref`` (torch DDP on gloo) and ``self.dut`` (shardkit DDP on the default
    shardkit group), same arguments."""

    def __init__(self, module: nn.Module, make_optimizer: Callable[..., torch.optim.Optimizer] = sgd,
                 **ddp_kwargs: Any) -> None:
        self.ref_group = gloo_world()
        self.dut_group = world_pg()
        self.ref = TorchDDP(copy.deepcopy(module), process_group=self.ref_group, **ddp_kwargs)
        self.dut = shardkit_ddp()(copy.deepcopy(module), **ddp_kwargs)
        self.ref_opt = make_optimizer(self.ref.module.parameters())
        self.dut_opt = make_optimizer(self.dut.module.parameters())

    def register_comm_hook(self, make_state: Callable[[dist.ProcessGroup], Any], hook: Callable,
                           ref_hook: Callable | None = None) -> tuple[Any, Any]:
        """The same hook on both (``ref_hook`` on torch's, if given), each with its own state:
        ``make_state(group)`` is called for torch's (its gloo group), then for shardkit's."""
        ref_state = make_state(self.ref_group)
        self.ref.register_comm_hook(ref_state, ref_hook or hook)
        dut_state = make_state(self.dut_group)
        self.dut.register_comm_hook(dut_state, hook)
        return ref_state, dut_state

    def check(self, where: str, *, grads: bool = False, rtol: float = RTOL, atol: float = ATOL) -> None:
        assert_modules_match(self.ref.module, self.dut.module, where, grads=grads, rtol=rtol, atol=atol)

    def backward(self, rank: int, step: int, micro: int = 0, **forward_kwargs: Any) -> None:
        """One forward+backward of rank ``rank``'s batch on each wrapper (torch's first)."""
        x, y = batch(rank, step, micro)
        for model in (self.ref, self.dut):
            loss_fn(model(x, **forward_kwargs), y).backward()

    def step(self, rank: int, step: int, *, rtol: float = RTOL, atol: float = ATOL, set_to_none: bool = True,
             **forward_kwargs: Any) -> None:
        """zero_grad, forward, backward (grads compared), optimizer step (parameters and buffers compared)."""
        self.ref_opt.zero_grad(set_to_none=set_to_none)
        self.dut_opt.zero_grad(set_to_none=set_to_none)
        self.backward(rank, step, **forward_kwargs)
        self.check(f"rank {rank} step {step} after backward", grads=True, rtol=rtol, atol=atol)
        self.ref_opt.step()
        self.dut_opt.step()
        self.check(f"rank {rank} step {step} after optimizer step", rtol=rtol, atol=atol)


def world_pg() -> dist.ProcessGroup:
    return dist.group.WORLD

"""``shardkit.Quantized``: block-quantized bytes between hosts (ZeRO++'s quantized weights and gradients), opt-in per
wrapper: ``fully_shard(block, comm=shardkit.Quantized())``, ``shardkit.DistributedDataParallel(model,
comm=shardkit.Quantized(grads="int8"))``.

What changes: only the bytes a collective sends from one host to another, and only floating data. An all-gather of
parameters (``weights``) and a sum of gradients (``grads``: reduce-scatter, allreduce) send records of ``block``
elements, each an f32 scale and one int8 (or int4) code per element, and decode them on arrival
(csrc/core/quantize.h: symmetric, round to nearest even). Bytes inside a host move exact. Every rank of a quantized
all-gather holds the same bits — the decoded values of every shard, its own host's too — so the replicas' forwards
agree; the sum's error is that of the partial sums each host sends (a host's own partial sum stays exact). A block
holding inf or NaN arrives as NaN, so a loss scaler still sees an overflow. The groups' leaders compare every op's
formats across hosts, so ranks that disagree fail, naming both.

Where it does nothing: on a group whose ranks share one host there are no inter-host bytes (a warning says so once).
Where it is refused, with an error naming the case: a backend other than shardkit's, CUDA tensors, HSDP's 2-D mesh,
DDP with ZeRO or a comm hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch.distributed as dist

from . import _C
from ._group_backend import cpu_backend
from ._topology import inter_host_scheme

_BITS = {None: 0, "int8": 8, "int4": 4}


@dataclasses.dataclass(frozen=True)
class Quantized:
    """The inter-host wire format of a wrapper's collectives (see the module docstring).

    ``weights``: parameters' all-gathers, ``"int8"``, ``"int4"`` or None (exact). ``grads``: gradients' reduce-scatters
    and allreduces, the same choices. ``block``: elements per scale, 8 to 2**20 (256: 1.6% of the int8 bytes are
    scales)."""

    weights: str | None = "int8"
    grads: str | None = "int8"
    block: int = 256

    def __post_init__(self) -> None:
        for field in ("weights", "grads"):
            value = getattr(self, field)
            if value not in _BITS:
                raise ValueError(f"shardkit.Quantized: {field}={value!r} is not a wire format; use 'int8', 'int4' "
                                 "or None (exact)")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not 8 <= self.block <= 1 << 20:
            raise ValueError(f"shardkit.Quantized: block={self.block!r} must be an int from 8 to {1 << 20}")

    def wire(self) -> _C.InterHostQuantization:
        """The formats as the backend takes them."""
        def format_of(name: str | None) -> _C.QuantFormat:
            return _C.QuantFormat(_BITS[name], self.block if name else 0)
        return _C.InterHostQuantization(format_of(self.weights), format_of(self.grads))


@contextlib.contextmanager
def inter_host_format(comm: Quantized | None) -> Iterator[None]:
    """The collectives this thread issues inside carry ``comm``'s formats (nothing changes for None). Scopes nest."""
    if comm is None:
        yield
        return
    outer = _C.exchange_current_quantization(comm.wire())
    try:
        yield
    finally:
        _C.exchange_current_quantization(outer)


def check_group(comm: Quantized | None, group: dist.ProcessGroup, who: str) -> None:
    """Refuses ``comm`` on a group whose backend is not shardkit's; warns where the group's ranks share one host
    (no byte crosses between hosts there, so nothing is quantized)."""
    if comm is None:
        return
    backend = cpu_backend(group)
    if not isinstance(backend, _C.ProcessGroupShardkit):
        name = dist.get_backend(group)
        raise ValueError(f"{who}: comm=shardkit.Quantized(...) quantizes the shardkit backend's inter-host bytes; "
                         f"this group's backend is {name!r}. Use dist.init_process_group('shardkit'), or drop comm")
    if inter_host_scheme(group) is None:
        warnings.warn(f"{who}: comm=shardkit.Quantized(...) has nothing to quantize here: the group's ranks share "
                      "one host, and bytes inside a host move exact", stacklevel=3)

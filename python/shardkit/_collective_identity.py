"""Where the backend does not compare a collective's identity, FSDP checks that every rank's collectives moved
the same units.

shardkit's backend compares it on every op of host tensors (csrc/core/collective_identity.h): the shared-memory
op header carries it to every rank of a host, and on the groups FSDP and DDP run on (compare_identities_across_
hosts) the host leaders compare a fingerprint before every op's inter-host steps; ranks that pair different units
fail at the first such pairing. Elsewhere — torch's gloo or
NCCL, or shardkit's NCCL route for CUDA tensors — a :class:`CollectiveLedger` per group records the (kind,
identity) of each collective FSDP issues on it, in issue order. At the end of each backward, before an optimizer
can step, the ranks exchange a 64-bit digest of that record and its length: one all-gather of 16 bytes per group
and backward. Where they differ, a second exchange of the records names the first collective that differs, on
every rank.

Ranks whose collectives differ in number (a unit one rank skips) may pair collectives of different sizes before
the end of backward, which such a backend may refuse or wait on until its timeout. Under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the ledger therefore checks each collective before it is issued (one small
all-gather each), so those fail at once too, as torch's own collective fingerprints do under DETAIL.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Iterator

import torch.distributed as dist

from . import _C, _exchange
from ._group_backend import cpu_backend

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = 1, 2, 3
_KIND_NAMES = {ALL_GATHER: "an all-gather", REDUCE_SCATTER: "a reduce-scatter", ALL_REDUCE: "an all-reduce"}


@contextlib.contextmanager
def collectives_for(description: str, detail: str = "") -> Iterator[int]:
    """``with collectives_for("FSDP unit 'blocks.3' (...)"):`` — the collectives this thread issues inside carry the
    identity of that part of the model (shardkit's backend compares it across ranks; see the module docstring).
    Only around code whose collectives are the same on every rank (not a call that may run a future's callbacks
    inline). Scopes nest, and must close in the order they opened (else this raises, and the thread's identity is
    left as the outer scope had it)."""
    identity = _C.identity_of(description, detail)
    outer = _C.exchange_current_identity(identity)
    try:
        yield identity
    finally:
        inner = _C.exchange_current_identity(outer)
        if inner != identity:
            raise RuntimeError(f"shardkit: collective identity scopes closed out of order: closing "
                               f"{_C.describe_identity(identity)} found {_C.describe_identity(inner)} current")


def compare_identities_across_hosts(group: dist.ProcessGroup | None) -> None:
    """Has ``group``'s shardkit backend compare every collective's identity across hosts from now on (csrc/comm/
    hierarchical_engine.h; inside a host it is compared always); nothing for another backend. Every rank of the group
    calls it at the same point among the group's collectives (FSDP and DDP do, at construction)."""
    backend = cpu_backend(group)
    if isinstance(backend, _C.ProcessGroupShardkit):
        backend.compare_identities_across_hosts()


def backend_checks_identity(group: dist.ProcessGroup, on_cpu: bool) -> bool:
    """Whether ``group``'s backend compares every collective's identity on every rank by itself: shardkit's, for
    host tensors."""
    return on_cpu and isinstance(cpu_backend(group), _C.ProcessGroupShardkit)


class CollectiveLedger:
    """The identified collectives issued on one group since the last check, in issue order (see module doc)."""

    def __init__(self, group: dist.ProcessGroup, role: str, who: str) -> None:
        self.group = group
        self.role = role  # "shard group", "replicate group": how messages name the group
        self.who = who  # "shardkit FSDP": how messages name the caller
        self.entries: list[tuple[int, int]] = []
        # torch's reading of TORCH_DISTRIBUTED_DEBUG (init_process_group sets it): DETAIL checks each collective.
        self.each = dist.get_debug_level() == dist.DebugLevel.DETAIL

    def record(self, kind: int, identity: int) -> None:
        """Before the collective is issued: under DETAIL it is checked at once (a collective), else at verify()."""
        self.entries.append((kind, identity))
        if self.each:
            self.verify()

    def digest(self) -> int:
        packed = b"".join(struct.pack("<BQ", kind, identity) for kind, identity in self.entries)
        return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1  # fits int64

    def verify(self) -> None:
        """A collective on the group: returns (with the record cleared) where every rank's record is the same;
        raises the same RuntimeError on every rank otherwise, naming the first collective that differs."""
        mine = [self.digest(), len(self.entries)]
        if all(theirs == mine for theirs in _exchange.all_gather_ints(mine, self.group)):
            self.entries.clear()
            return
        records = _exchange.all_gather_object(self.entries, self.group)
        self.entries.clear()
        raise RuntimeError(self._describe_difference(records))

    def _describe_difference(self, records: list[list[tuple[int, int]]]) -> str:
        ranks = [dist.get_global_rank(self.group, r) for r in range(len(records))]
        me = ranks[dist.get_rank(self.group)]
        first = next((i for i in range(max(map(len, records)))
                      if len({tuple(r[i]) if i < len(r) else None for r in records}) > 1), 0)

        def what(record: list[tuple[int, int]]) -> str:
            if first >= len(record):
                return "nothing (it issued fewer)"
            kind, identity = record[first]
            return f"{_KIND_NAMES.get(kind, f'collective kind {kind}')} of {_C.describe_identity(identity)}"

        told = "; ".join(f"rank {rank}: {what(record)}" for rank, record in zip(ranks, records))
        return (f"{self.who} (rank {me}): ranks ran different units' collectives on the {self.role}, which paired "
                f"them as if they were the same: collective {first + 1} since the last check was {told} (this is "
                "checked at the end of each backward, before an optimizer can step; every unit must run on every "
                "rank in the same order)")

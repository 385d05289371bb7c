"""Zero-copy memory that is resident only while it is used: the shared memory (``shardkit.backend.shared_buffer``)
in which shardkit FSDP (FSDP1 front) and ``shardkit.fully_shard`` make the gradients a reduce-scatter reads in
place.

Such memory is as large as the largest unit's reduce-scatter input, but that size is needed once per iteration
(often the root's, which holds the embedding); every other unit fits in the second-largest size. So only
``kept`` bytes stay allocated between uses; the rest goes back to /dev/shm after the use that needed it and is
allocated again at the next — when the copying path would allocate that memory too — instead of being held
through forward. Allocating shared pages can fail (/dev/shm full), so it is done up front with an error instead
of a SIGBUS (``_C.reserve_shared_pages``, Linux >= 5.14; on older kernels the memory simply stays whole), and the
ranks of the group agree on the outcome (one MIN allreduce): where one rank has no room, every rank takes
ordinary memory for that use, with the same results.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C

# Less than this past ``kept`` is not worth the page faults and an allreduce per iteration: it stays.
GIVE_BACK_MIN_BYTES = 256 << 10


class ResidentSharedMemory:
    """``memory`` (a uint8 tensor of shared memory, every page allocated), of which ``kept`` bytes stay allocated
    between uses (``set_kept``). ``ensure(needed)`` before a use of the first ``needed`` bytes, ``release()``
    after it.

    Whether a call communicates must be the same on every rank, so it depends only on what every rank knows
    alike: ``resident`` is the bytes the protocol has made resident (a failed release leaves more pages than
    that, which is harmless; reserving pages that are there is a no-op), and whether pages can be given back at
    all is agreed once, here. Constructing it is a collective on ``group``."""

    def __init__(self, memory: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.memory = memory
        self.group = group
        self.resident = memory.numel()  # bytes made resident, as every rank counts them: all, from the start
        # Whether pages can be allocated with an error instead of SIGBUS on every rank (else it stays whole).
        mine = _C.reserve_shared_pages(memory, 0, min(memory.numel(), 1)) is None
        everyone = torch.tensor([1 if mine else 0], dtype=torch.int32)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
        self.can_give_back = bool(everyone.item())
        self.kept = memory.numel()

    def set_kept(self, kept: int) -> None:
        """Keep ``kept`` bytes between uses (all of it where less than GIVE_BACK_MIN_BYTES would go, or pages cannot
        be given back safely)."""
        whole = self.memory.numel()
        self.kept = whole if not self.can_give_back or whole - kept < GIVE_BACK_MIN_BYTES else kept

    def ensure(self, needed: int) -> str | None:
        """Makes the first ``needed`` bytes resident; None where every rank of the group has them, else why not
        (this rank's reason, or that another rank's failed), with the pages this rank got given back. A collective
        on the group where ``needed`` exceeds ``resident`` (the same on every rank), else no communication."""
        if needed <= self.resident:
            return None
        why = _C.reserve_shared_pages(self.memory, self.resident, needed - self.resident)
        everyone_has_it = torch.tensor([0 if why else 1], dtype=torch.int32)
        dist.all_reduce(everyone_has_it, op=dist.ReduceOp.MIN, group=self.group)
        if everyone_has_it.item():
            self.resident = max(self.resident, needed)
            return None
        self.release(whatever_is_resident=True)
        return why or "another rank of the shard group has no room in /dev/shm"

    def release(self, whatever_is_resident: bool = False) -> None:
        """Gives the memory past ``kept`` back to /dev/shm (no use reads it any more); ``whatever_is_resident``: also
        pages a failed reservation may have left allocated."""
        if self.resident > self.kept or whatever_is_resident:
            _C.release_shared_pages(self.memory, self.kept, self.memory.numel() - self.kept)
            self.resident = min(self.resident, self.kept)  # as counted; pages a failed release left are harmless

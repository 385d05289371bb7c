"""Data positions that resume exactly, at any world size: ``ResumableSampler`` and the ``DataLoader`` that tells it
what training consumed.

``ResumableSampler`` is a ``torch.utils.data.DistributedSampler`` whose order is one global sequence per epoch
(``randperm(len(dataset))`` seeded with ``seed + epoch``, or ``0..N-1`` unshuffled), independent of the world
size; its position is the *global offset* into that sequence: every sample before it has been consumed by some
rank. Each pass deals what remains from the offset to the ranks in turn (rank r takes offsets
``offset + r``, ``offset + r + world``, ...), padded by repeating from the remainder's start (or, with
``drop_last``, cut) to a multiple of the world size, as DistributedSampler pads. After every rank consumed c
samples the offset has moved by ``c * world``, so ``state_dict() == {"epoch", "offset", ...}`` resumes at any
world size without repeating or skipping a sample (the union over the ranks of what they see before and after is
the epoch, exactly, wherever no padding was needed).

What "consumed" means: a DataLoader with ``num_workers > 0`` pulls indices from its sampler ahead of the batches
the loop has received (``prefetch_factor * num_workers`` batches), so the sampler's own count of the indices it
handed out runs ahead of training. ``shardkit.data.DataLoader`` (torch's, plus this one thing) reports each
batch as the loop receives it, and the sampler's position counts those batches; driven by torch's own DataLoader
(which pulls a batch's indices only when the loop asks for it when ``num_workers=0``) or iterated directly, the
sampler counts the indices it handed out. Epochs: call ``set_epoch(e)`` at each epoch's start, as with
DistributedSampler; an epoch consumed to its end is saved as the next epoch's start, so a resumed loop runs
``for epoch in range(sampler.epoch, epochs)``. A second pass in the same epoch without ``set_epoch`` (the epoch
consumed) starts the same order again, as DistributedSampler does.

Every rank must consume the same number of batches between saves (synchronous data-parallel training does): the
offset is global, one value saved once (identical keys on every rank are one entry in a DCP checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler
from torch.utils.data import DataLoader as _TorchDataLoader

__all__ = ["DataLoader", "ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose ``state_dict()`` (epoch and global offset) resumes exactly at any world size;
    see the module docstring. Arguments as DistributedSampler's (``num_replicas``/``rank`` default to the
    default process group's)."""

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._size = len(dataset)  # type: ignore[arg-type]
        self._base = 0         # the global offset the current pass started from
        self._take = 0         # indices per rank in the current pass
        self._count = 0        # indices this rank has consumed in the current pass
        self._started = False  # a pass has begun (its first index was asked for)
        self._reported = False  # a shardkit.data.DataLoader counts the consumed batches (not the handed-out indices)

    # --- the order ---------------------------------------------------------------------------------------------
    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self._size, generator=g).tolist()
        return list(range(self._size))

    def _pass_length(self, base: int) -> int:
        remaining = self._size - base
        if self.drop_last:
            return remaining // self.num_replicas
        return -(-remaining // self.num_replicas)

    def __len__(self) -> int:
        return self._take if self._started else self._pass_length(self._start_of_next_pass())

    def _start_of_next_pass(self) -> int:
        position = self.position
        return 0 if position >= self._size else position

    def __iter__(self) -> Iterator[int]:
        base = self._start_of_next_pass()
        take = self._pass_length(base)
        self._base, self._take, self._count, self._started = base, take, 0, True
        return self._deal(base, take)

    def _deal(self, base: int, take: int) -> Iterator[int]:
        remaining = self._order()[base:]
        total = take * self.num_replicas
        if remaining and len(remaining) < total:  # pad as DistributedSampler does: repeat from the start
            remaining = (remaining * -(-total // len(remaining)))[:total]
        for i, index in enumerate(remaining[self.rank:total:self.num_replicas]):
            if not self._reported:
                self._count = i + 1
            yield index

    # --- the position ------------------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The global offset into this epoch's order that every rank has consumed up to (see the module
        docstring); ``len(dataset)`` once the pass is consumed to its end."""
        if not self._started:
            return self._base
        if self._count >= self._take:
            return self._size
        return min(self._size, self._base + self._count * self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler's; a new epoch starts at offset 0, the same epoch keeps its position."""
        if epoch != self.epoch:
            self._base, self._take, self._count, self._started = 0, 0, 0, False
        super().set_epoch(epoch)

    def _consumed_batches(self, batches: int, batch_size: int) -> None:
        """shardkit.data.DataLoader: the loop has received ``batches`` batches of this pass."""
        self._count = min(self._take, batches * batch_size)

    def state_dict(self) -> dict[str, Any]:
        position = self.position
        epoch, offset = (self.epoch + 1, 0) if position >= self._size else (self.epoch, position)
        return {"epoch": epoch, "offset": offset, "dataset_size": self._size, "seed": self.seed,
                "shuffle": bool(self.shuffle)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at ``state``'s epoch and offset; raises ValueError, naming the values, where the dataset's size,
        the seed or shuffle differ (the order would not be the one the offset counts into)."""
        mine = {"dataset_size": self._size, "seed": self.seed, "shuffle": bool(self.shuffle)}
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            told = ", ".join(f"{k} {saved!r} saved but {now!r} here" for k, (saved, now) in differ.items())
            raise ValueError(f"shardkit.data.ResumableSampler.load_state_dict (rank {self.rank}): {told}: the saved "
                             "offset counts into another order")
        offset = int(state["offset"])
        if not 0 <= offset <= self._size:
            raise ValueError(f"shardkit.data.ResumableSampler.load_state_dict (rank {self.rank}): offset {offset} "
                             f"is outside the dataset of {self._size} samples")
        self.epoch = int(state["epoch"])
        self._base, self._take, self._count, self._started = offset, 0, 0, False


class DataLoader(_TorchDataLoader):
    """torch's DataLoader, which also tells a ResumableSampler (its ``sampler``, or its BatchSampler's) each batch
    the loop receives, so the sampler's position is what training consumed however far the workers prefetch
    (see the module docstring). Any other sampler: torch's DataLoader unchanged."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        resumable, batch_size = self._resumable()
        if resumable is None:
            return super().__iter__()
        resumable._reported = True  # before the workers' first prefetch pulls indices
        return self._counted(super().__iter__(), resumable, batch_size)

    def _resumable(self) -> tuple[ResumableSampler | None, int]:
        batch_sampler = self.batch_sampler
        sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else self.sampler
        if not isinstance(sampler, ResumableSampler):
            return None, 0
        if not isinstance(batch_sampler, BatchSampler):
            raise NotImplementedError(
                "shardkit.data.DataLoader: a ResumableSampler counts consumed batches of a torch BatchSampler; "
                f"batch_sampler {type(batch_sampler).__name__} is not one (pass batch_size= instead)")
        return sampler, batch_sampler.batch_size

    @staticmethod
    def _counted(iterator: Iterator[Any], sampler: ResumableSampler, batch_size: int) -> Iterator[Any]:
        try:
            for received, batch in enumerate(iterator, start=1):
                sampler._consumed_batches(received, batch_size)
                yield batch
        finally:
            sampler._reported = False

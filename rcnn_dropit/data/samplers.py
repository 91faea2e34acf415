"""Batch sampling: aspect-ratio grouped training batches that can resume mid-epoch, and
exact validation sharding."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

from rcnn_dropit.errors import UsageError


def aspect_ratio_groups(sizes: Sequence[tuple[int, int]], factor: int) -> list[int]:
    """Group id per image from its (width, height): log2(w/h) cut into bins of 1/factor octave.

    Ratios between 1/2 and 2 get ``2 * factor`` bins, flatter or taller images one bin each side;
    ``factor < 0`` puts every image in group 0 (no grouping).
    """
    if factor < 0:
        return [0] * len(sizes)
    groups = []
    for w, h in sizes:
        if w <= 0 or h <= 0:
            raise UsageError(f"image size {w}x{h} is not positive")
        q = math.floor((math.log2(w / h) + 1.0) * factor)
        groups.append(min(max(q, -1), 2 * factor))
    return groups


class GroupedBatchSampler(Sampler[list]):
    """Batches whose images share an aspect-ratio group, drawn from an index sampler.

    Indices are taken in the inner sampler's order; a batch is emitted once its group has
    ``batch_size`` members. What is left at the end of an epoch is sorted by group and cut into
    batches too, so every index the inner sampler yields appears exactly once, and every rank of a
    DistributedSampler gets ``ceil(len(sampler) / batch_size)`` batches (DDP needs equal counts).

    ``set_epoch`` forwards to the inner sampler. ``set_start_batch(k)`` makes the next pass skip
    the epoch's first ``k`` batches (resuming after ``k`` iterations of that epoch); it resets to 0
    once that pass starts. ``len()`` is always the full epoch's batch count.
    With ``emit_epoch`` each index is yielded as ``(index, epoch)`` so that the dataset can key
    its augmentation on the epoch.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        group_ids: Sequence[int],
        batch_size: int,
        emit_epoch: bool = False,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"solver.batch_size: {batch_size} must be >= 1")
        self.sampler = sampler
        self.group_ids = list(group_ids)
        self.batch_size = batch_size
        self.emit_epoch = emit_epoch
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle (forwarded to the inner sampler)."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def set_start_batch(self, k: int) -> None:
        """Skip the first ``k`` batches of the next pass over the current epoch."""
        if not 0 <= k <= len(self):
            raise ValueError(f"start batch {k} is outside 0..{len(self)} (batches per epoch)")
        self.start_batch = k

    def epoch_batches(self) -> list[list[int]]:
        """All batches of the current epoch, as index lists (deterministic given the sampler)."""
        pending: dict[int, list[int]] = {}
        batches = []
        for idx in self.sampler:
            group = pending.setdefault(self.group_ids[idx], [])
            group.append(idx)
            if len(group) == self.batch_size:
                batches.append(group.copy())
                group.clear()
        rest = [i for g in sorted(pending) for i in pending[g]]
        batches += [rest[i : i + self.batch_size] for i in range(0, len(rest), self.batch_size)]
        return batches

    def __iter__(self) -> Iterator[list]:
        start, self.start_batch = self.start_batch, 0
        for batch in self.epoch_batches()[start:]:
            yield [(i, self.epoch) for i in batch] if self.emit_epoch else batch

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """This rank's share of ``range(n)``: strided, no padding, every index on exactly one rank."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    return list(range(rank, n, world_size))


class ShardSampler(Sampler[int]):
    """Sequential sampler over one rank's shard (see ``shard_indices``)."""

    def __init__(self, n: int, rank: int = 0, world_size: int = 1) -> None:
        self.indices = shard_indices(n, rank, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

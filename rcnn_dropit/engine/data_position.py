"""Positioning the training loader at (epoch, batch) so that resumed runs see the same data."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from rcnn_dropit.rng import rng_preserved


def epoch_batches(loader, epoch: int, skip: int = 0) -> Iterator:
    """Iterator over epoch `epoch` (0-based) of `loader`, starting after its first `skip` batches.

    The sampler skips the batches itself when it can (``set_start_batch``), so no data is loaded
    for them. Creating a DataLoader iterator draws worker seeds from the global torch generator;
    that happens under a forked RNG so that training randomness does not depend on how many
    times an iterator was created (fresh run vs. resumed run).
    """
    batch_sampler = loader.batch_sampler
    for holder in (batch_sampler, getattr(loader, "sampler", None)):
        if holder is not None and hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)
            break
    native_skip = skip > 0 and hasattr(batch_sampler, "set_start_batch")
    if native_skip:
        batch_sampler.set_start_batch(skip)
    with rng_preserved():
        iterator = iter(loader)
        if skip > 0 and not native_skip:
            # Fallback for samplers that cannot skip: load and drop (slower, same order).
            for _ in itertools.islice(iterator, skip):
                pass
    return iterator

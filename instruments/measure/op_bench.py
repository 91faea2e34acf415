"""What each stage of an element-wise DropIT pack and rebuild costs, on one slice (a benchmark).

Used by ``tools/bench.py ops``. A whole training step says how much DropIT adds; this says
where: one slice of ``n`` values (the ops work in slices of 4Mi), split into the passes that
``threshold`` and ``mink`` make in the forward (|x| and compare, bit packing, compaction) and in the
backward (positions, gather), and the ReLU's mask. Times are medians in milliseconds, with
the plain ops a training step runs anyway (a copy, a ReLU) as the yardstick.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from dropit_core.formats import (
    bit_positions,
    compact_bits,
    pack_bits,
    scatter_kept,
    zero_flagged,
)
from instruments.measure.allocator import training_allocator
from instruments.measure.timing import timed_rounds
from rcnn_dropit.errors import UsageError

SLICE = 1 << 22
GAMMA = 0.8  # the threshold strategy's fraction dropped


def op_costs(n: int = SLICE, repeats: int = 15, device: str = "cpu") -> list[dict[str, Any]]:
    """One row per stage: ``{"op", "stage", "ms", "per_copy"}`` (time over a plain copy's)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(dev)
    relu_out = torch.relu(x)
    a = x.abs()
    t = torch.quantile(a[:: max(1, n // 65536)], GAMMA)  # the threshold strategy's estimate
    mask = a >= t
    bits = pack_bits(mask)
    kept = x[mask]
    count = kept.numel()
    blocked = pack_bits(relu_out <= 0)
    stages = [
        ("copy (yardstick)", "-", lambda: x.clone()),
        ("relu (yardstick)", "-", lambda: torch.relu(x)),
        ("abs and compare", "forward", lambda: x.abs() >= t),
        ("pack_bits", "forward", lambda: pack_bits(mask)),
        ("compact from bits (the pack's)", "forward", lambda: compact_bits(x, bits)),
        ("compact x[mask] (reference)", "forward", lambda: x[mask]),
        ("nonzero (inside x[mask])", "forward", lambda: torch.nonzero(mask)),
        ("relu mask bits", "forward", lambda: pack_bits(relu_out <= 0)),
        ("bit_positions", "backward", lambda: bit_positions(bits, n, 0, total=count)),
        ("scatter_kept (rebuild)", "backward", lambda: scatter_kept(bits, kept, n, n)),
        ("relu backward (zero_flagged)", "backward", lambda: zero_flagged(x, blocked)),
    ]
    with training_allocator(dev):
        # In rounds, one call of each pass per round: no pass finds its input in the cache where
        # a call of itself left it, as in a training step.
        times = timed_rounds([fn for *_, fn in stages], repeats, dev)
    rows = [
        {"op": op, "stage": stage, "ms": statistics.median(t) * 1e3}
        for (op, stage, _), t in zip(stages, times, strict=True)
    ]
    copy_ms = rows[0]["ms"]
    for row in rows:
        row.update(
            elements=n,
            gamma=GAMMA,
            device=str(dev),
            threads=torch.get_num_threads(),
            per_copy=round(row["ms"] / copy_ms, 2) if copy_ms > 0 else None,
            ms=round(row["ms"], 3),
        )
    return rows

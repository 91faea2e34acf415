"""Wall-clock timing of steps: CUDA synchronised around each call, and rounds that alternate
between the functions compared so that drifts in machine load hit all of them alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import torch


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, float]:
    """Run ``fn`` and return (result, seconds), synchronising CUDA around it."""
    sync = device is not None and device.type == "cuda"
    if sync:
        torch.cuda.synchronize(device)
    start = perf_counter()
    result = fn()
    if sync:
        torch.cuda.synchronize(device)
    return result, perf_counter() - start


def timed_rounds(
    fns: Sequence[Callable[[], Any]],
    repeats: int,
    device: torch.device | None = None,
    warmup: int = 1,
    before: Sequence[Callable[[], Any] | None] | None = None,
) -> list[list[float]]:
    """Seconds of each of ``fns`` over ``repeats`` rounds of one call each, after ``warmup``
    untimed rounds: drifts in machine load hit every function alike, so ratios of their medians
    are fair. ``before``: per function, an untimed call made before each of its calls (or None)."""
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(warmup + repeats):
        for i, fn in enumerate(fns):
            if before is not None and before[i] is not None:
                before[i]()
            seconds = timed(fn, device)[1]
            if round_ >= warmup:
                times[i].append(seconds)
    return times

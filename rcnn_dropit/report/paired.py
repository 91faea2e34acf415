"""Statistics over seeds: mean and spread, and seed-paired differences with a 95% interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t by degrees of freedom (a table: no SciPy needed).
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


def t95(df: int) -> float:
    """Student-t 95% quantile; between table rows the smaller df is used (a wider interval)."""
    if df < 1:
        raise ValueError(f"df: {df} must be >= 1")
    if df > 30:
        return 1.96
    return _T95[max(d for d in _T95 if d <= df)]


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation of n values (std None for n < 2)."""

    n: int
    mean: float
    std: float | None


def spread(values: Sequence[float]) -> Spread | None:
    """Mean and spread of the values, None when there are none."""
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    return Spread(len(values), statistics.fmean(values), std)


@dataclass(frozen=True)
class PairedDiff:
    """Mean of per-seed differences with its 95% t-interval (None with a single pair)."""

    n: int
    mean: float
    low: float | None
    high: float | None


def paired_diff(values: Mapping[int, float], base: Mapping[int, float]) -> PairedDiff | None:
    """values[seed] - base[seed] over the seeds both have; None when they share none."""
    diffs = [values[s] - base[s] for s in sorted(values) if s in base]
    if not diffs:
        return None
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return PairedDiff(1, mean, None, None)
    half = t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return PairedDiff(len(diffs), mean, mean - half, mean + half)

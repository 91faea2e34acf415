"""A study's runs by regime, setting and seed, and the figures that pair a setting with its
baseline seed by seed: AP values, paired differences, saved-activation ratios.

A setting pairs with ``baseline``, except one named ``<name>_<suffix>`` where a reference
setting ``baseline_<suffix>`` exists (``mink_0.8_2x`` pairs with ``baseline_2x``): a longer
schedule is compared with the baseline trained on the same schedule, never with the 1x one.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from rcnn_dropit.report.paired import PairedDiff, paired_diff, spread
from rcnn_dropit.report.runs import Run

BASELINE = "baseline"

# seed -> run, for one setting of one regime
Seeds = Mapping[int, Run]
# setting -> seed -> run, for one regime
Regime = Mapping[str, Seeds]
# regime -> setting -> seed -> run
Found = Mapping[str, Regime]


def is_reference(setting: str) -> bool:
    """Whether a setting is a baseline other settings are compared with."""
    return setting == BASELINE or setting.startswith(BASELINE + "_")


def baseline_of(setting: str, settings: Iterable[str]) -> str | None:
    """The reference setting ``setting`` pairs with (None for a reference itself).

    ``settings`` are the names known (the plan's and those on disk); the longest matching
    ``baseline_<suffix>`` wins, and ``baseline`` when none matches.
    """
    if is_reference(setting):
        return None
    suffixes = sorted(
        (s[len(BASELINE) :] for s in settings if s.startswith(BASELINE + "_")),
        key=len,
        reverse=True,
    )
    for suffix in suffixes:
        if setting.endswith(suffix):
            return BASELINE + suffix
    return BASELINE


def baseline_runs(found: Regime, setting: str) -> Seeds:
    """The runs of the reference ``setting`` pairs with among ``found`` (empty when none)."""
    return found.get(baseline_of(setting, found) or "", {})


def ap_values(runs: Seeds, family: str) -> dict[int, float]:
    """seed -> AP x100 (family 'bbox' or 'segm') of the runs that have one."""
    return {s: v * 100 for s, run in runs.items() if (v := run.metric(family, "AP")) is not None}


def ap_text(runs: Seeds, family: str, with_std: bool = True) -> str | None:
    """``82.6 ± 0.3``: the mean AP over seeds and its std (none of one seed); None without AP."""
    s = spread(list(ap_values(runs, family).values()))
    if s is None:
        return None
    return f"{s.mean:.1f}" + (f" ± {s.std:.1f}" if with_std and s.std is not None else "")


def paired(runs: Seeds, base: Seeds, family: str) -> PairedDiff | None:
    """Mean of per-seed (run - baseline) AP differences with its 95% interval; None unpaired."""
    return paired_diff(ap_values(runs, family), ap_values(base, family))


def seed_diffs(runs: Seeds, base: Seeds, family: str) -> dict[int, float]:
    """seed -> (run - baseline) AP x100, over the seeds both have."""
    mine, ref = ap_values(runs, family), ap_values(base, family)
    return {s: mine[s] - ref[s] for s in sorted(mine) if s in ref}


def saved_ratio(runs: Seeds, base: Seeds) -> float | None:
    """Mean over seeds of (saved activations / the same seed's baseline's); None unpaired."""
    ratios = [
        runs[s].saved_mb / base[s].saved_mb
        for s in sorted(runs)
        if s in base and runs[s].saved_mb and base[s].saved_mb
    ]
    return statistics.fmean(ratios) if ratios else None


def paired_text(d: PairedDiff) -> str:
    """``-2.0 [-3.5, -0.4]``, or ``-2.7`` for a single pair."""
    if d.low is None or d.high is None:
        return f"{d.mean:+.1f}"
    return f"{d.mean:+.1f} [{d.low:+.1f}, {d.high:+.1f}]"

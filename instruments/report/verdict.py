"""The study's verdict, read from paired 95% intervals, not from means.

Per family (box, mask), a setting's paired difference to its baseline is in one state:

- keeps: the interval lies inside [-TOL, +TOL];
- loses: the interval lies entirely below -TOL;
- gains: the interval lies entirely above +TOL;
- inconclusive: the interval crosses -TOL or +TOL (noted "below 0" or "above 0" when it
  excludes 0 all the same: a difference whose size the seeds cannot place against TOL; noted
  "no loss beyond TOL" when only its upper end passes +TOL: a loss larger than TOL is ruled
  out, a gain larger than TOL is not);
- 1 seed: no interval (the single difference is shown, nothing is concluded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from instruments.report.seeded import Regime, Seeds, baseline_of, paired, paired_text
from rcnn_dropit.report.paired import PairedDiff

TOLERANCE = 1.0  # AP points: "keeps AP" means the interval lies within this of the baseline
# AP points: a schedule has converged when its last quarter gains less than this
CONVERGED_GAIN = 0.5
KEEPS, LOSES, GAINS, INCONCLUSIVE = "keeps", "loses", "gains", "inconclusive"
ONE_SEED = "1 seed: no interval"
NO_LOSS = f"{INCONCLUSIVE}, no loss beyond"  # + the tolerance
FAMILIES = (("bbox", "box"), ("segm", "mask"))


def family_state(d: PairedDiff, tolerance: float = TOLERANCE) -> str:
    """The state of one paired difference (see the module docstring)."""
    if d.low is None or d.high is None:
        return ONE_SEED
    if -tolerance <= d.low and d.high <= tolerance:
        return KEEPS
    if d.high < -tolerance:
        return LOSES
    if d.low > tolerance:
        return GAINS
    if d.high < 0:
        return f"{INCONCLUSIVE}, below 0"
    if d.low > 0:
        return f"{INCONCLUSIVE}, above 0"
    if d.low >= -tolerance:
        return f"{NO_LOSS} {tolerance:g}"
    return INCONCLUSIVE


def rules_out_loss(state: str) -> bool:
    """Whether a state excludes a loss larger than the tolerance: keeps, gains, or an
    inconclusive interval whose lower end is above 0 or above -TOL."""
    return state in (KEEPS, GAINS, f"{INCONCLUSIVE}, above 0") or state.startswith(NO_LOSS)


def setting_verdict(states: Sequence[str]) -> str:
    """One word for a setting from its box and mask states."""
    if any(s == ONE_SEED for s in states):
        return ONE_SEED
    if LOSES in states:
        return "loses AP"
    if all(s == KEEPS for s in states):
        return "keeps AP"
    if all(s in (KEEPS, GAINS) for s in states):
        return "keeps or gains AP"
    if all(rules_out_loss(s) for s in states):
        return f"no loss beyond {TOLERANCE:g} AP"
    return INCONCLUSIVE


def family_diffs(mine: Seeds, base: Seeds) -> list[tuple[PairedDiff, str] | None]:
    """Per family (box, then mask): the paired difference and its state, None without a pair."""
    diffs = [paired(mine, base, family) if mine and base else None for family, _ in FAMILIES]
    return [None if d is None else (d, family_state(d)) for d in diffs]


def verdict_table(
    runs: Regime, settings: Sequence[str], planned: Callable[[str], int]
) -> list[str]:
    """A Markdown table: per setting, seeds, paired Δ and state for box and mask, verdict.

    ``runs`` are one regime's (setting -> seed -> run); ``settings`` its settings in report
    order (baselines are left out); ``planned(setting)`` is how many seeds the plan trains of it.
    """
    lines = [
        "| setting | seeds paired | Δ box [95% CI] | box | Δ mask [95% CI] | mask | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in settings:
        ref = baseline_of(setting, [*settings, *runs])
        if ref is None:
            continue
        mine, base = runs.get(setting, {}), runs.get(ref, {})
        n, plan = len(set(mine) & set(base)), planned(setting)
        of = f"{n} of {plan}" if plan else str(n)
        diffs = family_diffs(mine, base)
        states = [f[1] for f in diffs if f is not None]
        cells = [f"{paired_text(f[0])} | **{f[1]}**" if f else "- | -" for f in diffs]
        if not mine:
            answer = "not measured yet"
        elif not base or not states:
            answer = f"no {ref} run paired by seed"
        else:
            answer = setting_verdict(states)
            if n < plan:
                answer += (
                    f" ({plan} planned)"
                    if answer == ONE_SEED
                    else f" (provisional: {n} of {plan} seeds)"
                )
        lines.append(f"| {setting} | {of} | {' | '.join(cells)} | {answer} |")
    return lines

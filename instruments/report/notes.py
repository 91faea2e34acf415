"""The study's written findings as a template: every figure they cite is read from the runs.

A notes template is Markdown with placeholders ``{{function argument ...}}``; the study report
renders it, so a number in the prose comes from the same run directories as the tables and
cannot drift from them. A target is ``regime/setting`` (all its seeds), ``regime/setting_sN``
(one run) or ``regime/setting_sA-B`` (seeds A to B, each finished: what a setting showed before
more seeds were added); a family is ``box`` or ``mask``. Δ pairs a setting with its baseline
seed by seed (``instruments.report.seeded.baseline_of``: ``baseline``, or ``baseline_2x`` for
``*_2x``).

=========================  ==================================================  ===================
placeholder                renders                                             example
=========================  ==================================================  ===================
ap TARGET FAMILY           AP mean ± std over seeds, or one run's AP           ``82.6 ± 0.3``
mean TARGET FAMILY         AP mean over seeds                                  ``82.6``
d TARGET FAMILY            paired Δ, with its 95% interval from 2 seeds on     ``-2.0 [-3.5, -0.4]``
dmean TARGET FAMILY        paired Δ, the mean only                             ``-2.0``
dlow TARGET FAMILY         the lower end of the paired Δ's 95% interval        ``-3.5``
dhigh TARGET FAMILY        the upper end of the paired Δ's 95% interval        ``-0.4``
dseeds TARGET FAMILY       the per-seed Δ, in seed order                       ``-2.7, -1.7, -1.6``
dsd TARGET FAMILY          standard deviation over seeds of the per-seed Δ     ``0.6``
dmax TARGET FAMILY         the largest per-seed Δ in magnitude, unsigned       ``0.9``
dhalf TARGET FAMILY N      half-width of a 95% interval at N seeds with the    ``0.9``
                           spread of TARGET's per-seed Δ
nbelow TARGET FAMILY       seeds whose Δ is below zero, of those paired        ``3 of 3``
dtrain TARGET FAMILY       mean paired Δ at every iteration both evaluated     ``-8.5, -3.6, -2.2``
apat TARGET FAMILY ITER    AP mean over seeds at one evaluated iteration       ``82.7``
gain TARGET FAMILY A B     AP gained from iteration A to B, mean over seeds    ``+0.6 [-1.3, +2.5]``
                           with its 95% interval (each seed against itself)
gainseeds TARGET FAMILY    the per-seed gain from iteration A to B             ``+0.5, +1.7, -0.2``
  A B
converged TARGET FAMILY    whether the gain from A to B is below the study's   ``not shown``
  A B                      convergence bound, read from its interval
state TARGET FAMILY        the verdict table's state of the paired Δ           ``inconclusive``
meets TARGET FAMILY        whether the paired interval's lower end is at or    ``misses``
                           above minus the verdict's tolerance (AP kept)
margin TARGET FAMILY       how far that lower end lies above (+) or below (-)  ``+0.002``
                           minus the tolerance, to 3 decimals: a close call
vs TARGET OTHER FAMILY     paired Δ of TARGET against OTHER (any two)          ``-1.1``
saved TARGET               saved activations / the baseline's, mean per seed   ``0.55x``
n TARGET                   seeds paired with the baseline                      ``3``
seeds TARGET               the seeds that finished                             ``1, 2, 3``
seedlist REGIME            every setting of a regime with its finished seeds   ``baseline 1, 2;
                                                                               mink_0.8 1``
grad NAME STATE SET GROUP  a cosine (``cos``) or norm ratio (``norm``) of       ``0.97``
  MEASURE                  ``shapes_grad_groups/NAME.json``; spaces as ``_``
bench SETTING KEY          a ratio of ``cpu_methods/methods.json`` (R50-FPN)   ``0.61x``
step SETTING               its step ratio there, or in the newest timed table  ``1.19x (timed
                           (its workload and date said)                        on ...)``
same RUN OTHER             whether two runs (``regime/setting_sN``) logged     ``identical: ...``
                           the same losses and AP to the last bit
=========================  ==================================================  ===================
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from instruments.measure.methods_table import methods_by_setting
from instruments.report.goal import BENCH_FILE
from instruments.report.seeded import (
    Found,
    Seeds,
    ap_text,
    baseline_of,
    paired,
    paired_text,
    saved_ratio,
    seed_diffs,
)
from instruments.report.verdict import (
    CONVERGED_GAIN,
    FAMILIES,
    ONE_SEED,
    TOLERANCE,
    family_state,
    rules_out_loss,
)
from rcnn_dropit.errors import UsageError
from rcnn_dropit.report.paired import PairedDiff, paired_diff, t95
from rcnn_dropit.report.runs import Run

PLACEHOLDER = re.compile(r"\{\{([^{}]*)\}\}")
_SEEDED = re.compile(r"(?P<setting>.+)_s(?P<first>\d+)(?:-(?P<last>\d+))?")
GRAD_MEASURES = {"cos": "cosine", "norm": "norm_ratio"}
FAMILY_OF_WORD = {word: family for family, word in FAMILIES}  # "box" -> "bbox"


def grad_groups_file(results: Path, name: str) -> Path:
    """tools/grad_groups.py's table ``name`` (a regime, or a sweep's name) under ``results``."""
    return results / "shapes_grad_groups" / f"{name}.json"


class NotesError(UsageError):
    """A placeholder that names no function, regime, setting, seed, family or evaluation."""


@dataclass(frozen=True)
class Target:
    """What a placeholder points at: one setting of a regime, all its seeds (``seeds`` None)
    or the seeds named."""

    regime: str
    setting: str
    seeds: tuple[int, ...] | None


@dataclass(frozen=True)
class Sources:
    """Where placeholders read from: the runs, and the results folder (the gradient-group files
    and the methods bench, BENCH_FILE)."""

    found: Found
    grad_dir: Path


class _Bad(Exception):
    """Why one placeholder cannot be rendered; render() adds where it stands."""


def render(text: str, sources: Sources, name: str = "notes") -> str:
    """Replace every placeholder of ``text`` by the figure it names; NotesError names a bad one."""
    out, last = [], 0
    for match in PLACEHOLDER.finditer(text):
        _check_plain(text, last, match.start(), name)
        try:
            out += [text[last : match.start()], _one(match.group(1).split(), sources)]
        except _Bad as err:
            line = text.count("\n", 0, match.start()) + 1
            raise NotesError(f"{name}:{line}: '{match.group(0)}': {err}") from None
        last = match.end()
    _check_plain(text, last, len(text), name)
    return "".join([*out, text[last:]])


def _check_plain(text: str, start: int, end: int, name: str) -> None:
    """Text between placeholders holds no stray '{{' or '}}' (a placeholder left unclosed)."""
    for brace in ("{{", "}}"):
        at = text.find(brace, start, end)
        if at >= 0:
            line = text.count("\n", 0, at) + 1
            snippet = text[at : at + 40].split("\n")[0]
            raise NotesError(f"{name}:{line}: unbalanced '{brace}' in '{snippet}'")


def _one(words: list[str], sources: Sources) -> str:
    if not words or words[0] not in FUNCTIONS:
        raise _Bad(f"names no function; allowed: {', '.join(FUNCTIONS)}")
    fn, params = FUNCTIONS[words[0]]
    if len(words) != 1 + len(params):
        raise _Bad(f"'{words[0]}' takes {len(params)} argument(s): {' '.join(params)}")
    return fn(sources, *words[1:])


def _target(text: str, found: Found) -> Target:
    regime, sep, setting = text.partition("/")
    if not sep or regime not in found:
        raise _Bad(f"no regime '{regime}' (write regime/setting) among {sorted(found)}")
    runs = found[regime]
    if setting in runs:
        return Target(regime, setting, None)
    m = _SEEDED.fullmatch(setting)
    if m and m["setting"] in runs:
        first = int(m["first"])
        last = first if m["last"] is None else int(m["last"])
        if last < first:
            raise _Bad(f"seed range '{first}-{last}' runs backwards")
        seeds = tuple(range(first, last + 1))
        # a range with a seed missing would silently report fewer seeds than it names
        if all(s in runs[m["setting"]] for s in seeds):
            return Target(regime, m["setting"], seeds)
    raise _Bad(f"no finished run or setting '{setting}' in regime '{regime}'")


def _runs(sources: Sources, target: str) -> Seeds:
    t = _target(target, sources.found)
    runs = sources.found[t.regime][t.setting]
    return runs if t.seeds is None else {s: runs[s] for s in t.seeds}


def _pair(sources: Sources, target: str) -> tuple[Seeds, Seeds]:
    """The target's runs and its baseline's, to pair seed by seed."""
    runs, t = _runs(sources, target), _target(target, sources.found)
    ref = baseline_of(t.setting, sources.found[t.regime])
    if ref is None:
        raise _Bad(f"'{t.setting}' is a baseline: it has no Δ")
    if ref not in sources.found[t.regime]:
        raise _Bad(f"no finished run of '{ref}', the baseline of '{t.setting}'")
    return runs, sources.found[t.regime][ref]


def _family(word: str) -> str:
    if word not in FAMILY_OF_WORD:
        raise _Bad(f"family '{word}' is not one of {', '.join(FAMILY_OF_WORD)}")
    return FAMILY_OF_WORD[word]


def _diffs(sources: Sources, target: str, word: str) -> dict[int, float]:
    diffs = seed_diffs(*_pair(sources, target), _family(word))
    if not diffs:
        raise _Bad(f"no {word} AP of '{target}' paired with its baseline")
    return diffs


def _ap(sources: Sources, target: str, word: str, with_std: bool = True) -> str:
    text = ap_text(_runs(sources, target), _family(word), with_std)
    if text is None:
        raise _Bad(f"'{target}' has no {word} AP")
    return text


def _paired(sources: Sources, target: str, word: str) -> PairedDiff:
    d = paired(*_pair(sources, target), _family(word))
    if d is None:
        raise _Bad(f"no {word} AP of '{target}' paired with its baseline")
    return d


def _dend(sources: Sources, target: str, word: str, end: str) -> str:
    """One end of the paired interval, so prose can say how far a loss or gain is left open."""
    value = getattr(_paired(sources, target, word), end)
    if value is None:
        raise _Bad("an interval needs 2 paired seeds or more")
    return f"{value:+.1f}"


def _dseeds(sources: Sources, target: str, word: str) -> str:
    return ", ".join(f"{v:+.1f}" for v in _diffs(sources, target, word).values())


def _sd(sources: Sources, target: str, word: str) -> float:
    diffs = _diffs(sources, target, word)
    if len(diffs) < 2:
        raise _Bad("a standard deviation needs 2 paired seeds or more")
    return statistics.stdev(diffs.values())


def _dhalf(sources: Sources, target: str, word: str, seeds: str) -> str:
    """The half-width a paired 95% interval would have at ``seeds`` seeds with the spread of
    TARGET's per-seed Δ: what that many seeds can resolve."""
    if not seeds.isdigit() or int(seeds) < 2:
        raise _Bad(f"seed count '{seeds}' must be a whole number >= 2")
    n = int(seeds)
    return f"{t95(n - 1) * _sd(sources, target, word) / math.sqrt(n):.1f}"


def _dmax(sources: Sources, target: str, word: str) -> str:
    return f"{max(abs(v) for v in _diffs(sources, target, word).values()):.1f}"


def _nbelow(sources: Sources, target: str, word: str) -> str:
    diffs = _diffs(sources, target, word)
    return f"{sum(v < 0 for v in diffs.values())} of {len(diffs)}"


def _evals_at(runs: Seeds, family: str) -> dict[int, dict[int, float]]:
    """iteration -> seed -> AP x100 of every evaluation during training."""
    out: dict[int, dict[int, float]] = {}
    for seed, run in runs.items():
        for it, aps in run.evals:
            if family in aps:
                out.setdefault(it, {})[seed] = aps[family] * 100
    return out


def _dtrain(sources: Sources, target: str, word: str) -> str:
    """The mean over seeds of the paired Δ at every iteration both evaluated."""
    mine, base = (_evals_at(runs, _family(word)) for runs in _pair(sources, target))
    diffs = []
    for it in sorted(set(mine) & set(base)):
        paired_at = [v - base[it][s] for s, v in mine[it].items() if s in base[it]]
        if paired_at:
            diffs.append(statistics.fmean(paired_at))
    if not diffs:
        raise _Bad(f"no evaluation of '{target}' paired with its baseline's")
    return ", ".join(f"{v:+.1f}" for v in diffs)


def _at(sources: Sources, target: str, word: str, iteration: str) -> dict[int, float]:
    """seed -> AP x100 at one evaluation during training, for every seed evaluated there."""
    if not iteration.isdigit():
        raise _Bad(f"iteration '{iteration}' is not a whole number")
    evals = _evals_at(_runs(sources, target), _family(word))
    if int(iteration) not in evals:
        raise _Bad(
            f"'{target}' has no {word} evaluation at iteration {iteration} ({sorted(evals)})"
        )
    return evals[int(iteration)]


def _gains(sources: Sources, target: str, word: str, start: str, end: str) -> PairedDiff:
    """What each seed gained between two evaluations, paired with itself: whether a schedule
    has converged is read from this interval, not from the means at its two ends."""
    d = paired_diff(_at(sources, target, word, end), _at(sources, target, word, start))
    if d is None:
        raise _Bad(f"no seed of '{target}' evaluated at both {start} and {end}")
    return d


def _gainseeds(sources: Sources, target: str, word: str, start: str, end: str) -> str:
    late, early = _at(sources, target, word, end), _at(sources, target, word, start)
    return ", ".join(f"{late[s] - early[s]:+.1f}" for s in sorted(late) if s in early)


def _converged(sources: Sources, target: str, word: str, start: str, end: str) -> str:
    """The convergence criterion read from the gain's interval: "converged" when its upper end
    is below the bound, "not converged" when its lower end is at or above it, else "not shown"
    (the seeds hold gains on both sides of the bound)."""
    d = _gains(sources, target, word, start, end)
    if d.low is None or d.high is None:
        return f"not shown ({ONE_SEED})"
    if d.high < CONVERGED_GAIN:
        return "converged"
    return "not converged" if d.low >= CONVERGED_GAIN else "not shown"


def _meets(sources: Sources, target: str, word: str) -> str:
    """The study's target: AP kept when the interval rules out a loss beyond the tolerance."""
    state = family_state(_paired(sources, target, word))
    if state == ONE_SEED:
        return f"cannot say ({ONE_SEED})"
    return "meets" if rules_out_loss(state) else "misses"


def _margin(sources: Sources, target: str, word: str) -> str:
    """The lower end's distance from the target's bound, where one decimal would hide it."""
    low = _paired(sources, target, word).low
    if low is None:
        raise _Bad("an interval needs 2 paired seeds or more")
    return f"{low + TOLERANCE:+.3f}"


def _vs(sources: Sources, target: str, other: str, word: str) -> str:
    d = paired(_runs(sources, target), _runs(sources, other), _family(word))
    if d is None:
        raise _Bad(f"'{target}' and '{other}' share no seed with {word} AP")
    return paired_text(d)


def _one_run(sources: Sources, target: str) -> Run:
    t = _target(target, sources.found)
    if t.seeds is None:
        raise _Bad(f"'{target}' names a setting; name one run, e.g. '{target}_s1'")
    if len(t.seeds) != 1:
        raise _Bad(f"'{target}' names {len(t.seeds)} runs; name one")
    return sources.found[t.regime][t.setting][t.seeds[0]]


def _same(sources: Sources, target: str, other: str) -> str:
    """Whether two runs trained alike to the last bit: every logged loss, every evaluation
    and the final AP equal (e.g. exact recomputation against its baseline)."""
    a, b = _one_run(sources, target), _one_run(sources, other)
    if not a.losses or len(a.losses) != len(b.losses):
        return f"not comparable: {len(a.losses)} and {len(b.losses)} logged losses"
    losses = sum(x != y for x, y in zip(a.losses, b.losses, strict=True))
    aps = sum(
        a.metrics.get(f, {}).get(k) != b.metrics.get(f, {}).get(k)
        for f in ("bbox", "segm")
        for k in {*a.metrics.get(f, {}), *b.metrics.get(f, {})}
    )
    evals = sum(x != y for x, y in zip(a.evals, b.evals, strict=False)) + abs(
        len(a.evals) - len(b.evals)
    )
    if losses == aps == evals == 0:
        return (
            f"identical: all {len(a.losses)} logged losses, {len(a.evals)} evaluations during "
            "training and every final AP equal to the last bit"
        )
    return (
        f"not identical: {losses} of {len(a.losses)} logged losses, {evals} evaluations and "
        f"{aps} final AP figures differ"
    )


def _saved(sources: Sources, target: str) -> str:
    ratio = saved_ratio(*_pair(sources, target))
    if ratio is None:
        raise _Bad(f"no saved-activation figure of '{target}' paired with its baseline's")
    return f"{ratio:.2f}x"


def _n(sources: Sources, target: str) -> str:
    runs, base = _pair(sources, target)
    return str(len(set(runs) & set(base)))


def _seeds(sources: Sources, target: str) -> str:
    return ", ".join(str(s) for s in sorted(_runs(sources, target)))


def _seedlist(sources: Sources, regime: str) -> str:
    """Every setting of a regime with the seeds that finished: a list typed by hand leaves
    settings out as the study grows."""
    if regime not in sources.found:
        raise _Bad(f"no regime '{regime}' among {sorted(sources.found)}")
    runs = sources.found[regime]
    if not runs:
        raise _Bad(f"regime '{regime}' has no finished run")
    return "; ".join(f"{s} {', '.join(str(n) for n in sorted(runs[s]))}" for s in sorted(runs))


def _grad(sources: Sources, name: str, state: str, setting: str, group: str, measure: str) -> str:
    path = grad_groups_file(sources.grad_dir, name)
    where = path.relative_to(sources.grad_dir).as_posix()
    if not path.is_file():
        raise _Bad(f"no file {path}")
    if measure not in GRAD_MEASURES:
        raise _Bad(f"measure '{measure}' is not one of {', '.join(GRAD_MEASURES)}")
    try:
        node = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise _Bad(f"{path} is not JSON ({err})") from None
    for key in (state, setting, group, GRAD_MEASURES[measure]):
        if not isinstance(node, dict):
            raise _Bad(f"{where}: no table under '{key}'")
        spaced = key.replace("_", " ")
        key = spaced if spaced in node else key
        if key not in node or key == "run":
            known = sorted(k for k in node if k != "run")
            raise _Bad(f"{where} has no '{key}' there (spaces as '_'); it has {known}")
        node = node[key]
    if not isinstance(node, (int, float)):
        raise _Bad(f"{where}: '{measure}' is not a number")
    return f"{node:.2f}"


def _bench(sources: Sources, setting: str, key: str) -> str:
    """A ratio of the R50-FPN methods bench (BENCH_FILE under the report's folder)."""
    return f"{_bench_row_value(sources, BENCH_FILE, setting, key):.2f}x"


# The methods benches that timed their steps, where BENCH_FILE did not (a run with --repeats 0),
# newest first: make bench-speed's on the trained workload (quiet, 2026-12-07: baseline,
# quant_4bit, mink_0.8), then the untrained workload's whole table (quiet, 2026-11-27).
TIMED_BENCH_FILES = (
    "cpu_speed_512/methods.json",
    "archive/untrained_methods_512/methods_bench.json",
)


def _step(sources: Sources, setting: str) -> str:
    """The step ratio of ``setting`` on the methods bench, or on the newest timed one that has
    it (named)."""
    ratio = _bench_row_value(sources, BENCH_FILE, setting, "step_ratio", required=False)
    if ratio is not None:
        return f"{ratio:.2f}x"
    for name in TIMED_BENCH_FILES[:-1]:
        if setting in (methods_by_setting(sources.grad_dir / name) or {}):
            break
    else:
        name = TIMED_BENCH_FILES[-1]  # the whole table, or its error naming what it has
    value = _bench_row_value(sources, name, setting, "step_ratio")
    row = _bench_row(sources, name, setting)
    workload = row.get("workload") or "untrained"
    return f"{value:.2f}x ({workload} workload, timed {row.get('date')})"


def _bench_row(sources: Sources, name: str, setting: str) -> dict:
    path = sources.grad_dir / name
    bench = methods_by_setting(path)
    if bench is None:
        raise _Bad(f"no file {path}")
    if setting not in bench:
        raise _Bad(f"{name} has no setting '{setting}'; it has {sorted(bench)}")
    return bench[setting]


def _bench_row_value(
    sources: Sources, name: str, setting: str, key: str, required: bool = True
) -> float | None:
    value = _bench_row(sources, name, setting).get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if required:
            raise _Bad(f"{name}: '{key}' of '{setting}' is not a number")
        return None
    return float(value)


FUNCTIONS: dict[str, tuple[Callable[..., str], tuple[str, ...]]] = {
    "ap": (_ap, ("TARGET", "FAMILY")),
    "mean": (partial(_ap, with_std=False), ("TARGET", "FAMILY")),
    "d": (lambda *a: paired_text(_paired(*a)), ("TARGET", "FAMILY")),
    "dmean": (lambda *a: f"{_paired(*a).mean:+.1f}", ("TARGET", "FAMILY")),
    "dlow": (partial(_dend, end="low"), ("TARGET", "FAMILY")),
    "dhigh": (partial(_dend, end="high"), ("TARGET", "FAMILY")),
    "dseeds": (_dseeds, ("TARGET", "FAMILY")),
    "dsd": (lambda *a: f"{_sd(*a):.1f}", ("TARGET", "FAMILY")),
    "dmax": (_dmax, ("TARGET", "FAMILY")),
    "dhalf": (_dhalf, ("TARGET", "FAMILY", "N")),
    "nbelow": (_nbelow, ("TARGET", "FAMILY")),
    "dtrain": (_dtrain, ("TARGET", "FAMILY")),
    "apat": (lambda *a: f"{statistics.fmean(_at(*a).values()):.1f}", ("TARGET", "FAMILY", "ITER")),
    "gain": (lambda *a: paired_text(_gains(*a)), ("TARGET", "FAMILY", "A", "B")),
    "gainseeds": (_gainseeds, ("TARGET", "FAMILY", "A", "B")),
    "converged": (_converged, ("TARGET", "FAMILY", "A", "B")),
    "state": (lambda *a: family_state(_paired(*a)), ("TARGET", "FAMILY")),
    "meets": (_meets, ("TARGET", "FAMILY")),
    "margin": (_margin, ("TARGET", "FAMILY")),
    "vs": (_vs, ("TARGET", "OTHER", "FAMILY")),
    "saved": (_saved, ("TARGET",)),
    "n": (_n, ("TARGET",)),
    "seeds": (_seeds, ("TARGET",)),
    "seedlist": (_seedlist, ("REGIME",)),
    "grad": (_grad, ("NAME", "STATE", "SETTING", "GROUP", "MEASURE")),
    "bench": (_bench, ("SETTING", "KEY")),
    "step": (_step, ("SETTING",)),
    "same": (_same, ("RUN", "OTHER")),
}

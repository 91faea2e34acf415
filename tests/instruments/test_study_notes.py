"""The study report's figures by construction: notes rendered from the runs, the verdict read
from paired intervals, the goal, the time account from the runs' logs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from instruments.measure.methods_table import METHOD_KEYS, PROVENANCE_KEYS
from instruments.measure.study_plan import Group, Plan
from instruments.measure.study_report import ap_table, write_study_report
from instruments.report.goal import (
    BENCH_FILE,
    Goal,
    covers_every_layer,
    criteria,
    goal_section,
)
from instruments.report.notes import (
    FUNCTIONS,
    TIMED_BENCH_FILES,
    NotesError,
    Sources,
    grad_groups_file,
    render,
)
from instruments.report.seeded import baseline_of, paired, saved_ratio
from instruments.report.time_account import (
    log_segments,
    read_times_file,
    regime_time,
    run_time,
    segments_seconds,
    time_table,
    usual_jobs,
)
from instruments.report.verdict import family_state, setting_verdict, verdict_table
from rcnn_dropit.errors import UsageError
from rcnn_dropit.report.paired import PairedDiff
from rcnn_dropit.report.runs import Run

ALL_LAYERS = {"enabled": True, "strategy": "mink", "gamma": 0.8, "include": ["*"]}


def run(
    box: float,
    mask: float,
    saved: float | None = None,
    evals: dict[int, tuple[float, float]] | None = None,
    dropit: dict | None = None,
    losses: tuple[tuple[int, float], ...] = (),
) -> Run:
    """A finished run as the report reads it (AP given x100)."""
    return Run(
        path=Path("fake"),
        name="fake",
        config={"dropit": dropit or {"enabled": False}},
        metrics={"bbox": {"AP": box / 100}, "segm": {"AP": mask / 100}},
        num_images=4,
        iterations=8,
        losses=losses,
        images_per_sec=None,
        saved_mb=saved,
        peak_mb=None,
        notes=(),
        evals=tuple(
            (it, {"bbox": b / 100, "segm": m / 100}) for it, (b, m) in (evals or {}).items()
        ),
    )


LOSSES = ((4, 1.0), (8, 0.5))
# Three seeds: box Δ -2, -1, -1.5; mask Δ -0.5, -1.0, +0.5; saved 0.5, 0.3, 0.4 of the same seed's
# baseline (a ratio of the means would be 0.375). At iteration 100 box Δ -10, -5, -10; at 200, 0.
FOUND = {
    "ft": {
        "baseline": {
            1: run(80.0, 70.0, 10.0, {100: (40.0, 40.0), 200: (70.0, 60.0)}, losses=LOSSES),
            2: run(81.0, 71.0, 20.0, {100: (50.0, 50.0), 200: (70.0, 60.0)}),
            3: run(82.0, 72.0, 10.0, {100: (60.0, 60.0), 200: (70.0, 60.0)}),
        },
        "mink": {
            1: run(78.0, 69.5, 5.0, {100: (30.0, 30.0), 200: (69.0, 60.0)}, ALL_LAYERS, LOSSES),
            2: run(80.0, 70.0, 6.0, {100: (45.0, 45.0), 200: (70.0, 60.0)}, ALL_LAYERS),
            3: run(80.5, 72.5, 4.0, {100: (50.0, 50.0), 200: (71.0, 60.0)}, ALL_LAYERS),
        },
        "baseline_2x": {1: run(83.0, 74.0, 10.0)},
        "mink_2x": {1: run(82.0, 73.0, 5.0), 2: run(81.0, 72.0, 5.0)},
    },
    # A longer schedule: box gains 0, +0.1, 0 from 100 to 200 (interval +0.0 [-0.1, +0.2]);
    # 4-bit box Δ -0.5, -0.8, -0.2 (interval -0.5 [-1.2, +0.2]), mask Δ +0.2, 0, -0.2.
    "long": {
        "baseline": {
            s: run(80.0 + s, 70.0, 10.0, {100: (80.0, 70.0), 200: (80.0 + g, 70.0)})
            for s, g in ((1, 0.0), (2, 0.1), (3, 0.0))
        },
        "quant": {
            s: run(80.0 + s + db, 70.0 + dm, 2.0, dropit=ALL_LAYERS)
            for s, db, dm in ((1, -0.5, 0.2), (2, -0.8, 0.0), (3, -0.2, -0.2))
        },
    },
}


def bench_json(*entries: dict) -> str:
    """A methods table file's text: each entry a record with every key (None unless given)."""
    return json.dumps([{**dict.fromkeys((*METHOD_KEYS, *PROVENANCE_KEYS)), **e} for e in entries])


@pytest.fixture
def sources(tmp_path: Path) -> Sources:
    cell = {"cosine": 0.9744, "norm_ratio": 0.7561}
    grad = grad_groups_file(tmp_path, "ft")
    grad.parent.mkdir()
    grad.write_text(json.dumps({"run": "x", "iter 800": {"mink_0.8": {"RPN head": cell}}}))
    bench = tmp_path / BENCH_FILE
    bench.parent.mkdir()
    bench.write_text(
        bench_json({"setting": "mink_0.8", "saved_ratio": 0.2694, "peak_ratio": 0.6095})
    )
    return Sources(FOUND, grad_dir=tmp_path)


@pytest.mark.parametrize(
    ("placeholder", "expected"),
    [
        ("ap ft/baseline box", "81.0 ± 1.0"),
        ("ap ft/mink_s2 box", "80.0"),
        ("mean ft/baseline mask", "71.0"),
        # half-width t(2) 4.303 x sd 0.5 / sqrt(3) = 1.242
        ("d ft/mink box", "-1.5 [-2.7, -0.3]"),
        ("d ft/mink_s1 box", "-2.0"),
        # mask Δ -0.5, -1.0, +0.5: mean -1/3, sd 0.764, half-width 1.897
        ("d ft/mink mask", "-0.3 [-2.2, +1.6]"),
        ("dmean ft/mink box", "-1.5"),
        ("dlow ft/mink box", "-2.7"),
        ("dhigh ft/mink mask", "+1.6"),
        # lower ends -2.742 and -2.231 against the bound -1
        ("margin ft/mink box", "-1.742"),
        ("margin ft/mink mask", "-1.231"),
        # seeds 1-2 only, as the notes read a setting before more seeds came: box Δ -2, -1,
        # mean -1.5, sd 0.707, half-width t(1) 12.706 x 0.707 / sqrt(2) = 6.35
        ("d ft/mink_s1-2 box", "-1.5 [-7.9, +4.9]"),
        ("dseeds ft/mink_s2-3 box", "-1.0, -1.5"),
        ("n ft/mink_s1-2", "2"),
        ("d ft/mink_s1-1 box", "-2.0"),  # a range of one seed is that run
        ("dseeds ft/mink box", "-2.0, -1.0, -1.5"),
        ("dsd ft/mink box", "0.5"),
        ("dmax ft/mink mask", "1.0"),
        ("dhalf ft/mink box 5", "0.6"),  # t(4) 2.776 x sd 0.5 / sqrt(5) = 0.62
        ("dhalf ft/mink box 3", "1.2"),  # the interval's own half-width at its 3 seeds
        ("nbelow ft/mink box", "3 of 3"),
        ("nbelow ft/mink mask", "2 of 3"),
        ("dtrain ft/mink box", "-8.3, +0.0"),
        ("apat ft/baseline box 100", "50.0"),
        # each seed against itself: 70 - 40, 70 - 50, 70 - 60 = 30, 20, 10; sd 10,
        # half-width t(2) 4.303 x 10 / sqrt(3) = 24.8
        ("gain ft/baseline box 100 200", "+20.0 [-4.8, +44.8]"),
        ("gain ft/mink_s3 mask 100 200", "+10.0"),
        ("gainseeds ft/mink box 100 200", "+39.0, +25.0, +21.0"),
        ("converged long/baseline box 100 200", "converged"),  # upper end +0.18 < 0.5
        ("converged ft/mink box 100 200", "not converged"),  # 28.3 [+4.9, +51.8]: all >= 0.5
        ("converged ft/baseline box 100 200", "not shown"),  # +20.0 [-4.8, +44.8] holds 0.5
        ("converged ft/mink_s3 mask 100 200", "not shown (1 seed: no interval)"),
        ("state ft/mink box", "inconclusive, below 0"),  # [-2.7, -0.3] crosses -1
        ("state long/quant mask", "keeps"),
        ("state ft/mink_s1 box", "1 seed: no interval"),
        ("meets long/quant box", "misses"),  # the lower end -1.2 < -1
        ("meets long/quant mask", "meets"),
        ("meets ft/mink_s1 box", "cannot say (1 seed: no interval)"),
        ("vs ft/mink_2x_s1 ft/mink box", "+4.0"),  # seed 1 only: 82 - 78
        ("vs ft/mink_2x ft/mink box", "+2.5 [-16.6, +21.6]"),  # seeds 1 and 2: 4 and 1
        ("d ft/mink_2x box", "-1.0"),  # against baseline_2x (83), not the 1x baseline
        ("n ft/mink_2x", "1"),  # seed 2 has no baseline_2x
        ("saved ft/mink", "0.40x"),  # mean of per-seed ratios, not 0.38x
        ("n ft/mink", "3"),
        ("seeds ft/mink_2x", "1, 2"),
        # every setting, sorted, so a list in the notes cannot leave one out
        ("seedlist ft", "baseline 1, 2, 3; baseline_2x 1; mink 1, 2, 3; mink_2x 1, 2"),
        ("grad ft iter_800 mink_0.8 RPN_head cos", "0.97"),
        ("grad ft iter_800 mink_0.8 RPN_head norm", "0.76"),
        ("bench mink_0.8 peak_ratio", "0.61x"),
        (
            "same ft/baseline_s1 ft/baseline_s1",
            "identical: all 2 logged losses, 2 evaluations during training and every final AP "
            "equal to the last bit",
        ),
        (  # the same losses, yet both evaluations and both final APs differ
            "same ft/mink_s1 ft/baseline_s1",
            "not identical: 0 of 2 logged losses, 2 evaluations and 2 final AP figures differ",
        ),
        ("same ft/mink_s1 ft/baseline_s2", "not comparable: 2 and 0 logged losses"),
    ],
)
def test_every_placeholder_renders_its_figure(
    sources: Sources, placeholder: str, expected: str
) -> None:
    assert render(f"x {{{{{placeholder}}}}} y", sources) == f"x {expected} y"


def test_a_step_ratio_comes_from_the_newest_timed_table_which_it_names(sources: Sources) -> None:
    """The methods bench untimed (--repeats 0): the newest timed table that has the setting,
    its workload and date said (else the archived one's); timed: its own ratio, nothing added;
    neither: one clear error."""
    newer, timed = (sources.grad_dir / name for name in TIMED_BENCH_FILES)
    timed.parent.mkdir(parents=True)
    newer.parent.mkdir(parents=True)
    newer.write_text(
        bench_json(
            {
                "setting": "quant_4bit",
                "saved_ratio": 0.3,
                "peak_ratio": 0.5,
                "step_ratio": 1.008,
                "date": "2026-12-07",
                "workload": "trained",
            }
        )
    )
    timed.write_text(
        bench_json(
            {
                "setting": "mink_0.8",
                "saved_ratio": 0.27,
                "peak_ratio": 0.56,
                "step_ratio": 1.234,
                "date": "2026-11-27",
            }
        )
    )
    assert render("{{step mink_0.8}}", sources) == ("1.23x (untrained workload, timed 2026-11-27)")
    newer.write_text(newer.read_text().replace("quant_4bit", "mink_0.8"))
    assert render("{{step mink_0.8}}", sources) == "1.01x (trained workload, timed 2026-12-07)"
    own = sources.grad_dir / BENCH_FILE
    own.write_text(
        bench_json(
            {"setting": "mink_0.8", "saved_ratio": 0.4, "peak_ratio": 0.6, "step_ratio": 1.1}
        )
    )
    assert render("{{step mink_0.8}}", sources) == "1.10x"
    own.write_text(bench_json({"setting": "mink_0.8", "saved_ratio": 0.4, "peak_ratio": 0.6}))
    for path in (newer, timed):
        path.write_text(bench_json({"setting": "mink_0.8", "saved_ratio": 0.4, "peak_ratio": 0.6}))
    with pytest.raises(NotesError, match="'step_ratio' of 'mink_0.8' is not a number"):
        render("{{step mink_0.8}}", sources)


def test_every_function_is_tested() -> None:
    tested = {"ap", "mean", "d", "dmean", "dseeds", "dsd", "dmax", "nbelow"}
    tested |= {"dtrain", "vs", "saved", "n", "seeds", "grad", "bench", "same", "dhalf"}
    tested |= {"dlow", "dhigh", "seedlist", "apat", "gain", "gainseeds", "converged", "state"}
    tested |= {"meets", "margin", "step"}
    assert set(FUNCTIONS) == tested


def test_text_without_placeholders_is_unchanged(sources: Sources) -> None:
    text = "# Notes\n\n| a | b |\n|---|---|\nA brace { or } alone is fine.\n"
    assert render(text, sources) == text


@pytest.mark.parametrize(
    ("placeholder", "message"),
    [
        ("{{foo ft/mink box}}", "names no function"),
        ("{{}}", "names no function"),
        ("{{d ft/mink}}", "'d' takes 2 argument(s): TARGET FAMILY"),
        ("{{d xx/mink box}}", "no regime 'xx'"),
        ("{{d ft_mink box}}", "write regime/setting"),
        ("{{d ft/nope box}}", "no finished run or setting 'nope'"),
        ("{{d ft/mink_s9 box}}", "no finished run or setting 'mink_s9'"),
        ("{{d ft/mink_s2-4 box}}", "no finished run or setting 'mink_s2-4'"),  # no seed 4
        ("{{d ft/mink_s3-1 box}}", "seed range '3-1' runs backwards"),
        ("{{dlow ft/mink_s1 box}}", "an interval needs 2 paired seeds"),
        ("{{dhigh ft/mink_2x mask}}", "an interval needs 2 paired seeds"),  # 1 paired of 2
        ("{{margin ft/mink_s1 box}}", "an interval needs 2 paired seeds"),
        ("{{seedlist xx}}", "no regime 'xx'"),
        ("{{same ft/mink_s1-2 ft/baseline_s1}}", "names 2 runs; name one"),
        ("{{d ft/mink bx}}", "family 'bx' is not one of box, mask"),
        ("{{d ft/baseline box}}", "'baseline' is a baseline"),
        ("{{apat ft/baseline box late}}", "iteration 'late' is not a whole number"),
        ("{{dsd ft/mink_s1 box}}", "needs 2 paired seeds"),
        ("{{apat ft/baseline box 300}}", "no box evaluation at iteration 300 ([100, 200])"),
        ("{{gain ft/baseline mask x 200}}", "iteration 'x' is not a whole number"),
        ("{{gain ft/baseline_2x box 100 200}}", "no box evaluation at iteration 200 ([])"),
        ("{{dhalf ft/mink box 1}}", "seed count '1' must be a whole number >= 2"),
        ("{{dhalf ft/mink_s1 box 5}}", "needs 2 paired seeds"),
        ("{{vs ft/mink_2x_s2 ft/mink_s1 box}}", "share no seed"),
        ("{{grad nope init mink_0.8 all cos}}", "no file"),
        ("{{grad ft iter_800 mink_0.8 RPN_head angle}}", "measure 'angle'"),
        ("{{grad ft init mink_0.8 RPN_head cos}}", "no 'init' there"),
        ("{{bench quant_4bit peak_ratio}}", "no setting 'quant_4bit'"),
        ("{{bench mink_0.8 step_ratio}}", "'step_ratio' of 'mink_0.8' is not a number"),
        ("{{same ft/mink ft/baseline_s1}}", "names a setting; name one run, e.g. 'ft/mink_s1'"),
        ("{{d ft/mink box", "unbalanced '{{'"),
        ("d ft/mink box}}", "unbalanced '}}'"),
    ],
)
def test_a_bad_placeholder_is_named_with_its_line(
    sources: Sources, placeholder: str, message: str
) -> None:
    with pytest.raises(NotesError, match=re.escape(message)) as err:
        render(f"# Notes\n\nok {{{{n ft/mink}}}}\n{placeholder}\n", sources, name="notes.md")
    assert str(err.value).startswith("notes.md:4: ")
    if "unbalanced" not in message:
        assert placeholder in str(err.value)
    assert isinstance(err.value, UsageError)  # one line for the user, no traceback


def test_saved_ratio_pairs_by_seed() -> None:
    assert saved_ratio(FOUND["ft"]["mink"], FOUND["ft"]["baseline"]) == pytest.approx(0.4)
    unpaired = {9: run(1.0, 1.0, 5.0)}
    assert saved_ratio(unpaired, FOUND["ft"]["baseline"]) is None


def test_a_longer_schedule_pairs_with_its_own_baseline() -> None:
    settings = ["baseline", "baseline_2x", "mink", "mink_2x", "mink_0.8_heads"]
    assert baseline_of("mink_2x", settings) == "baseline_2x"
    assert baseline_of("mink", settings) == "baseline"
    assert baseline_of("mink_0.8_heads", settings) == "baseline"
    assert baseline_of("baseline_2x", settings) is None
    assert baseline_of("baseline", settings) is None
    assert baseline_of("mink_2x", ["baseline", "mink_2x"]) == "baseline"  # no 2x baseline


# ---- verdict ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low", "high", "state"),
    [
        (-1.0, 1.0, "keeps"),  # the bounds belong to "keeps"
        (-0.9, -0.1, "keeps"),
        (-3.5, -1.1, "loses"),
        (1.2, 3.0, "gains"),
        (-3.5, -0.4, "inconclusive, below 0"),
        (0.3, 1.4, "inconclusive, above 0"),
        (-1.7, 1.0, "inconclusive"),
        (-0.5, 1.5, "inconclusive, no loss beyond 1"),  # only a gain > 1 is left open
        (-1.0, 1.01, "inconclusive, no loss beyond 1"),
        (-1.01, 1.5, "inconclusive"),
        (None, None, "1 seed: no interval"),
    ],
)
def test_family_state_reads_the_interval(low, high, state) -> None:
    mean = 0.0 if low is None else (low + high) / 2
    assert family_state(PairedDiff(3, mean, low, high)) == state


def test_a_mean_inside_tolerance_with_a_wide_interval_is_not_kept() -> None:
    assert family_state(PairedDiff(3, -0.3, -1.7, 1.0)) == "inconclusive"


@pytest.mark.parametrize(
    ("states", "verdict"),
    [
        (["keeps", "keeps"], "keeps AP"),
        (["keeps", "loses"], "loses AP"),
        (["keeps", "gains"], "keeps or gains AP"),
        (["keeps", "inconclusive, below 0"], "inconclusive"),
        (["keeps", "inconclusive, no loss beyond 1"], "no loss beyond 1 AP"),
        (["inconclusive, above 0", "inconclusive, no loss beyond 1"], "no loss beyond 1 AP"),
        (["inconclusive", "inconclusive, no loss beyond 1"], "inconclusive"),
        (["1 seed: no interval", "1 seed: no interval"], "1 seed: no interval"),
    ],
)
def test_setting_verdict_needs_both_families(states, verdict) -> None:
    assert setting_verdict(states) == verdict


def test_verdict_table_covers_every_setting_with_its_seeds() -> None:
    planned = {"mink": 5, "mink_2x": 1, "quant_4bit": 3}
    settings = ["baseline", "mink", "baseline_2x", "mink_2x", "quant_4bit"]
    lines = verdict_table(FOUND["ft"], settings, planned.get)
    assert len(lines) == 5  # header, rule, and a row per non-baseline setting
    assert lines[2] == (
        "| mink | 3 of 5 | -1.5 [-2.7, -0.3] | **inconclusive, below 0** | -0.3 [-2.2, +1.6] "
        "| **inconclusive** | inconclusive (provisional: 3 of 5 seeds) |"
    )
    assert lines[3] == (
        "| mink_2x | 1 of 1 | -1.0 | **1 seed: no interval** | -1.0 | **1 seed: no interval** "
        "| 1 seed: no interval |"
    )
    assert lines[4] == "| quant_4bit | 0 of 3 | - | - | - | - | not measured yet |"


def test_verdict_says_when_a_setting_has_no_baseline_of_its_seed() -> None:
    found = {"baseline": {1: run(80, 70)}, "mink": {2: run(79, 69)}}
    lines = verdict_table(found, ["mink"], lambda s: 1)
    assert lines[2] == "| mink | 0 of 1 | - | - | - | - | no baseline run paired by seed |"


# ---- the goal -----------------------------------------------------------------------------


def five_seeds(box_diffs, mask_diffs, dropit=ALL_LAYERS) -> tuple[dict, dict]:
    base = {s: run(80.0, 70.0) for s in range(1, 6)}
    mine = {
        s: run(80.0 + b, 70.0 + m, dropit=dropit)
        for s, b, m in zip(range(1, 6), box_diffs, mask_diffs, strict=True)
    }
    return mine, base


@pytest.mark.parametrize(
    ("dropit", "covers"),
    [
        ({"enabled": False}, False),
        (ALL_LAYERS, True),
        ({"enabled": True, "include": ["backbone.*"]}, False),
        ({"enabled": True, "include": ["backbone.*", "rpn.*", "roi_heads.*"]}, True),
        ({"enabled": True, "include": ["*"], "exclude": ["rpn.*"]}, False),
        ({"enabled": True, "include": ["*"], "exclude": ["backbone.body.conv1"]}, True),
        (
            {
                "enabled": True,
                "rules": [{"include": ["backbone.*"]}, {"include": ["rpn.*", "roi_heads.*"]}],
            },
            True,
        ),
        ({"enabled": True, "rules": [{"include": ["backbone.*"]}]}, False),
    ],
)
def test_covers_every_layer_the_paper_converts(dropit: dict, covers: bool) -> None:
    assert covers_every_layer({"dropit": dropit}) is covers


def test_a_longer_schedule_takes_the_bench_figures_of_its_one_step() -> None:
    from instruments.report.goal import with_schedules

    bench = {"mink_0.8": {"saved_ratio": 0.27, "peak_ratio": 0.61}}
    order = ["baseline", "mink_0.8", "baseline_2x", "mink_0.8_2x", "quant_4bit_2x"]
    out = with_schedules(bench, order)
    assert out["mink_0.8_2x"] == bench["mink_0.8"]
    assert "quant_4bit_2x" not in out and "baseline_2x" not in out  # nothing to take from
    assert with_schedules(bench, ["baseline", "mink_0.8", "mink_0.8_x"]) == bench
    assert with_schedules(None, order) is None


def test_criteria_name_each_figure() -> None:
    mine, base = five_seeds([-0.2, 0.1, -0.3, 0.0, 0.2], [-0.1, 0.2, -0.2, 0.1, 0.0])
    bench = {"q": {"saved_ratio": 0.25, "peak_ratio": 0.7}}
    found = {"baseline": base, "q": mine}
    crit = criteria(found, "q", bench, Goal())
    assert [c.met for c in crit] == [True, True, True, True, False]
    assert crit[0].text == "5 seeds" and crit[4].text == "0.70x"
    assert crit[1].text.startswith("-0.0 [") and crit[1].text.endswith("(keeps)")
    missing = criteria(found, "q", None, Goal())
    assert [c.met for c in missing[3:]] == [None, None]
    assert criteria(found, "q", {}, Goal())[3].text == "not benched"


def test_goal_section_states_which_setting_meets_it(tmp_path: Path) -> None:
    good, base = five_seeds([-0.2, 0.1, -0.3, 0.0, 0.2], [-0.1, 0.2, -0.2, 0.1, 0.0])
    bad, _ = five_seeds([-2.0, -1.5, -2.5, -1.0, -2.2], [0.0] * 5)
    backbone, _ = five_seeds([0.0] * 5, [0.0] * 5, {"enabled": True, "include": ["backbone.*"]})
    found = {"baseline": base, "good": good, "bad": bad, "mink_0.8_backbone": backbone}
    order = ["baseline", "good", "bad", "mink_0.8_backbone"]
    bench = {
        "good": {"saved_ratio": 0.2, "peak_ratio": 0.6},
        "bad": {"saved_ratio": 0.2, "peak_ratio": 0.6},
    }
    text = "\n".join(goal_section(found, order, bench, tmp_path / "b.json", Goal()))
    assert "**The goal is met by: good.**" in text
    assert "| good | yes: 5 seeds |" in text and "| **met** |" in text
    assert "| bad | yes: 5 seeds | **no**: -1.8 [" in text
    assert "Not candidates (DropIT not on every layer, or none): mink_0.8_backbone." in text
    absent = "\n".join(goal_section(found, order, None, tmp_path / "b.json", Goal()))
    assert "The bench figures are missing" in absent and "?: bench missing" in absent
    assert "**No setting meets the goal**" in absent
    assert "| good |" in absent and absent.count("| open |") == 1


def test_recommend_prefers_the_goal_then_the_smallest_loss_left_open() -> None:
    from instruments.report.goal import recommend

    good, base = five_seeds([-0.2, 0.1, -0.3, 0.0, 0.2], [-0.1, 0.2, -0.2, 0.1, 0.0])
    also, _ = five_seeds([0.1, 0.0, -0.1, 0.2, 0.0], [0.0, 0.1, -0.1, 0.0, 0.1])
    wide, _ = five_seeds([-1.0, 0.5, -0.8, 0.9, -0.4], [0.0, 1.0, -1.5, 0.5, 0.2])
    wider, _ = five_seeds([-2.0, 1.5, -1.8, 1.9, -1.4], [0.0, 1.0, -1.5, 0.5, 0.2])
    three = {s: r for s, r in also.items() if s <= 3}
    order = ["baseline", "good", "also", "wide", "wider", "three"]
    found = {"baseline": base, "good": good, "also": also, "wide": wide, "wider": wider}
    bench = {s: {"saved_ratio": 0.2, "peak_ratio": 0.6} for s in order}
    bench["also"] = {"saved_ratio": 0.2, "peak_ratio": 0.5}
    # two meet the goal: the lower peak wins
    rec = recommend(found, order, bench, Goal())
    assert (rec.setting, rec.meets_goal) == ("also", True)
    # none meets it: the highest lowest interval end wins, a 3-seed one does not count
    found = {"baseline": base, "wide": wide, "wider": wider, "three": three}
    rec = recommend(found, order, bench, Goal())
    low = min(paired(wide, base, family).low for family in ("bbox", "segm"))
    assert (rec.setting, rec.meets_goal) == ("wide", False) and rec.worst_low == pytest.approx(low)
    assert low < -1  # so "wide" does not keep AP, yet loses least
    # outside the memory bounds, or too few seeds: nothing to recommend
    assert (
        recommend(
            found,
            order,
            {
                **bench,
                "wide": {"saved_ratio": 0.4, "peak_ratio": 0.6},
                "wider": {"saved_ratio": 0.2, "peak_ratio": 0.7},
            },
            Goal(),
        )
        is None
    )
    assert recommend({"baseline": base, "three": three}, order, bench, Goal()) is None


# ---- the time account ---------------------------------------------------------------------

LOG = """\
2026-11-22 20:28:29,593 INFO training maskrcnn for 800 iterations into 'x'
2026-11-22 20:32:27,593 INFO evaluation at iteration 200:
| type | AP |
2026-11-22 20:40:38,988 INFO resumed from 'x/checkpoints/model_0000200.pth' at iteration 200
2026-11-22 20:40:38,997 INFO training maskrcnn for 800 iterations into 'x'
2026-11-22 20:43:05,988 INFO evaluation at iteration 400:
2026-11-22 20:44:01,096 INFO resumed from 'x/checkpoints/model_0000400.pth' at iteration 400
2026-11-22 20:44:01,112 INFO training maskrcnn for 800 iterations into 'x'
2026-11-22 20:50:18,096 INFO final evaluation (100 images):
"""


def test_a_resumed_run_sums_its_segments_not_first_to_last() -> None:
    segments = log_segments(LOG)
    assert [s.seconds for s in segments] == pytest.approx([238.0, 147.0, 377.0])
    assert [(s.last_iter, s.resumed_at) for s in segments] == [(200, 200), (400, 400), (400, None)]
    assert segments_seconds(segments, []) == pytest.approx(762.0)  # not 21 min 49 s


# Killed during the evaluation at 600, after its checkpoint: the iterations 400-600 trained after
# the last line of the first segment count, at metrics.jsonl's seconds per iteration.
LOG_PAST_LAST_LINE = """\
2026-11-23 22:17:36,240 INFO training maskrcnn for 800 iterations into 'x'
2026-11-23 22:23:58,240 INFO evaluation at iteration 400:
2026-11-23 22:35:43,501 INFO resumed from 'x/checkpoints/model_0000600.pth' at iteration 600
2026-11-23 22:35:43,513 INFO training maskrcnn for 800 iterations into 'x'
2026-11-23 22:35:53,501 INFO evaluation at iteration 600:
2026-11-23 22:37:29,501 INFO final evaluation (100 images):
"""


def test_iterations_trained_past_a_segments_last_line_count() -> None:
    segments = log_segments(LOG_PAST_LAST_LINE)
    assert [(s.last_iter, s.resumed_at) for s in segments] == [(400, 600), (600, None)]
    records = [{"type": "train", "iter": it, "time": 1.0} for it in range(100, 801, 100)]
    records += [{"type": "train", "iter": 700, "time": 9.0}]  # logged again after the resume
    records += [{"type": "eval", "iter": 400}, {"type": "train", "iter": 500, "time": "x"}]
    # 382 s and 106 s of the two segments, and iterations 401-600 at 1 s each
    assert segments_seconds(segments, records) == pytest.approx(382.0 + 106.0 + 200.0)


def finished_dir(root: Path, name: str, log: str | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "eval.json").write_text("{}")
    if log is not None:
        (path / "log.txt").write_text(log)
    return path


def test_run_time_from_log_or_the_times_file(tmp_path: Path) -> None:
    records = [{"run": "ft/a_s1", "seconds": 100.0, "jobs": 1}]
    with_log = finished_dir(tmp_path, "with_log", LOG)
    timed = run_time(with_log, records, jobs=2)
    assert (timed.seconds, timed.source, timed.jobs) == (762.0, "log.txt", 1)
    no_log = finished_dir(tmp_path, "no_log")
    timed = run_time(no_log, [{"seconds": 50.0}, {"seconds": 70.0}], jobs=2)
    assert (timed.seconds, timed.source, timed.jobs) == (120.0, "study_times.jsonl", 2)
    assert run_time(no_log, [], jobs=2) is None


def test_regime_time_counts_finished_runs_and_shares_the_machine(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    finished_dir(out / "ft", "a_s1", LOG)  # 762 s, its record says 1 job
    finished_dir(out / "ft", "b_s1", LOG)  # 762 s, not recorded: the usual 2 jobs
    finished_dir(out / "ft", "c_s1")  # no log, no record
    (out / "ft" / "d_s1").mkdir()  # not finished: not counted
    (out / "ft" / "d_s1" / "log.txt").write_text(LOG)
    lines = [{"run": "ft/a_s1", "seconds": 10.0, "jobs": 1}]
    lines += [{"run": f"x/{i}", "seconds": 1.0, "jobs": 2} for i in range(3)]
    (out / "study_times.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines) + '{"run": "cut'
    )
    times = read_times_file(out / "study_times.jsonl")
    assert usual_jobs(times, 1) == 2 and usual_jobs({}, 1) == 1 and usual_jobs({}, 2) == 2
    row = regime_time(out, "ft", times, usual_jobs(times, 1))
    assert len(row.runs) == 2 and row.untimed == ("ft/c_s1",)  # a_s1 and b_s1 timed
    assert row.hours == pytest.approx(1524 / 3600)
    assert row.machine_hours == pytest.approx((762 + 381) / 3600)
    table = time_table([row])
    assert table[2] == "| ft | 3 | 2 | 0 | 0.4 | 0.3 |"
    assert table[3] == "| **all** | 3 | 2 | 0 | 0.4 | 0.3 |"


# ---- the report ---------------------------------------------------------------------------


def write_run(out: Path, name: str, box: float, mask: float, saved: float, dropit: dict) -> None:
    """A finished run directory under ``out``: config, eval, memory, metrics and log."""
    path = out / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(json.dumps({"name": name, "dropit": dropit}))
    aps = {"bbox": {"AP": box / 100}, "segm": {"AP": mask / 100}}
    (path / "eval.json").write_text(json.dumps({**aps, "iter": 8}))
    (path / "memory.json").write_text(json.dumps({"saved_mb": saved}))
    records = [{"type": "train", "iter": 4, "loss": 1.0}, {"type": "eval", "iter": 8, **aps}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "log.txt").write_text(LOG)


def study_plan(tmp_path: Path) -> Plan:
    out = tmp_path / "runs"
    dropit = {"enabled": True, "strategy": "mink", "gamma": 0.8}
    runs = [
        ("baseline_s1", 80.0, 70.0, 10.0, {"enabled": False}),
        ("baseline_s2", 81.0, 71.0, 20.0, {"enabled": False}),
        ("mink_0.8_s1", 78.0, 69.0, 5.0, dropit),
        ("mink_0.8_s2", 80.0, 71.0, 6.0, dropit),
        ("baseline_2x_s1", 83.0, 74.0, 10.0, {"enabled": False}),
        ("mink_0.8_2x_s1", 82.0, 73.0, 5.0, dropit),
        ("mink_0.8_2x_s2", 82.0, 73.0, 5.0, dropit),
    ]
    for name, box, mask, saved, d in runs:
        write_run(out / "finetune2", name, box, mask, saved, d)
    report = tmp_path / "results" / "shapes.md"
    report.parent.mkdir()
    (report.parent / BENCH_FILE).parent.mkdir()
    (report.parent / BENCH_FILE).write_text(
        bench_json({"setting": "mink_0.8", "saved_ratio": 0.25, "peak_ratio": 0.62})
    )
    notes = tmp_path / "results" / "notes.template.md"
    notes.write_text(
        "## Findings\n\nmink: Δ {{d finetune2/mink_0.8 box}}, {{saved finetune2/mink_0.8}}.\n"
    )
    return Plan(
        out=out,
        report=report,
        regimes={"finetune2": "configs/study/finetune2.yaml"},
        settings={
            s: () for s in ("baseline", "mink_0.8", "baseline_2x", "mink_0.8_2x", "quant_4bit")
        },
        groups=(
            Group(("finetune2",), ("baseline", "mink_0.8"), (1, 2, 3, 4, 5)),
            Group(("finetune2",), ("baseline_2x", "mink_0.8_2x"), (1,)),
            Group(("finetune2",), ("quant_4bit",), (1, 2, 3)),
        ),
        notes=notes,
    )


def test_ap_table_pairs_2x_rows_with_their_baseline_and_saved_by_seed(tmp_path: Path) -> None:
    from instruments.measure.study_report import regime_runs

    plan = study_plan(tmp_path)
    rows = ap_table(regime_runs(plan.out, "finetune2"), plan)
    assert "| mink_0.8 | 1,2 | 79.0 ± 1.4 | 70.0 ± 1.4 | -1.5 [-7.9, +4.9] (n=2) " in rows[3]
    assert rows[3].endswith("| 0.40x |")  # (5/10 + 6/20) / 2, not 5.5/15 = 0.37x
    assert rows[4] == "| baseline_2x | 1 | 83.0 | 74.0 |  |  | 1.00x |"
    assert rows[5] == (
        "| mink_0.8_2x | 1,2 | 82.0 ± 0.0 | 73.0 ± 0.0 | -1.0 (1 seed) vs baseline_2x "
        "| -1.0 (1 seed) vs baseline_2x | 0.50x |"
    )


def test_head_to_head_pairs_a_setting_with_another_of_the_same_seed(tmp_path: Path) -> None:
    import dataclasses

    from instruments.measure.study_report import pairs_table, regime_runs

    plan = dataclasses.replace(
        study_plan(tmp_path), pairs=(("mink_0.8", "mink_0.8_2x"), ("mink_0.8", "quant_4bit"))
    )
    found = regime_runs(plan.out, "finetune2")
    rows = pairs_table(found, plan)
    # box 78, 80 against 82, 82 (seeds 1, 2): Δ -4, -2, mean -3, sd 1.41, t(1) 12.71 x 1.0;
    # quant_4bit has no run, so its pair has no row
    assert rows[2:] == [
        "| setting | other | seeds | Δ box | Δ mask |",
        "|---|---|---|---|---|",
        "| mink_0.8 | mink_0.8_2x | 1,2 | -3.0 [-15.7, +9.7] (n=2) (inconclusive) "
        "| -3.0 [-15.7, +9.7] (n=2) (inconclusive) |",
        "",
    ]
    assert pairs_table(found, dataclasses.replace(plan, pairs=())) == []


def test_study_report_renders_notes_verdict_goal_and_time(tmp_path: Path) -> None:
    plan = study_plan(tmp_path)
    text = write_study_report(plan, "plan.yaml", jobs=2)
    notes = (tmp_path / "results" / "notes.md").read_text()
    assert notes.startswith("_Generated by `python tools/study.py --plan plan.yaml --jobs 2 ")
    assert "edit the template, not this file._" in notes.splitlines()[0]
    assert "mink: Δ -1.5 [-7.9, +4.9], 0.40x." in notes
    assert "mink: Δ -1.5 [-7.9, +4.9], 0.40x." in text
    assert text.index("## Verdict") < text.index("## Goal") < text.index("## Findings")
    assert "| mink_0.8 | 2 of 5 | -1.5 [-7.9, +4.9] | **inconclusive** |" in text
    assert "| mink_0.8_2x | 1 of 1 | -1.0 | **1 seed: no interval** |" in text
    assert "| quant_4bit | 0 of 3 | - | - | - | - | not measured yet |" in text
    assert (
        "| mink_0.8 | **no**: 2 seeds |" in text and "| yes: 0.25x | yes: 0.62x | not met |" in text
    )
    assert "**No setting meets the goal** in `finetune2`" in text
    assert "![finetune2: Δ AP vs peak memory](figures/shapes_finetune2_peak_vs_ap.png)" in text
    figure = tmp_path / "results" / "figures" / "shapes_finetune2_peak_vs_ap.png"
    assert figure.stat().st_size > 1000
    assert "| finetune2 | 7 | 7 | 0 | 1.5 | 0.7 |" in text  # 7 runs x 762 s, 2 jobs each


def test_a_bad_placeholder_stops_the_report_with_its_name(tmp_path: Path) -> None:
    plan = study_plan(tmp_path)
    plan.notes.write_text("## Findings\n\n{{d finetune2/mink_0.9 box}}\n")
    with pytest.raises(NotesError, match=r"notes\.template\.md:3: '\{\{d finetune2/mink_0\.9 box"):
        write_study_report(plan, "plan.yaml", jobs=2)


# ---- what users read: the choice table and the README block -------------------------------


def test_choice_table_puts_the_interval_beside_the_bench() -> None:
    from instruments.report.choice import choice_table

    bench = {"mink": {"saved_ratio": 0.27, "peak_ratio": 0.61, "step_ratio": 1.33}}
    rows = choice_table(FOUND["ft"], ["baseline", "mink", "mink_2x"], bench, {"mink": "all"})
    assert rows[2] == (
        "| mink | all | 3 | -1.5 [-2.7, -0.3] | -0.3 [-2.2, +1.6] | inconclusive "
        "| 0.27x | 0.61x | 1.33x |"
    )
    # the 2x row pairs with baseline_2x (one shared seed), is not benched, and has no label
    assert rows[3] == "| mink_2x | ? | 1 | -1.0 | -1.0 | 1 seed: no interval | - | - | - |"
    assert len(rows) == 4  # baselines are no rows


def test_other_regimes_list_the_settings_paired_on_enough_seeds() -> None:
    from instruments.report.choice import other_regime_lines

    # "long": 3 seeds of 4-bit, box Δ -0.5 [-1.2, +0.2], mask Δ +0.0 [-0.5, +0.5]
    lines = other_regime_lines(FOUND, "ft", 3)
    assert lines[0].startswith("**Other regimes, at 3 seeds or more**")
    assert lines[4] == (
        "| long | quant | 8 | 3 | -0.5 [-1.2, +0.2] (inconclusive) | +0.0 [-0.5, +0.5] (keeps) |"
    )
    assert len(lines) == 5  # the goal's regime, baselines and fewer seeds are no rows
    assert other_regime_lines(FOUND, "ft", 4) == []


def test_choice_names_the_recommended_setting_and_its_config(tmp_path: Path) -> None:
    from instruments.measure.study_report import choice_lines

    plan = study_plan(tmp_path)
    mink, base = five_seeds([-2.0, -1.0, -1.5, -0.5, -1.0], [0.0] * 5)
    config = tmp_path / "maskrcnn_g0.8.yaml"
    plan = dataclasses.replace(plan, configs={"mink_0.8": config})
    text = "\n".join(choice_lines({"baseline": base, "mink_0.8": mink}, plan))
    assert text.startswith(
        f"**The study recommends `mink_0.8`**: its COCO config is `{config.as_posix()}` (the "
        "study ran on generated shapes, so the COCO figures are still to be measured). Why: no "
        "setting meets the goal; of those that cover every layer with 5 seeds within the memory "
        "bounds, its intervals leave open the smallest AP loss (box -1.2 [-1.9, -0.5], "
        "mask +0.0 [+0.0, +0.0]: at worst -1.9)."
    )
    plan = dataclasses.replace(plan, configs={})
    text = "\n".join(choice_lines({"baseline": base, "mink_0.8": mink}, plan))
    assert "no config trains it yet (name one under `configs:` in the study plan)" in text


def test_replace_block_keeps_the_rest_and_names_a_file_without_markers() -> None:
    from instruments.report.choice import BEGIN, END, replace_block

    text = f"# Title\n\nbefore\n{BEGIN}\nold 1\nold 2\n{END}\nafter\n"
    new = replace_block(text, ["new"], "README.md")
    assert new == f"# Title\n\nbefore\n{BEGIN}\nnew\n{END}\nafter\n"
    assert replace_block(new, ["new"], "README.md") == new
    with pytest.raises(UsageError, match="README.md: no generated block to update"):
        replace_block("# Title\n", ["new"], "README.md")


def test_study_report_rewrites_the_readme_block(tmp_path: Path) -> None:
    from instruments.report.choice import BEGIN, END

    plan = study_plan(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Tool\n\n{BEGIN}\nstale\n{END}\n\n## More\n")
    plan = dataclasses.replace(plan, readme=readme)
    write_study_report(plan, "plan.yaml", jobs=2)
    text = readme.read_text()
    assert text.startswith(f"# Tool\n\n{BEGIN}\n**No recommendation yet:** no setting that")
    assert "\n\nRegime `finetune2` of the accuracy study" in text
    assert text.endswith(f"{END}\n\n## More\n") and "stale" not in text
    assert "| mink_0.8 | all | 2 | -1.5 [-7.9, +4.9] | -0.5 [-6.9, +5.9] | inconclusive " in text
    assert "| 0.25x | 0.62x | - |" in text  # no step_ratio in this bench file
    assert "**No setting meets the goal** (every layer" in text
    assert "**No recommendation yet:** no setting that covers every layer has 5 seeds" in text
    assert "[results/shapes.md](results/shapes.md)" in text  # relative to the README

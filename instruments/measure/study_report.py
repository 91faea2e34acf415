"""The accuracy study's report: per regime, AP over seeds, paired differences, figures, the
verdict by interval, the goal (a DropIT setting on every layer that keeps AP), the time account
and the findings rendered from their template."""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from instruments.measure.methods_table import methods_by_setting
from instruments.measure.study_plan import PRETRAIN, TIMES_FILE, Plan, plan_runs
from instruments.report.choice import choice_table, other_regime_lines, replace_block
from instruments.report.goal import (
    BENCH_FILE,
    Bench,
    Goal,
    covers_every_layer,
    goal_section,
    recommend,
    settings_meeting_goal,
    with_schedules,
)
from instruments.report.notes import Sources, grad_groups_file, render
from instruments.report.seeded import (
    BASELINE,
    Regime,
    ap_text,
    baseline_of,
    baseline_runs,
    is_reference,
    paired,
    paired_text,
    saved_ratio,
)
from instruments.report.time_account import (
    finished_run_dirs,
    read_times_file,
    regime_time,
    time_table,
    usual_jobs,
)
from instruments.report.verdict import FAMILIES, TOLERANCE, family_state, verdict_table
from rcnn_dropit.atomic import write_atomic
from rcnn_dropit.report import figures
from rcnn_dropit.report.groups import Row
from rcnn_dropit.report.paired import PairedDiff
from rcnn_dropit.report.runs import Run, RunNotUsable, load_run

GOAL = Goal()
# The report's figures: drawn into this folder beside it and linked from it by this path
FIGURES = "figures"
TEMPLATE_SUFFIX = ".template.md"
PAPER = (
    "The paper (Chen et al., ICLR 2023) reports parity or better on COCO: Mask R-CNN R50-FPN "
    "37.9 / 34.5 box / mask AP, with DropIT mink at gamma 0.8 38.5 / 34.5; Faster R-CNN 37.0, "
    "with mink at 0.9 37.2; and ResNet-18 trained from scratch on CIFAR-100 77.96 -> 78.78 top-1 "
    "with parallel min-k at 0.8."
)


def regime_runs(out: Path, regime: str) -> dict[str, dict[int, Run]]:
    """Finished runs of a regime: setting -> seed -> run (unfinished ones left out)."""
    found: dict[str, dict[int, Run]] = {}
    for run_dir in finished_run_dirs(out, regime):
        setting, sep, seed = run_dir.name.rpartition("_s")
        if not sep or not seed.isdigit():
            continue
        try:
            run = load_run(run_dir)
        except RunNotUsable:
            continue
        found.setdefault(setting, {})[int(seed)] = run
    return found


def _diff_text(d: PairedDiff | None) -> str:
    if d is None:
        return "-"
    return paired_text(d) + (" (1 seed)" if d.low is None else f" (n={d.n})")


def _order(settings: Sequence[str], plan: Plan) -> list[str]:
    """Baseline first, then plan order, then anything else found on disk."""
    known = [s for s in plan.settings if s in settings]
    rest = sorted(s for s in settings if s not in plan.settings)
    return sorted(known, key=lambda s: s != BASELINE) + rest


def ap_table(found: Regime, plan: Plan) -> list[str]:
    """Mean ± std over seeds and the paired difference to the setting's baseline, box and mask;
    saved activations as the mean over seeds of each seed's ratio to its baseline's."""
    lines = [
        "| setting | seeds | box AP | mask AP | Δ box (paired, 95% CI) | Δ mask (paired, 95% CI) "
        "| saved activations |",
        "|---|---|---:|---:|---|---|---:|",
    ]
    for setting in _order(list(found), plan):
        runs = found[setting]
        seeds = ",".join(str(s) for s in sorted(runs))
        ref = baseline_of(setting, [*plan.settings, *found])
        base = found.get(ref, {}) if ref else runs
        saved = "-" if (ratio := saved_ratio(runs, base)) is None else f"{ratio:.2f}x"
        if ref is None:
            diffs = ["", ""]
        elif not set(runs) & set(base):  # no ratio either: it pairs by seed too
            diffs = [f"- (no {ref} run of the same seed)"] * 2
        else:
            diffs = [_diff_text(paired(runs, base, fam)) for fam, _ in FAMILIES]
            diffs = [d if ref == BASELINE else f"{d} vs {ref}" for d in diffs]
        aps = [ap_text(runs, family) or "-" for family, _ in FAMILIES]
        lines.append(f"| {setting} | {seeds} | {' | '.join([*aps, *diffs, saved])} |")
    return lines


def pairs_table(found: Regime, plan: Plan) -> list[str]:
    """The plan's head-to-head pairs found in a regime: each setting against the other setting
    of the same seed (not the baseline), box and mask, with the verdict's states."""
    rows = []
    for setting, other in plan.pairs:
        runs, ref = found.get(setting, {}), found.get(other, {})
        if not set(runs) & set(ref):
            continue
        seeds = ",".join(str(s) for s in sorted(set(runs) & set(ref)))
        diffs = [paired(runs, ref, family) for family, _ in FAMILIES]
        cells = [f"{_diff_text(d)} ({family_state(d)})" if d else "-" for d in diffs]
        rows.append(f"| {setting} | {other} | {seeds} | {cells[0]} | {cells[1]} |")
    if not rows:
        return []
    return [
        "Head to head: a setting against another of the same seed (Δ = setting - other, 95% "
        "interval, read as the verdict reads Δ to the baseline):",
        "",
        "| setting | other | seeds | Δ box | Δ mask |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def training_table(found: Regime, plan: Plan) -> list[str]:
    """Box / mask AP (mean over seeds) at every evaluated iteration, per setting."""
    iters = sorted({it for runs in found.values() for r in runs.values() for it, _ in r.evals})
    if len(iters) < 2:
        return []
    lines = [
        "| setting | " + " | ".join(f"iter {it}" for it in iters) + " |",
        "|---|" + "---:|" * len(iters),
    ]
    for setting in _order(list(found), plan):
        cells = []
        for it in iters:
            points = [aps for r in found[setting].values() for i, aps in r.evals if i == it]
            box = [p["bbox"] * 100 for p in points if "bbox" in p]
            mask = [p["segm"] * 100 for p in points if "segm" in p]
            cells.append(
                f"{sum(box) / len(box):.1f} / {sum(mask) / len(mask):.1f}" if box and mask else "-"
            )
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return lines


def planned_seeds(plan: Plan, regime: str, setting: str) -> int:
    """How many seeds the plan trains of a setting in a regime."""
    seeds = {
        s for g in plan.groups if regime in g.regimes and setting in g.settings for s in g.seeds
    }
    return len(seeds)


def regime_settings(found: Regime, plan: Plan, regime: str) -> list[str]:
    """The settings the plan trains in a regime or that have runs there, in report order."""
    planned = [s for s in plan.settings if planned_seeds(plan, regime, s)]
    return _order(list(dict.fromkeys([*planned, *found])), plan)


def verdict(found: Regime, regime: str, plan: Plan) -> list[str]:
    """The regime's verdict table: every setting's box and mask state by its paired interval."""
    settings = regime_settings(found, plan, regime)
    if not any(not is_reference(s) for s in settings):
        return []
    return [
        f"### {regime}",
        "",
        *verdict_table(found, settings, lambda s: planned_seeds(plan, regime, s)),
        "",
    ]


def _rows(found: Regime, plan: Plan, keep: Sequence[str]) -> list[Row]:
    order = [s for s in _order(list(found), plan) if s in keep]
    return [Row(s, tuple(found[s][seed] for seed in sorted(found[s]))) for s in order]


def _figures(found: Regime, plan: Plan, regime: str, figure_dir: Path) -> list[str]:
    if not figures.matplotlib_available():
        return ["Figures not drawn: matplotlib is not installed (`pip install .[plot]`).", ""]
    lines = []
    main = [s for s in found if s == BASELINE or re.fullmatch(r"[a-z_]+_0\.8", s)]
    loss_png = figure_dir / f"shapes_{regime}_loss.png"
    if figures.plot_loss_curves(_rows(found, plan, main), loss_png):
        lines += [f"![{regime}: training loss]({FIGURES}/{loss_png.name})", ""]
    rows = _rows(found, plan, [s for s in found if s == BASELINE or s.startswith("mink_0.")])
    gamma_png = figure_dir / f"shapes_{regime}_ap_vs_gamma.png"
    base = next((r for r in rows if r.label == BASELINE), None)
    mink = [r for r in rows if r.label != BASELINE and r.label.count("_") == 1]
    if figures.plot_ap_vs_gamma(mink, base, gamma_png):
        lines += [f"![{regime}: AP vs gamma]({FIGURES}/{gamma_png.name})", ""]
    return lines


def _grad_groups(path: Path) -> list[str]:
    """The per-group gradient fidelity tables of ``tools/grad_groups.py``, when it was run."""
    if not path.is_file():
        return []
    from instruments.measure.grad_groups import markdown_table

    data = json.loads(path.read_text())
    run = data.pop("run")
    lines = [
        "Where the weight gradient bends: per layer group, cosine / norm ratio of the DropIT "
        f"weight gradient to the exact one on `{run}`'s weights and 4 of its training batches "
        f"(`python tools/grad_groups.py --run {run} --json {path.as_posix()}`):",
        "",
    ]
    for state, result in data.items():
        lines += [
            f"At {'initialisation' if state == 'init' else state}:",
            "",
            *markdown_table(result),
            "",
        ]
    return lines


def time_account(plan: Plan, jobs: int) -> list[str]:
    """The time the finished runs took, per regime, from their own logs (see time_account);
    ``jobs`` counts for runs without a record when there are no records at all."""
    times = read_times_file(plan.out / TIMES_FILE)
    jobs = usual_jobs(times, jobs)
    rows = [regime_time(plan.out, r, times, jobs) for r in [PRETRAIN, *plan.regimes]]
    rows = [row for row in rows if row.runs or row.untimed]
    if not rows:
        return []
    untimed = [u for row in rows for u in row.untimed]
    return [
        "Time, from each finished run's own `log.txt`: the sum of its segments (a resumed run "
        "has one per start), each from its start line to its last timestamped line, plus the "
        "iterations it trained past that line up to the checkpoint the next segment resumed "
        "from (at the seconds per iteration of `metrics.jsonl`); a run without a log counts "
        f"its records in `{TIMES_FILE}`. The machine's hours divide each "
        f"run's time by the runs side by side with it: the `jobs` of its `{TIMES_FILE}` record, "
        f"or {jobs} (what most records name) for a run not recorded there, assuming the runs "
        "shared the cores equally throughout.",
        "",
        *time_table(rows),
        "",
        *([f"Not timed (no log.txt, no record): {', '.join(untimed)}.", ""] if untimed else []),
    ]


def found_runs(plan: Plan) -> dict[str, Regime]:
    """Every regime's finished runs, and the study's pretraining as regime and setting
    ``pretrain`` (seed 0), for the notes' placeholders."""
    found = {regime: regime_runs(plan.out, regime) for regime in plan.regimes}
    try:
        found[PRETRAIN] = {PRETRAIN: {0: load_run(plan.out / PRETRAIN / PRETRAIN)}}
    except RunNotUsable:
        pass
    return found


def _goal_bench(found: Regime, plan: Plan) -> tuple[Path, list[str], Bench | None]:
    """The R50-FPN bench's path, the goal regime's settings in report order, and the bench's
    figures with an entry for each longer schedule."""
    bench_path = plan.report.parent / BENCH_FILE
    order = regime_settings(found, plan, GOAL.regime)
    return bench_path, order, with_schedules(methods_by_setting(bench_path), order)


def goal_lines(found: Regime, plan: Plan, figure_dir: Path) -> list[str]:
    """The goal judged in its regime, with the Δ AP vs peak memory figure (into ``figure_dir``)."""
    bench_path, order, bench = _goal_bench(found, plan)
    if GOAL.regime not in plan.regimes:
        return [f"The goal's regime `{GOAL.regime}` is not in this plan.", ""]
    lines = [*goal_section(found, order, bench, bench_path, GOAL), ""]
    if bench is None:
        return lines
    points = []
    for setting in order:
        ref = baseline_of(setting, [*plan.settings, *found])
        if setting not in bench or ref is None or setting not in found:
            continue
        diffs = {
            fam: d for fam, _ in FAMILIES if (d := paired(found[setting], found.get(ref, {}), fam))
        }
        if diffs:
            points.append((setting, float(bench[setting]["peak_ratio"]), diffs))
    png = figure_dir / f"shapes_{GOAL.regime}_peak_vs_ap.png"
    if not points:
        return [*lines, "No Δ AP vs peak memory figure: no benched setting has paired runs.", ""]
    if not figures.matplotlib_available():
        return [*lines, "Δ AP vs peak memory not drawn: matplotlib is not installed.", ""]
    png.parent.mkdir(parents=True, exist_ok=True)
    figures.plot_peak_vs_ap(points, png, GOAL.tolerance, GOAL.peak)
    return [*lines, f"![{GOAL.regime}: Δ AP vs peak memory]({FIGURES}/{png.name})", ""]


def _layers(config: dict) -> str:
    """What a run's memory method reaches: every layer the paper converts, some, or the
    checkpointed stages (recomputed exactly, no DropIT)."""
    if covers_every_layer(config):
        return "all"
    recompute = (config.get("model") or {}).get("activation_checkpointing")
    if recompute and not (config.get("dropit") or {}).get("enabled"):
        return "recomputed"
    return "some"


def choice_lines(found: Regime, plan: Plan) -> list[str]:
    """The goal regime's settings with their AP cost by interval and their bench memory and time,
    ending with which setting (if any) meets the goal."""
    bench_path, order, bench = _goal_bench(found, plan)
    layers = {s: _layers(next(iter(r.values())).config) for s, r in found.items() if r}
    met = settings_meeting_goal(found, order, bench, GOAL)
    seeds = max((len(r) for s, r in found.items() if not is_reference(s)), default=0)
    criteria = (
        f"every layer, box and mask intervals inside ±{GOAL.tolerance:g} AP at {GOAL.seeds} "
        f"seeds, <= {GOAL.saved:.2f}x saved, <= {GOAL.peak:.2f}x peak"
    )
    answer = (
        f"**Meets the goal** ({criteria}): {', '.join(met)}."
        if met
        else f"**No setting meets the goal** ({criteria} of the R50-FPN step)."
    )
    return [
        *_recommendation_lines(found, order, bench, plan),
        f"Regime `{GOAL.regime}` of the accuracy study (Mask R-CNN fine-tuned on generated "
        f"shapes, up to {seeds} seeds, each paired with the baseline of its seed); `layers`: "
        "`all` when the method reaches every layer the paper converts, `recomputed` for "
        "checkpointed ResNet stages. The verdict reads the 95% "
        f"interval: **keeps** AP when it lies inside ±{GOAL.tolerance:g}; **no loss beyond "
        f"{GOAL.tolerance:g} AP** when every lower end is above -{GOAL.tolerance:g} but an upper "
        f"end passes +{GOAL.tolerance:g}. Saved, peak and step "
        f"time are ratios to the baseline on the R50-FPN bench (`{bench_path}`"
        + (", not measured yet" if bench is None else _baseline_words(bench))
        + ").",
        "",
        *choice_table(found, order, bench, layers),
        "",
        answer,
    ]


def _baseline_words(bench: Bench) -> str:
    """Which baseline the bench's ratios are against, from the bench's own records."""
    amp = (bench.get("baseline") or {}).get("amp", "none")
    if amp in (None, "none"):
        return (
            "; fp32, where the toolkit's FrozenBatchNorm2d and torchvision's give the same bits, "
            "so the ratios hold against either"
        )
    return (
        f"; autocast {amp}, against the toolkit's lean FrozenBatchNorm2d, which keeps "
        "activations in that dtype where torchvision's promotes them to fp32"
    )


def _recommendation_lines(
    found: Regime, order: Sequence[str], bench: Bench | None, plan: Plan
) -> list[str]:
    """What the study recommends (``goal.recommend``'s rule) and the config that trains it."""
    rec = recommend(found, order, bench, GOAL)
    if rec is None:
        return [
            f"**No recommendation yet:** no setting that covers every layer has {GOAL.seeds} "
            f"seeds at <= {GOAL.saved:.2f}x saved and <= {GOAL.peak:.2f}x peak.",
            "",
        ]
    config = plan.configs.get(rec.setting)
    where = (
        f"its COCO config is `{config.as_posix()}` (the study ran on generated shapes, so the "
        "COCO figures are still to be measured)"
        if config
        else "no config trains it yet (name one under `configs:` in the study plan)"
    )
    base = baseline_runs(found, rec.setting)
    cells = ", ".join(
        f"{word} {paired_text(d)}"
        for family, word in FAMILIES
        if (d := paired(found[rec.setting], base, family)) is not None
    )
    why = (
        "it meets the goal, and of the settings that do, it has the lowest peak"
        if rec.meets_goal
        else f"no setting meets the goal; of those that cover every layer with {GOAL.seeds} "
        f"seeds within the memory bounds, its intervals leave open the smallest AP loss "
        f"({cells}: at worst {rec.worst_low:+.1f})"
    )
    return [f"**The study recommends `{rec.setting}`**: {where}. Why: {why}.", ""]


def readme_with_choice(plan: Plan, lines: Sequence[str]) -> str | None:
    """``plan.readme``'s text with its study-choice block made of ``lines`` (None when the plan
    names no readme)."""
    if plan.readme is None:
        return None
    report_link = Path(os.path.relpath(plan.report, plan.readme.parent)).as_posix()
    block = [
        *lines,
        "",
        f"The full report, with every regime and figure: [{report_link}]({report_link}).",
    ]
    return replace_block(plan.readme.read_text(), block, str(plan.readme))


def rendered_notes_path(plan: Plan) -> Path | None:
    """Where the notes are written rendered: a template (``*.template.md``) next to itself,
    without ``.template``; None for notes that are not a template (or no notes)."""
    if plan.notes is None or not plan.notes.name.endswith(TEMPLATE_SUFFIX):
        return None
    return plan.notes.with_name(plan.notes.name[: -len(TEMPLATE_SUFFIX)] + ".md")


def finished_runs_sentence(plan: Plan) -> str:
    """How many planned runs finished, the pretraining included, each counted as the time
    table counts it (a folder with ``eval.json``), and the finished runs the plan does not name,
    which the time table counts as well: so the sentence and the table's total agree."""
    runs = plan_runs(plan)
    planned = {r.name for r in runs}
    finished = {
        f"{regime}/{d.name}"
        for regime in dict.fromkeys([PRETRAIN, *plan.regimes])
        for d in finished_run_dirs(plan.out, regime)
    }
    done = [r for r in runs if r.name in finished]
    text = f"{len(done)} of {len(runs)} planned runs finished"
    pretraining = [r for r in runs if r.exports]
    if pretraining:
        in_regimes = [r for r in runs if not r.exports]
        done_in_regimes = sum(1 for r in done if not r.exports)
        pre = "the backbone pretraining" if pretraining[0] in done else "not the pretraining"
        text += f" ({pre}, and {done_in_regimes} of {len(in_regimes)} runs in the regimes)"
    text += "."
    extra = sorted(finished - planned)
    if extra:
        text += (
            f" The time table also counts {len(extra)} finished "
            f"run{'' if len(extra) == 1 else 's'} that the plan does not name: "
            + ", ".join(extra)
            + "."
        )
    return text


@dataclass(frozen=True)
class StudyPages:
    """The texts the report tool writes: the report, the readme with its study-choice block
    (None without a readme) and the rendered notes file (None without a notes template)."""

    report: str
    readme: str | None
    notes: str | None


def render_study_report(
    plan: Plan, plan_path: str | Path, jobs: int, figure_dir: Path | None = None
) -> StudyPages:
    """The report's pages from the runs on disk, written nowhere; only its figures are drawn,
    into ``figure_dir`` (by default FIGURES beside the report; the links say FIGURES/NAME)."""
    import torch  # here: for its version; the tables need no torch

    figure_dir = figure_dir or plan.report.parent / FIGURES
    figure_dir.mkdir(parents=True, exist_ok=True)
    command = f"python tools/study.py --plan {plan_path} --jobs {jobs}"
    found = found_runs(plan)
    lines = [
        "# Accuracy study on the synthetic shapes set",
        "",
        f"Produced by `{command}` (`make study`; `--report-only` writes this report alone) on "
        f"{platform.machine()} {platform.system()}, torch {torch.__version__}; run directories "
        f"(without checkpoints) under `{plan.out}`. {finished_runs_sentence(plan)}",
        "",
        *time_account(plan, jobs),
        "AP is COCO AP (IoU 0.50:0.95) x100 on the validation images of each regime's shapes set; "
        "± is the standard deviation over seeds. Δ is the mean over seeds of (setting - baseline) "
        "for the same seed, with a 95% Student-t interval over those differences; a run and its "
        "baseline share the seed, so data order and initialisation are paired. A setting trained "
        "on a longer schedule (`*_2x`) pairs with the baseline on that schedule (`baseline_2x`).",
        "",
        PAPER,
        "",
        "## Verdict",
        "",
        f"Read from the paired 95% interval of Δ, for box and mask AP apart: **keeps** when it "
        f"lies inside [-{TOLERANCE:g}, +{TOLERANCE:g}], **loses** when it lies entirely below "
        f"-{TOLERANCE:g}, **gains** when entirely above +{TOLERANCE:g}, **inconclusive** when it "
        f"crosses -{TOLERANCE:g} or +{TOLERANCE:g} ('below 0' / 'above 0' when it excludes 0 "
        "all the same); one seed gives no interval and no verdict. A setting keeps AP when box "
        "and mask both keep it, and loses AP when either loses it.",
        "",
    ]
    body = []
    for regime, config in plan.regimes.items():
        runs = found[regime]
        lines += verdict(runs, regime, plan)
        body += [f"## Regime: {regime} (`{config}`)", ""]
        if not runs:
            body += ["No finished run yet.", ""]
            continue
        body += [*ap_table(runs, plan), "", *pairs_table(runs, plan)]
        training = training_table(runs, plan)
        if training:
            body += [
                "AP during training (box / mask, mean over seeds), evaluated at fixed iterations "
                "of the same schedule:",
                "",
                *training,
                "",
            ]
        body += _figures(runs, plan, regime, figure_dir)
        body += _grad_groups(grad_groups_file(plan.report.parent, regime))
    lines += [
        "## Goal: a DropIT setting on every layer that keeps AP",
        "",
        *goal_lines(found.get(GOAL.regime, {}), plan, figure_dir),
    ]
    choice = choice_lines(found.get(GOAL.regime, {}), plan)
    others = other_regime_lines(found, GOAL.regime, GOAL.seeds)
    choice += ["", *others] if others else []
    lines += ["## Choosing a method", "", *choice, ""]
    notes_file = None
    if plan.notes is not None and plan.notes.is_file():  # the analysis a person wrote
        sources = Sources(found, grad_dir=plan.report.parent)
        notes = render(plan.notes.read_text(), sources, str(plan.notes)).strip()
        lines += [notes, ""]
        if rendered_notes_path(plan) is not None:
            notes_file = (
                f"_Generated by `{command} --report-only` from `{plan.notes}` and the runs under "
                f"`{plan.out}`: edit the template, not this file._\n\n{notes}\n"
            )
    markdown = "\n".join([*lines, "", *body]).rstrip("\n") + "\n"
    return StudyPages(markdown, readme_with_choice(plan, choice), notes_file)


def write_study_report(plan: Plan, plan_path: str | Path, jobs: int) -> str:
    """Write plan.report (and its figures, the readme's study-choice block and the rendered
    notes next to the template); returns the report's Markdown."""
    pages = render_study_report(plan, plan_path, jobs)  # makes the report's folder (figures/)
    plan.report.write_text(pages.report)
    target = rendered_notes_path(plan)
    if target is not None and pages.notes is not None:
        target.write_text(pages.notes)
    readme = pages.readme
    if plan.readme is not None and readme is not None and readme != plan.readme.read_text():
        write_atomic(plan.readme, lambda f: f.write(readme.encode()))
    return pages.report

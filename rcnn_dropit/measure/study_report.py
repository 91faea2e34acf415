"""The accuracy study's report: per regime, AP over seeds, paired differences, figures, verdict."""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Sequence
from pathlib import Path

from rcnn_dropit.measure.study_plan import TIMES_FILE, Plan, plan_runs
from rcnn_dropit.report import figures
from rcnn_dropit.report.groups import Row
from rcnn_dropit.report.paired import PairedDiff, paired_diff, spread
from rcnn_dropit.report.runs import Run, RunNotUsable, load_run

BASELINE = "baseline"
# The paper's claim, checked per regime, and DropIT on the backbone only (where a plan has it).
VERDICT_SETTINGS = ("mink_0.8", "parallel_mink_0.8", "mink_0.8_backbone")
TOLERANCE = 1.0  # AP points: "keeps AP" means within this of the baseline
FAMILIES = (("bbox", "box"), ("segm", "mask"))
PAPER = (
    "The paper (Chen et al., ICLR 2023) reports parity or better on COCO: Mask R-CNN R50-FPN "
    "37.9 / 34.5 box / mask AP, with DropIT mink at gamma 0.8 38.5 / 34.5; Faster R-CNN 37.0, "
    "with mink at 0.9 37.2; and ResNet-18 trained from scratch on CIFAR-100 77.96 -> 78.78 top-1 "
    "with parallel min-k at 0.8."
)


def regime_runs(out: Path, regime: str) -> dict[str, dict[int, Run]]:
    """Finished runs of a regime: setting -> seed -> run (unfinished ones left out)."""
    found: dict[str, dict[int, Run]] = {}
    folder = out / regime
    if not folder.is_dir():
        return found
    for run_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        setting, sep, seed = run_dir.name.rpartition("_s")
        if not sep or not seed.isdigit():
            continue
        try:
            run = load_run(run_dir)
        except RunNotUsable:
            continue
        found.setdefault(setting, {})[int(seed)] = run
    return found


def _ap(run: Run, family: str) -> float | None:
    value = run.metric(family, "AP")
    return None if value is None else value * 100


def _mean_std(runs: dict[int, Run], family: str) -> str:
    s = spread([v for r in runs.values() if (v := _ap(r, family)) is not None])
    if s is None:
        return "-"
    return f"{s.mean:.1f}" + (f" ± {s.std:.1f}" if s.std is not None else "")


def _diff(runs: dict[int, Run], base: dict[int, Run], family: str) -> PairedDiff | None:
    values = {seed: v for seed, r in runs.items() if (v := _ap(r, family)) is not None}
    ref = {seed: v for seed, r in base.items() if (v := _ap(r, family)) is not None}
    return paired_diff(values, ref)


def _diff_text(d: PairedDiff | None) -> str:
    if d is None:
        return "-"
    if d.low is None:
        return f"{d.mean:+.1f} (1 seed)"
    return f"{d.mean:+.1f} [{d.low:+.1f}, {d.high:+.1f}] (n={d.n})"


def _saved_ratio(runs: dict[int, Run], base: dict[int, Run]) -> str:
    mine = [r.saved_mb for r in runs.values() if r.saved_mb]
    ref = [r.saved_mb for r in base.values() if r.saved_mb]
    if not mine or not ref:
        return "-"
    return f"{(sum(mine) / len(mine)) / (sum(ref) / len(ref)):.2f}x"


def _order(settings: Sequence[str], plan: Plan) -> list[str]:
    """Baseline first, then plan order, then anything else found on disk."""
    known = [s for s in plan.settings if s in settings]
    rest = sorted(s for s in settings if s not in plan.settings)
    return sorted(known, key=lambda s: s != BASELINE) + rest


def ap_table(found: dict[str, dict[int, Run]], plan: Plan) -> list[str]:
    """Mean ± std over seeds and the paired difference to the baseline, box and mask."""
    base = found.get(BASELINE, {})
    lines = [
        "| setting | seeds | box AP | mask AP | Δ box (paired, 95% CI) | Δ mask (paired, 95% CI) "
        "| saved activations |",
        "|---|---|---:|---:|---|---|---:|",
    ]
    for setting in _order(list(found), plan):
        runs = found[setting]
        seeds = ",".join(str(s) for s in sorted(runs))
        diffs = [
            "" if setting == BASELINE else _diff_text(_diff(runs, base, fam)) for fam, _ in FAMILIES
        ]
        lines.append(
            f"| {setting} | {seeds} | {_mean_std(runs, 'bbox')} | {_mean_std(runs, 'segm')} "
            f"| {diffs[0]} | {diffs[1]} | {_saved_ratio(runs, base) if base else '-'} |"
        )
    return lines


def training_table(found: dict[str, dict[int, Run]], plan: Plan) -> list[str]:
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


def verdict(found: dict[str, dict[int, Run]], regime: str, plan: Plan) -> list[str]:
    """One plain sentence per checked setting: within TOLERANCE of the baseline or not."""
    base = found.get(BASELINE)
    lines = []
    for setting in VERDICT_SETTINGS:
        runs = found.get(setting)
        if setting not in VERDICT_SETTINGS[:2] and not planned_seeds(plan, regime, setting):
            continue  # an extra setting this regime does not train
        if not base or not runs:
            lines.append(f"- {regime}, {setting}: not measured yet.")
            continue
        parts, keeps = [], True
        for family, word in FAMILIES:
            d = _diff(runs, base, family)
            if d is None:
                keeps = False
                parts.append(f"{word} AP not paired")
                continue
            keeps &= abs(d.mean) <= TOLERANCE
            parts.append(f"{word} AP {_diff_text(d)}")
        n = len(set(runs) & set(base))
        answer = "keeps AP" if keeps else "does NOT keep AP"
        planned = planned_seeds(plan, regime, setting)
        if n < planned:  # one seed's difference is within the spread between seeds
            answer = f"provisional, {n} of {planned} seeds: {answer} so far"
        lines.append(
            f"- {regime}, {setting}: **{answer}** (mean paired difference within ±{TOLERANCE:g} "
            f"is the goal; {'; '.join(parts)})."
        )
    return lines


def _rows(found: dict[str, dict[int, Run]], plan: Plan, keep: Sequence[str] = ()) -> list[Row]:
    return [
        Row(s, tuple(found[s][seed] for seed in sorted(found[s])))
        for s in _order(list(found), plan)
        if not keep or s in keep
    ]


def _figures(found: dict[str, dict[int, Run]], plan: Plan, regime: str, out: Path) -> list[str]:
    if not figures.matplotlib_available():
        return ["Figures not drawn: matplotlib is not installed (`pip install .[plot]`).", ""]
    lines = []
    main = [s for s in found if s == BASELINE or re.fullmatch(r"[a-z_]+_0\.8", s)]
    loss_png = out.parent / f"shapes_{regime}_loss.png"
    if figures.plot_loss_curves(_rows(found, plan, main), loss_png):
        lines += [f"![{regime}: training loss]({loss_png.name})", ""]
    rows = _rows(found, plan, [s for s in found if s == BASELINE or s.startswith("mink_0.")])
    gamma_png = out.parent / f"shapes_{regime}_ap_vs_gamma.png"
    base = next((r for r in rows if r.label == BASELINE), None)
    mink = [r for r in rows if r.label != BASELINE and r.label.count("_") == 1]
    if figures.plot_ap_vs_gamma(mink, base, gamma_png):
        lines += [f"![{regime}: AP vs gamma]({gamma_png.name})", ""]
    return lines


def _grad_groups(path: Path) -> list[str]:
    """The per-group gradient fidelity tables of ``tools/grad_groups.py``, when it was run."""
    if not path.is_file():
        return []
    from rcnn_dropit.measure.grad_groups import markdown_table

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


def _time_account(out: Path) -> tuple[float, float, int]:
    """(hours the runs took, summed over runs; hours of the machine, each run's time divided by
    the runs sharing the machine with it; how many finished)."""
    file = out / TIMES_FILE
    if not file.is_file():
        return 0.0, 0.0, 0
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    per_run = sum(r["seconds"] for r in records) / 3600
    machine = sum(r["seconds"] / max(1, r.get("jobs", 1)) for r in records) / 3600
    return per_run, machine, sum(1 for r in records if r.get("ok"))


def write_study_report(plan: Plan, plan_path: str | Path, jobs: int) -> str:
    """Write plan.report (and its figures next to it); returns the Markdown."""
    import torch  # here: for its version; the tables need no torch

    planned = [r for r in plan_runs(plan) if not r.exports]
    plan.report.parent.mkdir(parents=True, exist_ok=True)
    hours, machine_hours, finished = _time_account(plan.out)
    done = sum(1 for r in planned if (plan.out / r.name / "eval.json").is_file())
    lines = [
        "# Accuracy study on the synthetic shapes set",
        "",
        f"Produced by `python tools/study.py --plan {plan_path} --jobs {jobs}` (`make study`) on "
        f"{platform.machine()} {platform.system()}, torch {torch.__version__}; run directories "
        f"(without checkpoints) under `{plan.out}`. {done} of {len(planned)} planned runs "
        f"finished; the finished and failed runs took {hours:.1f} h summed over runs, about "
        f"{machine_hours:.1f} h of the machine (each run's time divided by the runs it shared "
        f"the machine with; `{plan.out}/{TIMES_FILE}`; interrupted attempts are not counted).",
        "",
        "AP is COCO AP (IoU 0.50:0.95) x100 on the validation images of each regime's shapes set; "
        "± is the standard deviation over seeds. Δ is the mean over seeds of (setting - baseline) "
        "for the same seed, with a 95% Student-t interval over those differences; a run and its "
        "baseline share the seed, so data order and initialisation are paired.",
        "",
        PAPER,
        "",
        "## Verdict",
        "",
    ]
    body = []
    for regime, config in plan.regimes.items():
        found = regime_runs(plan.out, regime)
        lines += verdict(found, regime, plan)
        body += [f"## Regime: {regime} (`{config}`)", ""]
        if not found:
            body += ["No finished run yet.", ""]
            continue
        body += [*ap_table(found, plan), ""]
        training = training_table(found, plan)
        if training:
            body += [
                "AP during training (box / mask, mean over seeds), evaluated at fixed iterations "
                "of the same schedule:",
                "",
                *training,
                "",
            ]
        body += _figures(found, plan, regime, plan.report)
        body += _grad_groups(plan.report.parent / f"shapes_grad_groups_{regime}.json")
    if plan.notes is not None and plan.notes.is_file():  # the analysis a person wrote
        lines += ["", plan.notes.read_text().strip()]
    markdown = "\n".join([*lines, "", *body]).rstrip("\n") + "\n"
    plan.report.write_text(markdown)
    return markdown

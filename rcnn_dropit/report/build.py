"""Assemble the Markdown report (and its PNG figures) from run directories."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rcnn_dropit.errors import UsageError
from rcnn_dropit.report import figures, tables
from rcnn_dropit.report.groups import Row, make_rows
from rcnn_dropit.report.runs import Run, RunNotUsable, load_run

LOSS_PNG = "loss_curves.png"
GAMMA_PNG = "ap_vs_gamma.png"


class NoUsableRuns(UsageError):
    """None of the given run directories can be reported."""


def _load_all(
    run_dirs: Sequence[str | Path], baseline: str | Path | None
) -> tuple[list[Run], Run | None, list[tuple[str, str]], str]:
    """Usable runs in order, the baseline run, skipped (path, reason), baseline source."""
    runs: list[Run] = []
    skipped: list[tuple[str, str]] = []
    seen: set[Path] = set()
    for d in run_dirs:
        key = Path(d).resolve()
        if key in seen:
            skipped.append((str(d), "listed more than once (reported once)"))
            continue
        seen.add(key)
        try:
            runs.append(load_run(d))
        except RunNotUsable as err:
            skipped.append((str(d), str(err)))

    if baseline is not None:
        key = Path(baseline).resolve()
        found = next((r for r in runs if r.path.resolve() == key), None)
        if found is not None:
            return runs, found, skipped, "given with --baseline"
        try:
            base_run = load_run(baseline)
        except RunNotUsable as err:  # asked for by name: a report without it is not what was asked
            raise NoUsableRuns(f"--baseline '{baseline}' is not usable: {err}") from None
        return [base_run, *runs], base_run, skipped, "given with --baseline"
    base_run = next((r for r in runs if not r.dropit_enabled), None)
    return runs, base_run, skipped, "first run with dropit.enabled false"


def _check_out(out: Path) -> None:
    """The report's file can be written: a bad --out is one message before any work."""
    if out.is_dir():
        raise UsageError(f"--out '{out}' is a folder; give the report's file name, e.g. report.md")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = err.strerror or err
        raise UsageError(f"--out '{out}': its folder cannot be made ({reason})") from None


def _baseline_line(base_row: Row | None, how: str) -> str:
    if base_row is not None:
        where = ", ".join(f"`{r.path}`" for r in base_row.runs)
        return f"Baseline: **{base_row.label}** ({where}), {how}. Deltas and ratios are against it."
    return (
        "No baseline: no run has dropit.enabled false and none was given with --baseline, "
        "so no deltas or ratios are shown."
    )


def _figures_section(rows: list[Row], base_row: Row | None, out: Path | None) -> list[str]:
    if out is None:
        return []
    if not figures.matplotlib_available():
        return [
            "## Figures",
            "",
            "Not drawn: matplotlib is not installed (`pip install .[plot]`).",
            "",
        ]
    lines = ["## Figures", ""]
    if figures.plot_loss_curves(rows, out.parent / LOSS_PNG):
        lines += [f"![Training loss vs iteration]({LOSS_PNG})", ""]
    else:
        lines += ["No loss curves: no run has train records in metrics.jsonl.", ""]
    if figures.plot_ap_vs_gamma(rows, base_row, out.parent / GAMMA_PNG):
        lines += [f"![AP vs gamma]({GAMMA_PNG})", ""]
    else:
        lines += ["No AP-vs-gamma plot: no DropIT strategy has runs at two or more gammas.", ""]
    return lines


def _problems_section(rows: list[Row], skipped: list[tuple[str, str]]) -> list[str]:
    lines = [f"- `{path}`: not included: {reason}" for path, reason in skipped]
    lines += [
        f"- {row.label} (`{run.path}`): partial: {'; '.join(run.notes)}"
        for row in rows
        for run in row.runs
        if run.notes
    ]
    return ["## Runs not included / partial", "", *lines, ""] if lines else []


def build_report(
    run_dirs: Sequence[str | Path],
    baseline: str | Path | None = None,
    out: str | Path | None = None,
    group_seeds: bool = False,
) -> str:
    """Markdown comparing run directories; with out, also writes it and its PNGs next to it."""
    runs, base_run, skipped, how = _load_all(run_dirs, baseline)
    if not runs:
        reasons = "; ".join(f"{path}: {reason}" for path, reason in skipped) or "no run given"
        raise NoUsableRuns(f"no usable run directory ({reasons})")
    rows = make_rows(runs, group_seeds)
    base_row = next((row for row in rows if any(r is base_run for r in row.runs)), None)
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        _check_out(out_path)

    counted = f"{len(runs)} runs" + (
        f" in {len(rows)} settings (seeds grouped)" if group_seeds else ""
    )
    lines = [
        "# DropIT run comparison",
        "",
        f"{counted}. AP is COCO AP x100; in parentheses the difference to the baseline as shown.",
        "",
        _baseline_line(base_row, how),
        "",
    ]
    for family, title in (("bbox", "Box AP (bbox)"), ("segm", "Mask AP (segm)")):
        if any(row.values(family, "AP") for row in rows):
            lines += [f"## {title}", "", tables.ap_table(rows, base_row, family, group_seeds), ""]
    lines += [
        "## Memory and throughput",
        "",
        "saved MB: activations kept for backward in one training step (memory.json "
        f"`saved_mb`). {tables.PEAK_TOTAL}: the largest of metrics.jsonl `peak_mem_mb` and "
        "memory.json `step_peak_total_mb`, the most bytes tensors held at once on rank 0's "
        "device (weights, gradients, optimizer state, the batch, activations; "
        "docs/training.md#peak-memory). "
        f"{tables.PEAK_STEP}: memory.json `step_peak_mb`, the measured step's peak above what "
        "was held when it began, as the benches measure a step's peak. images/s: median over "
        "metrics.jsonl train records, all processes. Ratios are run / baseline.",
        "",
        tables.memory_table(rows, base_row),
        "",
        "## Runs",
        "",
        tables.description_table(rows, base_row, group_seeds),
        "",
    ]
    chosen = tables.budget_lines(rows)
    if chosen:
        lines += [
            "## Memory methods chosen by a budget",
            "",
            "Runs that set `train.memory_budget` trained with the method the trainer measured as "
            "the fastest that fits (budget.json); a candidate's peak is the largest over the "
            "processes, weights, gradients and optimizer state included:",
            "",
            *chosen,
            "",
        ]
    lines += _figures_section(rows, base_row, out_path)
    lines += _problems_section(rows, skipped)
    markdown = "\n".join(lines).rstrip("\n") + "\n"
    if out_path is not None:
        out_path.write_text(markdown)
    return markdown

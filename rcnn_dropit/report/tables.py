"""Markdown tables of report rows: AP with deltas, memory/throughput, run description."""

from __future__ import annotations

import json
from collections.abc import Sequence

from rcnn_dropit.report.groups import Row
from rcnn_dropit.report.runs import METRIC_KEYS

DASH = "-"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[object]], numeric_from: int
) -> str:
    """A pipe table; columns from index numeric_from on are right-aligned."""
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ap(value: float | None) -> str:
    """AP in [0, 1] as x100 with one decimal."""
    return DASH if value is None else f"{value * 100:.1f}"


def fmt_delta(value: float | None, base: float | None) -> str:
    """' (+0.6)' style AP delta (x100); empty without both."""
    if value is None or base is None:
        return ""
    # Difference of the shown one-decimal values, so that a reader's subtraction gives the same.
    delta = round(float(fmt_ap(value)) - float(fmt_ap(base)), 1)
    return f" ({'+' if delta >= 0 else '-'}{abs(delta):.1f})"


def fmt_ratio(value: float | None, base: float | None) -> str:
    """value / base with two decimals."""
    if value is None or base is None or base <= 0:
        return DASH
    return f"{value / base:.2f}"


def fmt_num(value: float | None, digits: int) -> str:
    """A plain number, or a dash when missing."""
    return DASH if value is None else f"{value:.{digits}f}"


def row_name(row: Row, baseline: Row | None) -> str:
    """First-column label, marking the baseline."""
    return f"{row.label} (baseline)" if row is baseline else row.label


def ap_table(rows: Sequence[Row], baseline: Row | None, family: str, grouped: bool) -> str:
    """AP, AP50, ..., APl (x100) per row; other rows carry their delta to the baseline."""
    header = ["run", *(["n"] if grouped else []), *METRIC_KEYS]
    if grouped:
        header.append("AP per seed")
    body = []
    for row in rows:
        cells: list[object] = [row_name(row, baseline)]
        if grouped:
            cells.append(len(row.runs))
        for key in METRIC_KEYS:
            value = row.metric(family, key)
            base = None if baseline is None or row is baseline else baseline.metric(family, key)
            cells.append(fmt_ap(value) + fmt_delta(value, base))
        if grouped:
            cells.append(", ".join(fmt_ap(v) for v in row.values(family, "AP")) or DASH)
        body.append(cells)
    return markdown_table(header, body, numeric_from=1)


# The two peaks, labelled by what they count: the device's total, what has to fit in the GPU,
# and the measured step's above its start, which is what the benches call a step's peak.
PEAK_TOTAL = "peak MB (device total)"
PEAK_STEP = "step peak MB (above start)"


def memory_table(rows: Sequence[Row], baseline: Row | None) -> str:
    """Saved-activation MB, the two peaks and images/s, each with its ratio to the baseline."""
    header = ["run", "saved MB", "saved ratio", PEAK_TOTAL, "peak ratio", PEAK_STEP]
    header += ["step peak ratio", "images/s", "speed ratio"]
    body = []
    for row in rows:
        cells: list[object] = [row_name(row, baseline)]
        for name, digits in (
            ("saved_mb", 1),
            ("peak_mb", 1),
            ("step_peak_mb", 1),
            ("images_per_sec", 2),
        ):
            value = getattr(row, name)
            cells.append(fmt_num(value, digits))
            cells.append(fmt_ratio(value, getattr(baseline, name) if baseline else None))
        body.append(cells)
    return markdown_table(header, body, numeric_from=1)


def _options(row: Row) -> str:
    opts = row.first.options
    if not opts:
        return DASH
    return ", ".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in opts.items()
    )


def _joined(values: Sequence[object]) -> str:
    distinct = list(dict.fromkeys(values))
    return ", ".join(DASH if v is None else str(v) for v in distinct) or DASH


def description_table(rows: Sequence[Row], baseline: Row | None, grouped: bool) -> str:
    """What each row is: arch, precision, DropIT setting, seed(s), iterations, evaluated images,
    folder."""
    header = ["run", "arch", "backbone", "amp", "dropit", "gamma", "options", "seed"]
    header += ["n"] if grouped else []
    header += ["iterations", "val images", "directory"]
    body = []
    for row in rows:
        run = row.first
        cells: list[object] = [
            row_name(row, baseline),
            run.cfg("model.arch", DASH),
            run.cfg("model.backbone", DASH),
            _joined([r.cfg("solver.amp") for r in row.runs]),
            run.strategy or "off",
            DASH if run.gamma is None else f"{run.gamma:g}",
            _options(row),
            _joined([r.seed for r in row.runs]),
        ]
        if grouped:
            cells.append(len(row.runs))
        cells += [
            _joined([r.iterations for r in row.runs]),
            _joined([r.num_images for r in row.runs]),
            ", ".join(f"`{r.path}`" for r in row.runs),
        ]
        body.append(cells)
    return markdown_table(header, body, numeric_from=len(header))


def _mb_or_gb(mb: float) -> str:
    return f"{mb / 1024:.2f} GB" if mb >= 1024 else f"{mb:.1f} MB"


def budget_lines(rows: Sequence[Row]) -> list[str]:
    """One line per run whose memory method ``train.memory_budget`` chose (its budget.json):
    the method, why, the budget, and each candidate's peak."""
    lines = []
    for row in rows:
        for run in row.runs:
            choice = run.memory_choice
            if choice is None:
                continue
            budget = DASH if choice.budget_mb is None else _mb_or_gb(choice.budget_mb)
            if choice.margin is not None:
                budget += f" (a {choice.margin:.0%} margin)"
            peaks = ", ".join(
                f"{method} "
                + (_mb_or_gb(peak) if peak is not None else note or DASH)
                + (" (fits)" if fits else "")
                for method, peak, note, fits in choice.candidates
            )
            lines.append(
                f"- {row.label} (`{run.path}`): `{choice.method}`, {choice.reason or DASH}; "
                f"budget {budget} per process on {choice.device}; peaks: {peaks or DASH}"
            )
    return lines

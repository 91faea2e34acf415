"""PNG figures of a report: loss curves, AP vs gamma, Δ AP vs peak memory (matplotlib, Agg,
imported lazily)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rcnn_dropit.report.groups import Row
from rcnn_dropit.report.paired import PairedDiff

FAMILY_TITLES = {"bbox": "box AP", "segm": "mask AP"}


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (it is an optional dependency)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _new_figure(width: float, height: float, ncols: int = 1) -> tuple[Any, Any]:
    # Figure + explicit Agg canvas: no pyplot, so no global backend or figure registry is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def smooth(values: Sequence[float]) -> list[float]:
    """Trailing moving average over ~5% of the points (at most 50); short series stay as is."""
    window = max(1, min(50, len(values) // 20))
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss_curves(rows: Sequence[Row], path: Path) -> bool:
    """Total training loss vs iteration, one colour per row; False when no run logged losses."""
    if not any(run.losses for row in rows for run in row.runs):
        return False
    fig, (ax,) = _new_figure(7, 4.5)
    colors = [c["color"] for c in _color_cycle(len(rows))]
    for color, row in zip(colors, rows, strict=True):
        label: str | None = row.label
        for run in row.runs:
            if not run.losses:
                continue
            iters = [it for it, _ in run.losses]
            losses = [loss for _, loss in run.losses]
            ax.plot(iters, losses, color=color, alpha=0.15, linewidth=0.8)
            ax.plot(iters, smooth(losses), color=color, linewidth=1.5, label=label)
            label = None  # one legend entry per row, however many seeds it has
    ax.set_xlabel("iteration")
    ax.set_ylabel("total loss")
    ax.set_title("Training loss (smoothed; raw faint)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return True


def _color_cycle(n: int) -> list[dict[str, Any]]:
    from matplotlib import rcParams

    cycle = list(rcParams["axes.prop_cycle"])
    return [cycle[i % len(cycle)] for i in range(n)]


def gamma_series(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """DropIT rows by (arch, strategy, options), kept only where they cover >= 2 gammas."""
    series: dict[str, list[Row]] = {}
    for row in rows:
        run = row.first
        if run.gamma is None:
            continue
        opts = json.dumps(run.options, sort_keys=True) if run.options else ""
        key = " ".join(p for p in (str(run.cfg("model.arch", "")), run.strategy, opts) if p)
        series.setdefault(key, []).append(row)
    return {
        key: sorted(members, key=lambda r: r.first.gamma)
        for key, members in series.items()
        if len({r.first.gamma for r in members}) >= 2
    }


def plot_ap_vs_gamma(rows: Sequence[Row], baseline: Row | None, path: Path) -> bool:
    """Box (and mask) AP x100 vs gamma per strategy, baseline dashed; False if no series."""
    series = gamma_series(rows)
    if not series:
        return False
    plotted = [row for members in series.values() for row in members]
    families = [f for f in FAMILY_TITLES if any(row.values(f, "AP") for row in plotted)]
    fig, axes = _new_figure(5.5 * len(families), 4.2, ncols=len(families))
    colors = [c["color"] for c in _color_cycle(len(series))]
    for ax, family in zip(axes, families, strict=True):
        for color, (key, members) in zip(colors, series.items(), strict=True):
            points = [(r.first.gamma, r.values(family, "AP")) for r in members]
            points = [(g, vals) for g, vals in points if vals]
            if not points:
                continue
            means = [sum(vals) / len(vals) * 100 for _, vals in points]
            ax.plot([g for g, _ in points], means, "o-", color=color, label=key)
            for g, vals in points:
                if len(vals) > 1:  # seeds shown individually around their mean
                    ax.scatter(
                        [g] * len(vals), [v * 100 for v in vals], color=color, s=12, alpha=0.4
                    )
        base = baseline.metric(family, "AP") if baseline is not None else None
        if base is not None:
            ax.axhline(base * 100, color="black", linestyle="--", linewidth=1, label="baseline")
        ax.set_xlabel("gamma (fraction of elements dropped)")
        ax.set_ylabel(f"{FAMILY_TITLES[family]} (x100)")
        ax.set_title(f"{FAMILY_TITLES[family]} vs gamma")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return True


def plot_peak_vs_ap(
    points: Sequence[tuple[str, float, dict[str, PairedDiff]]],
    path: Path,
    tolerance: float,
    peak_goal: float,
) -> bool:
    """Paired Δ AP (95% interval as error bar) vs peak-memory ratio, one point per setting and
    one panel per family; the goal's band and peak limit dashed. False when there is no point."""
    families = [f for f in FAMILY_TITLES if any(f in diffs for _, _, diffs in points)]
    if not families:
        return False
    fig, axes = _new_figure(5.5 * len(families), 4.5, ncols=len(families))
    colors = [c["color"] for c in _color_cycle(len(points))]
    for ax, family in zip(axes, families, strict=True):
        for color, (label, peak, diffs) in zip(colors, points, strict=True):
            d = diffs.get(family)
            if d is None:
                continue
            err = None
            if d.low is not None and d.high is not None:
                err = [[d.mean - d.low], [d.high - d.mean]]
            ax.errorbar([peak], [d.mean], yerr=err, fmt="o", color=color, capsize=4, label=label)
        ax.axhspan(-tolerance, tolerance, color="tab:green", alpha=0.12, label=f"±{tolerance:g} AP")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.axvline(
            peak_goal, color="black", linestyle="--", linewidth=1, label=f"peak {peak_goal:g}x"
        )
        # up to past 1 (the baseline), so that the distance to it reads as memory saved
        peaks = [peak for _, peak, _ in points]
        ax.set_xlim(max(0.0, min(peaks) - 0.1), max(1.05, max(peaks) + 0.05))
        ax.set_xlabel("peak memory of a training step / baseline's (R50-FPN bench)")
        ax.set_ylabel(f"Δ {FAMILY_TITLES[family]} vs baseline (paired, 95% CI)")
        ax.set_title(f"Δ {FAMILY_TITLES[family]} vs peak memory")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.savefig(path, dpi=100)
    return True

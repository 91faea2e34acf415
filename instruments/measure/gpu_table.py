"""The GPU table (``tools/bench.py gpu-table``, ``make bench-gpu``): one row per setting with
the step time, peak, kernel launches and host syncs per step at each batch size, each a ratio to
the baseline of the same alternating rounds (:func:`instruments.measure.step_bench.run_benchmark`),
and the largest batch within a memory budget (:mod:`instruments.measure.max_batch`).
docs/benchmark.md says how to read it; ``tools/results_page.py`` puts the newest lease's table on
the results page.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from instruments.measure.max_batch import largest_batches
from instruments.measure.methods_table import provenance
from instruments.measure.step_bench import run_benchmark
from instruments.measure.workload import DEFAULT_WORKLOAD, Setting, Variant
from rcnn_dropit.errors import UsageError

# A table row's key per batch size (suffixed ``_{n}img``), and the step row's key it is from.
PER_BATCH = {
    "step_s": "step_s",
    "step_ratio": "step_time_ratio",
    "step_ratio_spread": "step_ratio_spread",
    "step_ratio_rounds": "step_ratio_rounds",
    "step_s_rounds": "step_s_rounds",
    "peak_mb": "peak_mb",
    "positive_rois_per_image": "positive_rois_per_image",
    "peak_ratio": "peak_ratio",
    "peak_phase": "peak_phase",
    "forward_peak_mb": "peak_forward_mb",
    "working_set_mb": "forward_transient_mb",
    "saved_mb": "saved_mb",
    "launches_per_step": "launches_per_step",
    "syncs_per_step": "syncs_per_step",
    "dtoh_copies_per_step": "dtoh_copies_per_step",
    "kernels_per_step": "kernels_per_step",
    "grad_cosine": "grad_cosine",
    "bucket_steps": "bucket_steps",
}
# What a setting is, from its first step row.
DESCRIPTION = (
    "setting",
    "overrides",
    "strategy",
    "gamma",
    "options",
    "include",
    "rules",
    "activation_checkpointing",
    "frozen_bn",
    "heads",
    "accumulate",
    "device",
    "amp",
    "image_size",
    "memory_source",
    "converted_layers",
)
# Rows that run the baseline's kernels, give or take a few launches: their step ratios would be 1
# on a noiseless machine, so how far they stray is what the run's timing cannot tell apart.
SAME_KERNELS = ("baseline_torchvision_forward", "baseline_torchvision_fpn")


def gpu_table(
    settings: Sequence[Setting | Variant],
    images: Sequence[int] = (2, 8),
    budget_mb: float = 16000.0,
    batch_limit: int = 512,
    image_size: int = 800,
    repeats: int = 8,
    device: str = "cuda",
    amp: str = "fp16",
    draws: int = 2,
    profile_steps: int = 3,
    scratch: bool = False,
    rois_per_image: int = 512,
    backbone: str = "resnet50",
    heads: str = "v1",
    progress: Callable[[dict[str, Any]], None] | None = None,
    on_steps: Callable[[list[dict[str, Any]]], None] | None = None,
    rounds: int = 5,
    workload: str = DEFAULT_WORKLOAD,
    size_buckets: bool = False,
) -> Iterator[dict[str, Any]]:
    """One row per setting (the baseline first): step rows at each of ``images``, then the
    largest batch within ``budget_mb`` searched up to ``batch_limit`` images (``at_limit``
    says when a setting reached it: its true figure is higher; a limit of 0 skips the search).
    The steps are timed in ``rounds`` alternating rounds of ``repeats`` steps per setting.
    ``progress`` sees every step and batch row as it comes, and ``on_steps`` the table's rows
    once the step columns are in, before the search (a lease that ends during the search then
    still has them). ``size_buckets``: the step rows train with the recipe's two buckets
    (step_bench.run_benchmark), a compiled row's first steps per bucket in ``bucket_steps``."""
    table: dict[str, dict[str, Any]] = {}
    for n in images:
        rows = run_benchmark(
            settings, scratch, image_size, repeats, device, rois_per_image, backbone,
            amp=amp, images=n, draws=draws, profile_steps=profile_steps, heads=heads,
            rounds=rounds, workload=workload, size_buckets=size_buckets,
        )  # fmt: skip
        for row in rows:
            if progress:
                progress(row)
            merged = table.setdefault(row["setting"], {k: row.get(k) for k in DESCRIPTION})
            merged.update({f"{key}_{n}img": row.get(src) for key, src in PER_BATCH.items()})
    if on_steps:
        on_steps([dict(row) for row in table.values()])
    if batch_limit <= 0:
        yield from table.values()
        return
    batches = largest_batches(
        settings, budget_mb, batch_limit, scratch, image_size, device, rois_per_image, backbone,
        amp=amp, heads=heads, workload=workload,
    )  # fmt: skip
    for row in batches:
        if progress:
            progress(row)
        table[row["setting"]].update(
            budget_mb=budget_mb,
            batch_limit=batch_limit,
            max_batch=row["max_batch"],
            peak_mb_at_max=row["peak_mb_at_max"],
            at_limit=row["max_batch"] >= batch_limit,
        )
    yield from table.values()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_header(command: str, device: str, quiet: bool, **run: Any) -> dict[str, Any]:
    """The provenance of a GPU table: the command, commit, machine and date (methods_table's),
    the GPU's name, the torch, CUDA and triton versions, the DropIT kernel path in force, and
    the run's own settings (``run``: images, budget, ...)."""
    from dropit_core import current_settings

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return {
        **provenance(command, quiet, device),
        "gpu": torch.cuda.get_device_name(torch.device(device)) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "kernels": current_settings().kernels,
        **run,
    }


def write_gpu_table(path: str | Path, header: Mapping[str, Any], rows: Sequence[Mapping]) -> None:
    """Write the header's fields, what the run's timing resolves (:func:`step_resolution`, for
    rows timed in rounds) and the rows (``rows``) as one JSON object."""
    resolution = step_resolution({**header, "rows": list(rows)})
    Path(path).write_text(json.dumps({**header, **resolution, "rows": list(rows)}, indent=2) + "\n")


def _spread_distance(row: Mapping[str, Any], n: int) -> float | None:
    """How far a same-kernel row's step at ``n`` images strays from the baseline's: its median
    ratio's distance from 1, or half the width of its rounds' ratios when that is wider."""
    median, spread = row.get(f"step_ratio_{n}img"), row.get(f"step_ratio_spread_{n}img")
    if median is None or not spread:
        return None
    low, high = spread
    return max(abs(median - 1.0), (high - low) / 2.0)


def _between(ratios: Sequence[float]) -> str:
    """ "0.98x to 1.03x", or "0.98x" when the lowest is the highest."""
    low, high = f"{min(ratios):.2f}x", f"{max(ratios):.2f}x"
    return low if low == high else f"{low} to {high}"


def step_resolution(table: Mapping[str, Any]) -> dict[str, Any]:
    """What the table's timing can tell apart, from rows timed in rounds: ``step_resolution``
    (step ratios within that of each other are not told apart), ``step_resolution_from`` (the
    rows it comes from) and ``step_resolution_note`` (the sentence the tables print).

    From the :data:`SAME_KERNELS` rows the table has: the widest of their distances from the
    baseline (:func:`_spread_distance`) over the batch sizes; without such rows, from the
    baseline's own rounds: half their range over their median (how far one round strays). Empty
    for a table without rounds (older files: their readers keep their own rule)."""
    rows = table.get("rows") or []
    images = table.get("images") or []
    by_name = {r.get("setting"): r for r in rows}
    found = {
        (s, n): d
        for s in SAME_KERNELS
        if s in by_name
        for n in images
        if (d := _spread_distance(by_name[s], n)) is not None
    }
    if found:
        names = sorted({s for s, _ in found}, key=SAME_KERNELS.index)
        medians = [by_name[s][f"step_ratio_{n}img"] for s, n in found]
        ends = [x for s, n in found for x in by_name[s][f"step_ratio_spread_{n}img"]]
        distance = max(found.values())
        basis = (
            f"the rows that run the baseline's kernels ({', '.join(f'`{s}`' for s in names)}) "
            f"stepped {_between(medians)} of the baseline (rounds {_between(ends)})"
        )
    else:
        base = rows[0] if rows else {}
        spans = [
            (max(t) - min(t)) / (2.0 * statistics.median(t))
            for n in images
            if (t := base.get(f"step_s_rounds_{n}img"))
        ]
        if not spans:
            return {}
        names, distance = [base.get("setting")], max(spans)
        basis = (
            "no row that runs the baseline's kernels in this run: the baseline's own rounds "
            f"strayed up to {distance:.2f} of its median step"
        )
    return {
        "step_resolution": round(distance, 4),
        "step_resolution_from": names,
        "step_resolution_note": (
            f"step ratios within {distance:.2f} of each other are not told apart; {basis}"
        ),
    }


def is_gpu_table(data: Any) -> bool:
    """Whether JSON data read from a file is a GPU table (an object with rows), not the methods
    table's list of records."""
    return isinstance(data, dict) and isinstance(data.get("rows"), list)


def _cell(value: Any, fmt: str, unit: str = "", ratio: Any = None) -> str:
    """``value`` formatted, with its unit and its ratio to the baseline; "-" when missing."""
    if value is None:
        return "-"
    text = format(value, fmt) + unit
    return text if ratio is None else f"{text} ({ratio:.2f}x)"


def ratio_at(row: Mapping[str, Any], key: str, n: int, base: Mapping[str, Any]) -> float | None:
    """A row's ratio to the baseline at ``n`` images: the step's and peak's as the run measured
    them; the saved bytes' from the two rows (the step rows hold no saved ratio)."""
    if key != "saved":
        return row.get(f"{key}_ratio_{n}img")
    mine, ref = row.get(f"saved_mb_{n}img"), base.get(f"saved_mb_{n}img")
    return mine / ref if mine is not None and ref else None


def _ratios(row: Mapping[str, Any], key: str, images: Sequence[int], base) -> str:
    """A row's ratios at each batch size, "1.86x, 1.20x"."""
    values = (ratio_at(row, key, n, base) for n in images)
    return ", ".join("-" if v is None else f"{v:.2f}x" for v in values)


def gpu_summary(table: Mapping[str, Any]) -> str:
    """One line per setting of a GPU table (for prose that must not retype its figures): step,
    peak and saved ratios at each batch size and the largest batch, then the GPU and commit."""
    if not is_gpu_table(table) or not table["rows"]:
        raise UsageError("GPU table: expected an object with rows (tools/bench.py gpu-table)")
    images = table.get("images") or []
    base = table["rows"][0]
    at = " and ".join(f"{n}" for n in images)
    lines = []
    for r in table["rows"][1:]:
        line = (
            f"- `{r['setting']}`: step {_ratios(r, 'step', images, base)}, peak "
            f"{_ratios(r, 'peak', images, base)}, saved {_ratios(r, 'saved', images, base)} the "
            f"baseline's (at {at} images)"
        )
        if r.get("max_batch") is not None:
            limit = " (the limit)" if r.get("at_limit") else ""
            line += f"; largest batch {r['max_batch']}{limit} against {base.get('max_batch')}"
        lines.append(line + ".")
    lines.append(
        f"\n({table.get('gpu') or 'no GPU'}, AMP {table.get('amp')}, {table.get('image_size')} "
        f"px, commit `{table.get('commit')}`, DropIT kernels: {table.get('kernels')}; "
        "the full table and its command: the docs/results page whose generated block reads "
        "the same file.)"
    )
    return "\n".join(lines)


def _step_cell(row: Mapping[str, Any], n: int) -> str:
    """The step's milliseconds and its ratio to the baseline; for a row timed in rounds, the
    lowest and highest of the rounds' ratios after it ("162 ms (1.34x, 1.30-1.38)")."""
    step, ratio = row.get(f"step_s_{n}img"), row.get(f"step_ratio_{n}img")
    spread = row.get(f"step_ratio_spread_{n}img")
    if step is None or ratio is None or not spread or spread[0] == spread[1]:
        # the baseline's rounds are all 1.00x: its range says nothing
        return _cell(None if step is None else step * 1000.0, ".0f", " ms", ratio)
    return f"{step * 1000.0:.0f} ms ({ratio:.2f}x, {spread[0]:.2f}-{spread[1]:.2f})"


def _step_words(table: Mapping[str, Any]) -> str:
    """How the table's steps were timed: the sentences under it."""
    if not table.get("rounds"):  # a table from before the rounds keeps its words
        return (
            f"Step: forward and backward, median of {table.get('repeats')} after a warm-up "
            "round, synchronised."
        )
    return (
        f"Step: forward and backward, synchronised, in {table['rounds']} alternating rounds "
        f"after a warm-up round: in each, every setting takes {table.get('repeats')} steps in "
        "turn, its round's time their median. A step's time is its median round's; its ratio "
        "the median of the rounds' ratios to the baseline's time in the same round, in brackets "
        "the lowest and highest of them."
    )


def _forward_cell(row: Mapping[str, Any], n: int) -> str:
    """The forward's peak and, in brackets, what of it the forward itself freed (its working
    set: the peak less what it left alive for the backward)."""
    peak, freed = row.get(f"forward_peak_mb_{n}img"), row.get(f"working_set_mb_{n}img")
    if peak is None:
        return "-"
    return f"{peak:.0f} MB" + ("" if freed is None else f" ({freed:.0f})")


def gpu_markdown(table: Mapping[str, Any]) -> str:
    """The Markdown table of a GPU table file's data, then the run that measured it."""
    if not is_gpu_table(table):
        raise UsageError("GPU table: expected an object with 'rows' (tools/bench.py gpu-table)")
    images = table.get("images") or []
    budget = table.get("budget_mb")
    searched = (table.get("batch_limit") or 0) > 0  # a limit of 0: no batch search ran
    base = table["rows"][0] if table["rows"] else {}
    heads = ["setting", *(f"{what}, {n} img" for what in ("step", "peak", "saved") for n in images)]
    # a table measured before the forward's columns existed keeps its columns
    forward = any(
        r.get(f"forward_peak_mb_{n}img") is not None for r in table["rows"] for n in images
    )
    if forward:
        heads += [f"forward peak (freed in it), {n} img" for n in images]
    if searched:
        heads += [f"largest batch in {budget:.0f} MB" if budget else "largest batch"]
    heads += [f"launches / step, {n} img" for n in images]
    heads += [f"host syncs / step, {n} img" for n in images]
    lines = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
    for r in table["rows"]:
        cells = [str(r.get("setting"))]
        cells += [_step_cell(r, n) for n in images]
        for key in ("peak", "saved"):  # MB, and the ratio to the baseline
            for n in images:
                ratio = ratio_at(r, key, n, base)
                cells.append(_cell(r.get(f"{key}_mb_{n}img"), ".0f", " MB", ratio))
        if forward:
            cells += [_forward_cell(r, n) for n in images]
        if searched:
            batch = r.get("max_batch")
            if batch is not None and r.get("at_limit"):
                batch = f">= {batch} (the limit)"
            cells.append("-" if batch is None else str(batch))
        cells += [_cell(r.get(f"launches_per_step_{n}img"), ".0f") for n in images]
        cells += [_cell(r.get(f"syncs_per_step_{n}img"), ".1f") for n in images]
        lines.append("| " + " | ".join(cells) + " |")
    source = {"cuda": "the CUDA allocator's", "cpu": "torch's CPU allocations", "rss": "RSS"}.get(
        table["rows"][0].get("memory_source") if table["rows"] else None, "-"
    )
    lines += [
        "",
        f"Ratios to the baseline of the same run. {_step_words(table)} Peak: {source} peak "
        "over the step, above the model's own allocation. "
        + (
            "Forward peak: the same over the forward alone, and in brackets what of it the "
            "forward freed before it ended (its working set). "
            if forward
            else ""
        )
        + "Saved: the bytes autograd keeps for the "
        f"backward (packs counted as packs). Launches and host syncs: counted by "
        f"torch.profiler, {table.get('profile_steps')} profiled steps per setting (kernel "
        "launch calls of the runtime and the driver; stream, event and device synchronisations "
        "and synchronous copies)."
        + (
            " Largest batch: one SGD step within the budget, searched up to a limit of "
            f"{table.get('batch_limit')} images."
            if searched
            else ""
        ),
        "",
        f"Measured {table.get('date')} by `{table.get('command')}` at commit "
        f"`{table.get('commit')}`; {table.get('gpu') or 'no GPU'}; torch {table.get('torch')} "
        f"(CUDA {table.get('cuda')}), triton {table.get('triton')}; DropIT kernels: "
        f"{table.get('kernels')}; AMP {table.get('amp')}, {table.get('image_size')} px.",
    ]
    note = table.get("step_resolution_note") or step_resolution(table).get("step_resolution_note")
    if note:
        lines += ["", f"What the timing resolves: {note}."]
    if table.get("complete") is False:
        lines.append("The run ended before its batch search finished: no largest-batch figures.")
    return "\n".join(lines)

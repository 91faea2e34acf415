"""The results page a reader opens first (docs/results/README.md), and the figures other pages
quote from it.

One table per device, each from the newest committed data: on a GPU, the newest lease folder
with the first stages of tools/gpu_session.sh (the eager and graphed rows, the budget's probe,
the deterministic pair: instruments/report/gpu_pass.py) and the newest with the every-method
table (``docs/results/gpu_<gpu>_<date>/bench_gpu.json``, with the largest batches its log printed
when the JSON was written before the search ended); on the CPU, the methods bench
(``cpu_methods/methods.json``) and the 8-image bf16 proxy (``cpu_proxy8/methods.json``). Beside
each method, the accuracy study's paired AP intervals (the goal's regime of
``configs/study/plan.yaml``). Nothing here is typed:
``python tools/results_page.py`` writes the page and the generated blocks of README.md,
docs/choosing.md and docs/gpu.md, and a test checks that they are what it would write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instruments.measure.gpu_table import SAME_KERNELS, is_gpu_table, ratio_at
from instruments.measure.methods_table import SUMMARY, methods_by_setting, splice
from instruments.report import gpu_pass
from instruments.report.gpu_pass import GpuPass
from rcnn_dropit.errors import UsageError

TOOL = "tools/results_page.py"
COMMAND = "python tools/results_page.py"
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/results"
PAGE = RESULTS / "README.md"
CPU_TABLE = RESULTS / "cpu_methods/methods.json"
# The GPU table's setting (8 images of 800 px, autocast) on the CPU under bf16, memory only
CPU_PROXY_8 = RESULTS / "cpu_proxy8/methods.json"
# Steps timed apart from the methods table (make bench-speed), when its newest run did not time them
CPU_SPEED = RESULTS / "cpu_speed_512/methods.json"
PLAN = REPO / "configs/study/plan.yaml"
# The one lease that timed the packs both ways: eager torch (DROPIT_KERNELS=eager) and Triton
EAGER_LEASE = RESULTS / "gpu_h200_2026-11-26"
LEASE_NAME = re.compile(r"^gpu_([a-z0-9]+)_(\d{4}-\d{2}-\d{2})$")

# Settings whose weight gradients are the baseline's (fp32; under AMP up to its rounding).
EXACT = (
    "baseline",
    "baseline_torchvision_bn",
    "baseline_torchvision_forward",
    "baseline_torchvision_fpn",
    "checkpoint_stages",
    "accumulate_2",
    "accumulate_4",
)
# The exact methods a user would pick instead of DropIT, and the DropIT setting they are
# weighed against where the reader chooses.
EXACT_ALTERNATIVES = ("checkpoint_stages", "accumulate_2", "accumulate_4")
PICK = "quant_4bit"
# The README's short table: the study's pick, the paper's setting and the exact alternatives.
README_ROWS = (
    "quant_4bit",
    "quant_2bit",
    "mink_0.8",
    "checkpoint_stages",
    "checkpoint_stages_quant_4bit",
    "accumulate_2",
)


@dataclass(frozen=True)
class Lease:
    """What one GPU lease committed: its folder, its GPU table, the largest batches found."""

    folder: Path
    table: Mapping[str, Any]
    batches: Mapping[str, int]

    @property
    def rows(self) -> dict[str, Mapping[str, Any]]:
        return {r["setting"]: r for r in self.table["rows"]}


def _date(folder: Path) -> str:
    return LEASE_NAME.match(folder.name).group(2)


def newest_lease(results: Path = RESULTS) -> Path | None:
    """The lease folder (``gpu_<gpu>_<date>``) with a GPU table and the latest date."""
    leases = [p for p in results.iterdir() if LEASE_NAME.match(p.name)]
    return max((p for p in leases if (p / "bench_gpu.json").is_file()), key=_date, default=None)


def newest_pass(results: Path = RESULTS) -> Path | None:
    """The lease folder with the first stages' graphed tables and the latest date."""
    found = [p for p in results.iterdir() if LEASE_NAME.match(p.name) and gpu_pass.has_pass(p)]
    return max(found, key=_date, default=None)


def lease_folder(gpu_name: str, date: str) -> Path:
    """Where a lease's files go: ``docs/results/gpu_<model>_<date>``, the model being the GPU's
    product number ("NVIDIA H100 80GB HBM3" -> h100); refused for a name without one."""
    model = re.search(r"\b([A-Z]{1,3}\d{1,4}[A-Za-z]?)\b", gpu_name)
    if model is None:
        raise UsageError(
            f"GPU name '{gpu_name}' has no model number to name its folder by: set LEASE="
            "docs/results/gpu_<model>_<date>"
        )
    return RESULTS / f"gpu_{model.group(1).lower()}_{date}"


def _logged_batches(log: Path) -> dict[str, int]:
    """setting -> largest batch, from the ``measured:`` lines a GPU table's run printed."""
    found = {}
    if not log.is_file():
        return found
    for line in log.read_text().splitlines():
        if line.startswith("measured: ") and '"max_batch"' in line:
            row = json.loads(line[len("measured: ") :])
            found[row["setting"]] = int(row["max_batch"])
    return found


def read_lease(folder: Path) -> Lease:
    """A lease folder's GPU table, with the largest batch of each setting its search reached
    (from the JSON, else from the run's log: a lease that ran out of time wrote the JSON's
    step columns before the search ended)."""
    path = folder / "bench_gpu.json"
    table = json.loads(path.read_text())
    if not is_gpu_table(table):
        raise UsageError(f"{path}: not a GPU table (tools/bench.py gpu-table)")
    batches = {r["setting"]: int(r["max_batch"]) for r in table["rows"] if r.get("max_batch")}
    for setting, batch in _logged_batches(folder / "bench_gpu.log").items():
        batches.setdefault(setting, batch)
    return Lease(folder, table, batches)


def study_accuracy(plan_path: Path = PLAN) -> dict[str, str]:
    """setting -> its paired Δ box and mask AP with 95% intervals in the study's goal regime
    ("" for a setting the study has no pair for); empty without the study's runs."""
    from instruments.measure.study_plan import load_plan
    from instruments.measure.study_report import GOAL, found_runs
    from instruments.report.seeded import baseline_runs, paired_text
    from instruments.report.verdict import family_diffs

    if not plan_path.is_file():
        return {}
    runs = found_runs(load_plan(plan_path)).get(GOAL.regime, {})
    out = {}
    for setting, seeds in runs.items():
        base = baseline_runs(runs, setting)
        diffs = family_diffs(seeds, base)
        if any(d is None for d in diffs):
            continue
        n = len(set(seeds) & set(base))
        box, mask = (paired_text(d[0]) for d in diffs)
        out[setting] = f"box {box}, mask {mask} ({n} seed{'s' if n > 1 else ''})"
    return out


def _accuracy_cell(setting: str, accuracy: Mapping[str, str]) -> str:
    if setting in accuracy:
        return accuracy[setting]
    return "exact" if setting in EXACT else "not in the study"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _batch_cell(lease: Lease, setting: str) -> str:
    limit = lease.table.get("batch_limit") or 0
    if setting in lease.batches:
        batch = lease.batches[setting]
        return f"{batch} (the search's limit)" if batch >= limit > 0 else str(batch)
    if limit <= 0:
        return "not searched"
    return "not reached: the search stopped at the lease's time limit"


def gpu_table_lines(lease: Lease, accuracy: Mapping[str, str]) -> list[str]:
    """The GPU's common settings, then one row per setting of the lease's table."""
    t, rows = lease.table, lease.rows
    base = rows["baseline"]
    images = t["images"]
    budget = f"{t['budget_mb'] / 1000:g} GB" if t.get("budget_mb") else "the budget"
    resolution = timing_resolution(lease)
    lines = [
        f"**{t['gpu']}**, torch {t['torch']} (CUDA {t['cuda']}), triton {t['triton']}, AMP "
        f"{t['amp']}, Mask R-CNN R50-FPN (COCO recipe, lean frozen norm), {t['image_size']} px, "
        f"{' and '.join(map(str, images))} images, random weights; commit `{t['commit']}`, "
        f"{t['date']}, DropIT kernels: {t['kernels']}. Command: `{t['command']}` "
        f"([{lease.folder.name}/]({lease.folder.name}/README.md) holds what the lease printed).",
        "",
        f"Ratios to the lean baseline of the same run. Peak: the CUDA allocator's peak over a "
        f"step (forward, backward, SGD), above the model's own allocation. {_step_words(t)} "
        f"Largest batch: the most images whose step peaks within {budget} of the device, "
        f"searched up to {t.get('batch_limit')}. Grad cosine: one draw's weight gradient "
        f"against the exact one (mean over the approximated layers).",
        "",
        f"| method | saved @{images[-1]} | peak @{images[0]} | peak @{images[-1]} "
        f"| step @{images[0]} | step @{images[-1]} | launches @{images[0]} / @{images[-1]} "
        f"| largest batch in {budget} | grad cosine | Δ AP [95% CI], study |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for setting, r in rows.items():
        if setting == "baseline":
            peaks = [f"{base[f'peak_mb_{n}img']:.0f} MB" for n in (images[0], images[-1])]
            steps = [f"{base[f'step_s_{n}img'] * 1000:.1f} ms" for n in (images[0], images[-1])]
            saved = f"{base[f'saved_mb_{images[-1]}img']:.0f} MB"
        else:
            peaks = [_x(ratio_at(r, "peak", n, base)) for n in (images[0], images[-1])]
            steps = [_x(ratio_at(r, "step", n, base)) for n in (images[0], images[-1])]
            saved = _x(ratio_at(r, "saved", images[-1], base))
        launches = " / ".join(
            f"{r.get(f'launches_per_step_{n}img') or 0:.0f}" for n in (images[0], images[-1])
        )
        cosine = r.get(f"grad_cosine_{images[-1]}img")
        lines.append(
            f"| `{setting}` | {saved} | {peaks[0]} | {peaks[1]} | {steps[0]} | {steps[1]} "
            f"| {launches} | {_batch_cell(lease, setting)} "
            f"| {'-' if cosine is None else f'{cosine:.3f}'} "
            f"| {_accuracy_cell(setting, accuracy)} |"
        )
    if t.get("step_resolution_note"):  # the table's own words, from its rounds
        resolves = f"What the timing can resolve: {t['step_resolution_note']}."
    else:  # a table from before the rounds: its same-kernel rows' ratios, read here
        ratios = _same_kernel_steps(lease)
        span = f"{min(ratios):.2f}x to {max(ratios):.2f}x" if ratios else "-"
        resolves = (
            f"What the timing can resolve: rows that run the baseline's kernels, give or take a "
            f"few launches ({', '.join(f'`{s}`' for s in SAME_KERNELS if s in rows)}), stepped "
            f"{span} of the baseline in this run, so read step ratios that differ by "
            f"less than {resolution:.2f} as not told apart."
        )
    lines += ["", f"{resolves} Peaks do not move between runs of one commit."]
    return lines


def _step_words(t: Mapping[str, Any]) -> str:
    """How a GPU table's steps were timed, for the page: in rounds (its ``rounds`` field); a
    table from before them keeps the words its page was generated with."""
    if not t.get("rounds"):
        return f"Step: median of {t['repeats']} steps per setting, one setting after another."
    return (
        f"Step: {t['rounds']} alternating rounds of {t['repeats']} steps per setting, the median "
        "round's time; a ratio: the median of the rounds' ratios to the baseline."
    )


def _same_kernel_steps(lease: Lease) -> list[float]:
    rows, images = lease.rows, lease.table["images"]
    return [
        r
        for s in SAME_KERNELS
        if s in rows
        for n in images
        if (r := rows[s].get(f"step_ratio_{n}img")) is not None
    ]


def timing_resolution(lease: Lease) -> float:
    """The step ratios the lease's timing cannot tell apart: its table's own
    ``step_resolution`` (gpu_table.step_resolution, from rows timed in rounds) when it has one;
    for an older table, the largest distance from 1 of a same-kernel row's step ratio."""
    own = lease.table.get("step_resolution")
    if own is not None:
        return float(own)
    return max((abs(r - 1) for r in _same_kernel_steps(lease)), default=0.0)


def cpu_records() -> tuple[dict[str, Mapping[str, Any]], dict[str, Mapping[str, Any]]]:
    """The CPU methods table and the 8-image bf16 proxy, by setting ({} for a missing file)."""
    return methods_by_setting(CPU_TABLE) or {}, methods_by_setting(CPU_PROXY_8) or {}


SPEED_ANCHOR = "memory.md#the-cpu-step-on-the-trained-workload-4-bit-quantization-and-min-k-512-px"


def cpu_speed(cpu: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """make bench-speed's rows by setting, when the CPU methods table has no step times ({}
    otherwise, or without the file): a step ratio is read within its own run only."""
    if not cpu or cpu["baseline"].get("step_s") is not None:
        return {}
    return methods_by_setting(CPU_SPEED) or {}


def _run_words(r: Mapping[str, Any]) -> str:
    quiet = "machine quiet" if r["quiet"] else "machine NOT quiet (memory only: load moves no byte)"
    return (
        f"{r['images']} images of {r['image_size']} px, amp {r['amp']}; commit `{r['commit']}`, "
        f"{r['date']}, {quiet}; command: `{r['command']}`"
    )


def _workload_words(record: Mapping[str, Any]) -> str:
    """What the record's RoI heads saw (records from before workloads had names: untrained)."""
    name = record.get("workload")
    if name is None:
        return "the untrained workload (the ground truth's 3 positive RoIs per image)"
    positives = record.get("positive_rois_per_image")
    count = f"{positives:.0f} positive RoIs per image" if positives is not None else "positives"
    anchor = "../benchmark.md#the-workload-what-the-roi-heads-see"
    return f"the {name} workload ({count}; [benchmark.md]({anchor}))"


def _memory_words(record: Mapping[str, Any]) -> str:
    """How the record's memory was counted."""
    if record.get("memory_source") == "rss":
        return "RSS (large blocks mmapped, so it follows live memory)"
    return "tensors' bytes ([the one peak](../training.md#peak-memory))"


def cpu_table_lines(
    table: Mapping[str, Mapping[str, Any]],
    proxy: Mapping[str, Mapping[str, Any]],
    accuracy: Mapping[str, str],
) -> list[str]:
    """The CPU's common settings, then one row per setting of the methods table."""
    if not table:
        return ["Not measured: `make bench-methods` writes docs/results/cpu_methods/methods.json."]
    base = table["baseline"]
    lines = [
        f"**{base['machine']}**, torch threads {base['threads']}, Mask R-CNN R50-FPN (COCO "
        f"recipe), random weights, {_workload_words(base)}; memory as {_memory_words(base)}.",
        "",
        f"- @{base['images']}: {_run_words(base)} "
        f"([memory.md](memory.md#every-method-in-one-table)).",
    ]
    speed = cpu_speed(table)
    if speed:
        b = speed["baseline"]
        ratios = ", ".join(
            f"`{s}` {_x(r.get('step_ratio'))}" for s, r in speed.items() if s != "baseline"
        )
        lines.append(
            f"- steps @{b['images']}, not timed in that run: `make bench-speed` timed {ratios} "
            f"of the baseline's {b['step_s']:.2f} s, {_workload_words(b)}: {_run_words(b)} "
            f"([memory.md]({SPEED_ANCHOR}))."
        )
    if proxy:
        p = proxy["baseline"]
        lines.append(
            f"- peak @{p['images']}: the GPU table's setting on the CPU, under bf16, "
            f"{_workload_words(p)}: {_run_words(p)} ([memory.md](memory.md#a-steps-peak-at-8-"
            f"images-under-bf16-the-gpu-tables-setting-on-the-cpu))."
        )
    n8 = proxy.get("baseline", {}).get("images", 8)
    lines += [
        "",
        f"Step @{n8} and the largest batch: not measured on the CPU (a step of {n8} images of "
        "800 px takes minutes here; no device budget to search). Grad cosine / norm ratio: one "
        "draw's weight gradient against the exact one, mean over the approximated layers.",
        "",
        f"| method | saved @{base['images']} | peak @{base['images']} | step @{base['images']} "
        f"| peak @{n8}, bf16 | grad cosine / norm | Δ AP [95% CI], study |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for setting, r in table.items():
        if setting == "baseline":
            step = "not timed" if r.get("step_s") is None else f"{r['step_s']:.2f} s"
            cells = [f"{r['saved_mb']:.0f} MB", f"{r['peak_mb']:.0f} MB", step]
        else:
            cells = [_x(r.get(k)) for k in ("saved_ratio", "peak_ratio", "step_ratio")]
        if setting in proxy:
            p = proxy[setting]
            eight = f"{p['peak_mb']:.0f} MB" if setting == "baseline" else _x(p["peak_ratio"])
        else:
            eight = "not measured"
        fidelity = "-"
        if r.get("cosine") is not None:
            fidelity = f"{r['cosine']:.3f} / {r['norm_ratio']:.3f}"
        lines.append(
            f"| `{setting}` | {' | '.join(cells)} | {eight} | {fidelity} "
            f"| {_accuracy_cell(setting, accuracy)} |"
        )
    return lines


@dataclass(frozen=True)
class Point:
    """One setting's peak and step ratio at one batch size of one device's table."""

    setting: str
    peak: float
    step: float | None


def _points(rows: Mapping[str, Mapping[str, Any]], suffix: str = "") -> dict[str, Point]:
    """The rows' points; ``suffix``: a GPU table's batch size (``_8img``)."""
    return {
        s: Point(s, r[f"peak_ratio{suffix}"], r.get(f"step_ratio{suffix}"))
        for s, r in rows.items()
        if r.get(f"peak_ratio{suffix}") is not None
    }


def weigh(points: Mapping[str, Point], resolution: float) -> str:
    """A sentence on how the exact alternatives stand against :data:`PICK`: which are lower in
    peak, and of those which are also faster by more than the timing can blur."""
    pick = points.get(PICK)
    if pick is None:
        return f"`{PICK}` was not measured."
    exact = [points[s] for s in EXACT_ALTERNATIVES if s in points]
    lower = [p for p in exact if p.peak < pick.peak]
    if pick.step is None:
        head = f"`{PICK}` peaks at {_x(pick.peak)} of the baseline (steps not timed)"
        lower_words = ", ".join(f"`{p.setting}` at {_x(p.peak)}" for p in lower)
        return head + (
            f"; lower in peak: {lower_words}." if lower else "; no exact method is lower in peak."
        )
    head = f"`{PICK}` peaks at {_x(pick.peak)} of the baseline at {_x(pick.step)} its step"
    if not lower:
        faster = [p for p in exact if p.step is not None and p.step < pick.step]
        tail = "; no exact method is lower in peak"
        for p in faster:
            apart = p.step < pick.step - resolution
            tail += f"; `{p.setting}` steps {_x(p.step)} at {_x(p.peak)} the peak" + (
                "" if apart else " (a step the timing does not tell apart)"
            )
        return head + tail + "."
    parts = []
    for p in lower:
        if p.step is not None and p.step < pick.step - resolution:
            verdict = "**lower and faster: the better choice here where it fits**"
        elif p.step is not None and p.step < pick.step + resolution:
            verdict = "lower, at a step the timing does not tell apart"
        else:
            verdict = "lower but slower"
        parts.append(f"`{p.setting}` {_x(p.peak)} at {_x(p.step)} the step ({verdict})")
    return head + "; exact methods lower in peak: " + "; ".join(parts) + "."


def verdict_lines(
    lease: Lease | None,
    cpu: Mapping[str, Mapping[str, Any]],
    batches: bool = True,
    graphed: GpuPass | None = None,
) -> list[str]:
    """Where the reader chooses: the graphed settings against eager (``graphed``: the newest
    lease's first stages), at each measured batch size of each device the exact alternatives
    against :data:`PICK`, and the largest batches in the GPU's budget."""
    lines = gpu_pass.verdict_lines(graphed)
    if lease is not None:
        res = timing_resolution(lease)
        for n in lease.table["images"]:
            sentence = weigh(_points(lease.rows, f"_{n}img"), res)
            lines.append(f"- On the GPU ({lease.table['gpu']}), {n} images: {sentence}")
        if batches and lease.batches:
            order = sorted(lease.batches.items(), key=lambda kv: -kv[1])
            missing = [s for s in lease.rows if s not in lease.batches]
            lines.append(
                f"- Largest batch in {lease.table['budget_mb'] / 1000:g} GB on that GPU: "
                + ", ".join(f"`{s}` {b}" for s, b in order)
                + (f" (not reached: {', '.join(f'`{s}`' for s in missing)})" if missing else "")
                + "."
            )
    if cpu:
        base = cpu["baseline"]
        sentence = weigh(_points(cpu), 0.0)
        timed = cpu_speed(cpu).get(PICK, {}).get("step_ratio")
        if timed is not None:
            # No link: these lines go into README.md and choosing.md too.
            sentence += f" Its step, timed apart (`make bench-speed`): {_x(timed)} the baseline's."
        lines.append(
            f"- On the CPU (fp32, {base['images']} images of {base['image_size']} px; step ratios "
            f"from one run, no interval): {sentence}"
        )
    return lines


def page(lease: Lease | None, accuracy: Mapping[str, str], graphed: GpuPass | None = None) -> str:
    """The whole results page."""
    cpu, proxy = cpu_records()
    lines = [
        "# Results",
        "",
        f"<!-- generated by `{COMMAND}` from the files it names; do not edit by hand -->",
        "",
        "Memory, speed, gradient fidelity and accuracy of each memory method, one table per "
        "device, from the newest committed measurement of each. Every ratio is to the lean "
        "baseline of the same run (no DropIT; the toolkit's frozen norm and forward, bit-equal "
        "to torchvision's in fp32). The accuracy column is the study's paired difference to "
        "the baseline over seeds with its 95% interval (Mask R-CNN fine-tuned on the generated "
        "shapes set, regime `finetune2`: [shapes.md](shapes.md)); it does not depend on the "
        "device. `exact`: the method computes the baseline's gradients.",
        "",
        "## Where to choose",
        "",
        *verdict_lines(lease, cpu, graphed=graphed),
        "",
        "How to choose, with the accuracy study's rule: [../choosing.md](../choosing.md).",
        "",
        "## On a GPU",
        "",
        "### Eager and graphed, the memory budget's probe, deterministic runs",
        "",
        *gpu_pass.pass_lines(graphed),
        "",
        "### Every method",
        "",
    ]
    if lease is None:
        lines.append("Not measured on a GPU yet (`make bench-gpu`, docs/gpu.md).")
    else:
        lines += gpu_table_lines(lease, accuracy)
    lines += [
        "",
        "## On the CPU",
        "",
        *cpu_table_lines(cpu, proxy, accuracy),
        "",
        "## Other results",
        "",
        "- [memory.md](memory.md): the CPU benches behind the CPU table (the trained workload at "
        "800 px and at the sampler's cap, every method, the 8-image bf16 proxy, fused packs, host "
        "time per layer), with what each column means; each bench's files are in its `cpu_*/` "
        "folder.",
        "- [shapes.md](shapes.md): the accuracy study; [demo.md](demo.md): `make demo`'s run.",
        "- GPU leases, each as it printed (named by GPU and date): "
        + ", ".join(
            f"[{p.name}/]({p.name}/README.md)"
            for p in sorted(RESULTS.iterdir(), key=lambda p: p.name, reverse=True)
            if p.is_dir() and LEASE_NAME.match(p.name)
        )
        + ".",
        "- [archive/untrained_workload.md](archive/untrained_workload.md): the tables measured "
        "on the untrained workload (random weights, 3 positive RoIs per image), superseded; "
        "[archive/memory_log.md](archive/memory_log.md): earlier tables and the notebook of "
        "earlier runs (git keeps every earlier version of each file).",
    ]
    return "\n".join(lines) + "\n"


def readme_block(
    lease: Lease | None, accuracy: Mapping[str, str], graphed: GpuPass | None = None
) -> str:
    """README.md's short table: the GPU's and the CPU's key ratios and the study's intervals
    for :data:`README_ROWS`, then where the reader should look twice."""
    cpu, _ = cpu_records()
    gpu = lease.rows if lease else {}
    images = lease.table["images"] if lease else [2, 8]
    lines = [
        f"| method | GPU peak @{images[-1]} | GPU step @{images[0]} / @{images[-1]} "
        "| GPU batch in 16 GB | CPU peak / step | Δ AP (box, mask), 95% CI |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for s in README_ROWS:
        g = gpu.get(s, {})
        c = cpu.get(s, {})
        steps = " / ".join(_x(g.get(f"step_ratio_{n}img")) for n in (images[0], images[-1]))
        batch = str(lease.batches[s]) if lease and s in lease.batches else "not reached"
        acc = _accuracy_cell(s, accuracy)
        lines.append(
            f"| `{s}`: {SUMMARY.get(s, s)} | {_x(g.get(f'peak_ratio_{images[-1]}img'))} "
            f"| {steps} | {batch} | {_x(c.get('peak_ratio'))} / {_x(c.get('step_ratio'))} "
            f"| {acc} |"
        )
    where = []
    if lease:
        t = lease.table
        baseline_batch = lease.batches.get("baseline", "-")
        where.append(
            f"GPU: {t['gpu']}, AMP {t['amp']}, {t['image_size']} px, {t['date']} (lean "
            f"baseline's largest batch: {baseline_batch})"
        )
    if cpu:
        b = cpu["baseline"]
        where.append(f"CPU: fp32, {b['images']} images of {b['image_size']} px, {b['date']}")
    lines += [
        "",
        "; ".join(where) + ". Every row, its settings and commands: "
        "[docs/results/README.md](docs/results/README.md).",
        "",
        *verdict_lines(lease, cpu, batches=False, graphed=graphed),
    ]
    return "\n".join(lines)


def gpu_status_block(lease: Lease | None, graphed: GpuPass | None = None) -> str:
    """docs/gpu.md's status: the newest lease (of the every-method table's and the first
    stages'), what it ran, and each stage's outcome as its session summary printed it."""
    if lease is None and graphed is None:
        return "Nothing has run on a GPU yet."
    folders = [x.folder for x in (lease, graphed) if x is not None]
    newest = max(folders, key=_date)
    t = lease.table if lease is not None and newest == lease.folder else graphed.head
    summary = newest / gpu_pass.SESSION_SUMMARY
    stages = gpu_pass.stages(summary.read_text()) if summary.is_file() else []
    lines = [
        f"**The newest lease: {t['date']}, {t['gpu']}, torch {t['torch']}, triton {t['triton']}**, "
        f"at commit `{t['commit']}`. What it printed: [results/{newest.name}/]"
        f"(results/{newest.name}/README.md); its table, with the CPU's beside it: "
        "[results/README.md](results/README.md#on-a-gpu).",
    ]
    if stages:
        lines += [
            "",
            "Its stages, as `session_summary.txt` records them: "
            + "; ".join(map(gpu_pass.stage_words, stages))
            + ".",
        ]
    if lease is not None:
        t = lease.table
        done = "complete" if t.get("complete", True) else "not complete (the JSON says so)"
        where = "" if lease.folder == newest else f" (from results/{lease.folder.name}/)"
        lines += [
            "",
            f"The GPU table's largest-batch search{where}: {done}; it reached "
            f"{len(lease.batches)} of {len(lease.rows)} settings.",
        ]
    return "\n".join(lines)


def eager_block(folder: Path = EAGER_LEASE) -> str:
    """docs/training.md's sentence on what eager packs cost a GPU step: ``quant_4bit``'s step
    ratio with ``DROPIT_KERNELS=eager`` and with the kernels, from one lease's two tables."""
    eager = json.loads((folder / "bench_gpu_eager.json").read_text())
    fast = json.loads((folder / "bench_gpu.json").read_text())

    def steps(table: Mapping[str, Any]) -> str:
        row = next(r for r in table["rows"] if r["setting"] == PICK)
        images = sorted(table["images"], reverse=True)
        return " and ".join(f"{row[f'step_ratio_{n}img']:.2f}x at {n} images" for n in images)

    name = f"{folder.name}/bench_gpu_eager.json"
    return (
        f"In the eager GPU table ([results/{name}](results/{name}): {eager['gpu']}, AMP "
        f"{eager['amp']}, {eager['image_size']} px, `DROPIT_KERNELS=eager`) `{PICK}` took "
        f"{steps(eager)} of the baseline's step; the same day's table with the kernels has "
        f"{steps(fast)}."
    )


def blocks(
    lease: Lease | None, accuracy: Mapping[str, str], graphed: GpuPass | None = None
) -> dict[tuple[str, str], str]:
    """Every block this module writes into another page, by (document, block name)."""
    cpu, _ = cpu_records()
    return {
        ("README.md", "results-summary"): readme_block(lease, accuracy, graphed),
        ("docs/choosing.md", "where-to-choose"): "\n".join(
            verdict_lines(lease, cpu, graphed=graphed)
        ),
        ("docs/gpu.md", "gpu-status"): gpu_status_block(lease, graphed),
        ("docs/training.md", "eager-gpu"): eager_block(),
    }


def render() -> dict[Path, str]:
    """Every file this module writes, with its full text as it should be now."""
    folder, first = newest_lease(), newest_pass()
    lease = read_lease(folder) if folder else None
    graphed = gpu_pass.read_pass(first) if first else None
    accuracy = study_accuracy()
    out = {PAGE: page(lease, accuracy, graphed)}
    for (doc, block), text in blocks(lease, accuracy, graphed).items():
        path = REPO / doc
        current = out.get(path, path.read_text())
        out[path] = splice(current, text, str(path), block=block, tool=TOOL)
    return out


def stale(rendered: Mapping[Path, str]) -> list[Path]:
    """The files whose text on disk is not what :func:`render` made."""
    return [p for p, text in rendered.items() if not p.is_file() or p.read_text() != text]


def write(rendered: Mapping[Path, str]) -> Sequence[Path]:
    """Write every stale file; the paths written."""
    changed = stale(rendered)
    for path in changed:
        path.write_text(rendered[path])
    return changed

"""The open GPU questions on the results page: what tools/gpu_session.sh's first stages wrote into
a lease folder (docs/results/gpu_<gpu>_<date>/), read and said in words and tables, and the
step that brings a lease's output there.

The stages' files: ``graphed_2img.json`` and ``graphed_8img.json`` (GPU tables, one batch size
each: the eager and graphed rows in alternating rounds, with size buckets: a compiled row's first
steps per bucket in ``bucket_steps_{n}img``), ``capture.json`` (the graphed settings' first steps
per size bucket), ``budget_probe.json`` (train.memory_budget's probe beside the tables' peaks)
and ``deterministic_pair.json`` (train.deterministic: two runs of one seed, one without the key).
Each says its workload (what the RoI heads saw) and the positive RoIs per image it counted. A
graphed row is one whose overrides set ``train.compile_mode=reduce-overhead``; its eager twin
the row whose overrides are the same without the compile keys.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcnn_dropit.errors import UsageError

TABLES = ("graphed_2img.json", "graphed_8img.json")
CAPTURE, BUDGET, PAIR = "capture.json", "budget_probe.json", "deterministic_pair.json"
SUMMARY = "summary.txt"  # as tools/gpu_session.sh writes it; a lease folder keeps it as:
SESSION_SUMMARY = "session_summary.txt"
ARCHIVE = "lease.tar"
GRAPHED = "train.compile_mode=reduce-overhead"
_COMPILE_KEYS = ("train.compile=", "train.compile_mode=")
_STAGE = re.compile(r"^(\w+): rc=(\d+) in (\d+) s \(limit (-?\d+) s\): (.*)$")
_SKIPPED = re.compile(r"^(\w+): skipped, (-?\d+) s left$")
_NOT_RUN = re.compile(r"^(\w+): not run \((.*)\)$")


@dataclass(frozen=True)
class GpuPass:
    """What one lease folder holds of the first stages (None: that stage wrote nothing)."""

    folder: Path
    tables: Mapping[int, Mapping[str, Any]]  # batch size -> its GPU table
    capture: Mapping[str, Any] | None = None
    budget: Mapping[str, Any] | None = None
    pair: Mapping[str, Any] | None = None

    @property
    def images(self) -> list[int]:
        return sorted(self.tables)

    def row(self, setting: str, n: int) -> Mapping[str, Any] | None:
        """``setting``'s row at ``n`` images, or None."""
        rows = self.tables.get(n, {}).get("rows", [])
        return next((r for r in rows if r["setting"] == setting), None)

    def twin(self, setting: str, n: int) -> Mapping[str, Any] | None:
        """The row of ``setting``'s eager twin at ``n`` images (:func:`eager_twin`), or None."""
        row = self.row(setting, n)
        twin = eager_twin(row, self.tables[n]["rows"]) if row else None
        return self.row(twin, n) if twin else None

    @property
    def settings(self) -> list[str]:
        """Every row's setting, in the order the tables list them (the smaller batch first)."""
        seen: dict[str, None] = {}
        for n in self.images:
            seen.update((r["setting"], None) for r in self.tables[n]["rows"])
        return list(seen)

    @property
    def head(self) -> Mapping[str, Any]:
        """The provenance of the first table (the GPU, versions, commit, date, command)."""
        return self.tables[self.images[0]] if self.tables else {}


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def has_pass(folder: Path) -> bool:
    """Whether a folder holds a graphed table of the first stages."""
    return any((folder / name).is_file() for name in TABLES)


def read_pass(folder: Path) -> GpuPass:
    """A lease folder's first-stage files."""
    tables = {}
    for name in TABLES:
        table = _json(folder / name)
        if table:
            for n in table["images"]:
                tables[n] = table
    return GpuPass(
        folder, tables, _json(folder / CAPTURE), _json(folder / BUDGET), _json(folder / PAIR)
    )


def eager_twin(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The setting of a graphed row's eager twin among ``rows`` (None if absent)."""
    plain = [o for o in row["overrides"] if not o.startswith(_COMPILE_KEYS)]
    return next((r["setting"] for r in rows if list(r["overrides"]) == plain), None)


def graphed(p: GpuPass) -> list[str]:
    """The graphed settings of the pass."""
    return [
        s
        for s in p.settings
        if any(GRAPHED in (p.row(s, n) or {}).get("overrides", ()) for n in p.images)
    ]


def _graphed_baseline(p: GpuPass) -> str | None:
    return next((s for s in graphed(p) if s.startswith("baseline")), None)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _quotient(a: Mapping | None, b: Mapping | None, n: int) -> str:
    """Row ``a``'s step over row ``b``'s in the same round at ``n`` images: the median over the
    rounds, then the lowest and highest; "-" without both rows' rounds."""
    key = f"step_s_rounds_{n}img"
    if not a or not b or not a.get(key) or not b.get(key) or len(a[key]) != len(b[key]):
        return "-"
    ratios = [x / y for x, y in zip(a[key], b[key], strict=True)]
    low, high = min(ratios), max(ratios)
    return f"{statistics.median(ratios):.2f}x" + ("" if low == high else f" ({low:.2f}-{high:.2f})")


def _step_cell(row: Mapping | None, n: int) -> str:
    if not row or row.get(f"step_ratio_{n}img") is None:
        return "-"
    low, high = row.get(f"step_ratio_spread_{n}img") or (None, None)
    text = f"{row[f'step_ratio_{n}img']:.2f}x"
    return text if low is None or low == high else f"{text} ({low:.2f}-{high:.2f})"


def _fewest_positives(records: Sequence[Mapping[str, Any]]) -> str:
    """ ", 3.0 positive RoIs per image": the fewest any record counted ("" where none did)."""
    counted = [v for r in records if (v := r.get("positive_rois_per_image")) is not None]
    return f", {min(counted):.1f} positive RoIs per image" if counted else ""


def _where(t: Mapping[str, Any]) -> str:
    return (
        f"**{t.get('gpu') or 'no GPU (' + str(t.get('machine')) + ')'}**, torch {t.get('torch')} "
        f"(CUDA {t.get('cuda')}), triton {t.get('triton')}, AMP {t.get('amp')}, "
        f"{t.get('image_size')} px, workload {t.get('workload', 'untrained')}; commit "
        f"`{t.get('commit')}`, {t.get('date')}, DropIT kernels: {t.get('kernels')}"
    )


def _head(first: str, numbers: list[str], text: str | None = None) -> list[str]:
    """A table's header and rule: the first column, right-aligned ``numbers``, then ``text``."""
    cells = [first, *numbers, *([text] if text else [])]
    return ["| " + " | ".join(cells) + " |", "|---|" + "---:|" * len(numbers) + "---|" * bool(text)]


def table_lines(p: GpuPass) -> list[str]:
    """The eager and graphed rows at each batch size, ratios to the eager baseline."""
    images = p.images
    t = p.head
    lines = [
        f"{_where(t)} ([{p.folder.name}/]({p.folder.name}/README.md) holds what the lease "
        "printed).",
        "",
        f"Each batch size in its own alternating rounds ({t.get('rounds')} rounds of "
        f"{t.get('repeats')} steps per setting: the median round, in brackets the lowest and "
        "highest round's ratio), ratios to the eager baseline of the same rounds. Graphed: the "
        "backbone (ResNet body and FPN) compiled by Inductor in reduce-overhead mode, one CUDA "
        "graph per size bucket and batch size, the heads eager (`train.compile=backbone`, "
        "`train.compile_mode=reduce-overhead`). Peak as on every page (training.md#peak-memory) "
        f"above the model's own allocation. {_bucket_words(t)}",
        "",
        *_head(
            "method",
            [f"peak @{n}" for n in images]
            + [f"step @{n}" for n in images]
            + ["launches " + " / ".join(f"@{n}" for n in images), "positive RoIs / image"],
        ),
    ]
    for s in p.settings:
        rows = {n: p.row(s, n) for n in images}
        if s == "baseline":
            peaks = [_mb(rows[n], f"peak_mb_{n}img") for n in images]
            steps = [_ms(rows[n], n) for n in images]
        else:
            peaks = [_x((rows[n] or {}).get(f"peak_ratio_{n}img")) for n in images]
            steps = [_step_cell(rows[n], n) for n in images]
        launches = _each_batch(rows, "launches_per_step", 0)
        positives = _each_batch(rows, "positive_rois_per_image", 1)
        lines.append(
            f"| `{s}` | {' | '.join(peaks)} | {' | '.join(steps)} | {launches} | {positives} |"
        )
    notes = [
        f"@{n}: {p.tables[n]['step_resolution_note']}"
        for n in images
        if p.tables[n].get("step_resolution_note")
    ]
    if notes:
        lines += ["", "What the timing resolves: " + "; ".join(notes) + "."]
    return lines


def _each_batch(rows: Mapping[int, Mapping | None], key: str, digits: int) -> str:
    """A column's value at each batch size, "4012 / 3998"."""
    values = [(row or {}).get(f"{key}_{n}img") for n, row in rows.items()]
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def _size(bucket: Sequence[int]) -> str:
    return f"{bucket[0]}x{bucket[1]}"


def _bucket_words(t: Mapping[str, Any]) -> str:
    """How the table's batches were shaped: the size buckets every row trained with, or none."""
    buckets = t.get("size_buckets")
    if not buckets:
        return f"Without size buckets: every batch {t.get('image_size')} px square, one shape."
    sizes = " and ".join(_size(b) for b in buckets)
    return (
        f"Every row with size buckets {sizes} (`model.size_buckets`, as a run with buckets "
        "trains): its batches padded to them, a landscape and a portrait batch in turn."
    )


def _mb(row: Mapping | None, key: str) -> str:
    return "-" if not row or row.get(key) is None else f"{row[key]:.0f} MB"


def _ms(row: Mapping | None, n: int) -> str:
    value = (row or {}).get(f"step_s_{n}img")
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _captures(p: GpuPass, setting: str) -> str:
    """A setting's capture per batch size and bucket, "2 img 800x1344: 63.1 s (record 0.8 s)"."""
    if not p.capture:
        return "not measured"
    parts = []
    for c in p.capture["captures"]:
        if c["setting"] != setting:
            continue
        h, w = c["bucket"]
        record = f", record {c['record_s']:.1f} s" if c.get("record_s") else ""
        skips = f", {c['cudagraph_skips']} CUDA graph skip(s)" if c.get("cudagraph_skips") else ""
        parts.append(f"{c['images']} img {h}x{w}: {c['capture_s']:.1f} s{record}{skips}")
    return "; ".join(parts) or "not measured"


def _against(p: GpuPass, s: str, n: int) -> tuple[str, str, str]:
    """``s``'s step at ``n`` images over its eager twin's and over the graphed baseline's, and
    its peak over the twin's."""
    row, twin, base = p.row(s, n), p.twin(s, n), _graphed_baseline(p)
    other = p.row(base, n) if base and s != base else None
    key = f"peak_mb_{n}img"
    peak = row[key] / twin[key] if row and twin and row.get(key) and twin.get(key) else None
    return _quotient(row, twin, n), _quotient(row, other, n), _x(peak)


def graphed_lines(p: GpuPass) -> list[str]:
    """Each graphed setting against its eager twin and the graphed baseline, and its capture."""
    images = p.images
    lines = _head(
        "graphed",
        [
            f"{what} @{n}"
            for what in ("step vs eager", "vs graphed baseline", "peak vs eager")
            for n in images
        ],
        "capture per batch and bucket: first steps beyond steady ones",
    )
    for s in graphed(p):
        columns = zip(*(_against(p, s, n) for n in images), strict=True)
        cells = [cell for column in columns for cell in column]
        lines.append(f"| `{s}` | {' | '.join(cells)} | {_captures(p, s)} |")
    if p.capture:
        c = p.capture
        positives = _fewest_positives(c["captures"])
        lines += ["", f"Capture: workload {c.get('workload', 'untrained')}{positives}."]
    return [*lines, *table_bucket_lines(p)]


def table_bucket_lines(p: GpuPass) -> list[str]:
    """Each compiled row's first steps per bucket in the tables (before its timed steps)."""
    parts = []
    for s in p.settings:
        for n in p.images:
            steps = (p.row(s, n) or {}).get(f"bucket_steps_{n}img")
            if not steps:
                continue
            cells = []
            for b in steps:
                beyond = b.get("capture_s")
                took = "-" if beyond is None else f"{beyond:.1f} s"
                record = f", record {b['record_s']:.1f} s" if b.get("record_s") else ""
                cells.append(f"{_size(b['bucket'])} {took}{record}")
            parts.append(f"`{s}` @{n}: {', '.join(cells)}")
    if not parts:
        return []
    return [
        "",
        "In the tables, each compiled row's first steps per bucket beyond as many steady "
        "steps: " + "; ".join(parts) + ".",
    ]


def budget_lines(p: GpuPass) -> list[str]:
    """The probe's choice and wall time at each batch size, its peaks beside the tables'."""
    b = p.budget
    if not b or not b.get("checks"):
        return ["The memory budget's probe: not measured in this lease."]
    lines = []
    for c in b["checks"]:
        shape = ""
        if c.get("size_buckets"):
            shape = f", padded to {_size(c['size_buckets'][0])}"
        seen = f"workload {c.get('workload', 'untrained')}{_fewest_positives([c])}"
        table = (
            f"the table's rows give `{c['table_choice']}` by the same rule"
            if c.get("table_choice")
            else "no table row of its candidates to compare (its stage did not finish)"
        )
        lines.append(
            f"- {c['images']} images ({seen}{shape}): `train.memory_budget={c['budget']}` chose "
            f"`{c['method']}` ({c['reason']}) in {c['wall_s']:.1f} s; {table}."
        )
    methods = [m["method"] for m in b["checks"][0]["methods"]]
    head = " | ".join(f"peak above start @{c['images']} (vs table)" for c in b["checks"])
    lines += ["", f"| method | {head} |", "|---|" + "---:|" * len(b["checks"])]
    for method in methods:
        cells = []
        for c in b["checks"]:
            m = next((x for x in c["methods"] if x["method"] == method), {})
            if m.get("peak_above_start_mb") is None:
                cells.append(m.get("note") or "-")
                continue
            ratio = f" ({m['vs_table']:.3f}x)" if m.get("vs_table") else ""
            cells.append(f"{m['peak_above_start_mb']:.0f} MB{ratio}")
        lines.append(f"| `{method}` | {' | '.join(cells)} |")
    held = ", ".join(f"{c['held_mb']:.0f} MB at {c['images']}" for c in b["checks"])
    lines += [
        "",
        f"The probe's peak counts what its step starts with (weights, optimizer state, the "
        f"batch: {held}), the table's does not: taken off before the ratio.",
    ]
    return lines


def pair_lines(p: GpuPass) -> list[str]:
    """The deterministic pair in words."""
    d = p.pair
    if not d:
        return ["The deterministic pair: not run in this lease."]
    failed = [r for r in d["runs"] if r["rc"]]
    pair, plain = d["pair"], d["without_key"]

    def same(c: Mapping[str, Any]) -> str:
        if c["identical"]:
            return f"logged the same losses at every one of {c['iterations']} iterations"
        if c["first_difference_iter"] is None:
            return f"logged {c['iterations']} iterations in common and no more"
        return (
            f"differ from iteration {c['first_difference_iter']} (largest difference of a "
            f"loss term {c['largest_difference']:.3g})"
        )

    positives = _fewest_positives([r for r in d["runs"] if r.get("positive_rois_per_image")])
    text = (
        f"`train.deterministic` ({d['config']}, {d['iters']} iterations, {d['device']}, AMP "
        f"{d['amp']}, workload {d.get('workload', 'its training data')}{positives}): two runs "
        f"of one seed with the key {same(pair)}; without the key the "
        f"same seed's run against them: {same(plain)}; the key's step: "
        f"{_x(d.get('key_step_ratio'))} the step without it (median after the first quarter)."
    )
    for r in failed:
        text += f" Run `{r['name']}` stopped (rc {r['rc']}): {r['error'] or 'no error line'}."
    return [text]


def pass_lines(p: GpuPass | None) -> list[str]:
    """The page's section on the first stages: tables, graphed against eager, budget, pair."""
    if p is None:
        return [
            "The graphed rows, the memory budget's probe and the deterministic pair: not "
            "measured yet (the first stages of `tools/gpu_session.sh`, "
            "[../gpu.md](../gpu.md#on-your-own-gpu))."
        ]
    return [
        *table_lines(p),
        "",
        *graphed_lines(p),
        "",
        *budget_lines(p),
        "",
        *pair_lines(p),
    ]


def verdict_lines(p: GpuPass | None) -> list[str]:
    """Where the reader chooses, from the pass: each graphed setting at each batch size."""
    if p is None or not p.tables:
        return []
    gpu = p.head.get("gpu") or "no GPU"
    lines = []
    base_graphed = _graphed_baseline(p)
    for n in p.images:
        parts = []
        for s in graphed(p):
            row = p.row(s, n)
            if row is None:
                continue
            twin = eager_twin(row, p.tables[n]["rows"])
            eager, vs, peak = _against(p, s, n)
            text = f"`{s}` steps {eager} of eager `{twin}`"
            if base_graphed and s != base_graphed:
                text += f", {vs} of `{base_graphed}`"
            parts.append(f"{text}, at {peak} its peak")
        if parts:
            lines.append(f"- Graphed on the GPU ({gpu}), {n} images: " + "; ".join(parts) + ".")
    return lines


# ---- a lease's output into its folder ----------------------------------------------------------


def summary_identity(summary: str) -> tuple[str | None, str | None]:
    """(the GPU's name, the date) from a session summary's text (None where it has none)."""
    lines = summary.splitlines()
    first = re.match(r"^gpu_session\.sh at \S+, (\d{4}-\d{2}-\d{2})T", lines[0] if lines else "")
    gpu = lines[1].split(",")[0].strip() if len(lines) > 1 else ""
    return (None if not gpu or gpu.startswith("no GPU") else gpu), first and first.group(1)


def lease_identity(source: Path) -> tuple[str | None, str]:
    """(the GPU's name or None, the date) from a session's summary.txt in ``source``."""
    path = source / SUMMARY
    if not path.is_file():
        raise UsageError(f"--lease: '{source}' has no {SUMMARY} (tools/gpu_session.sh's $OUT)")
    gpu, date = summary_identity(path.read_text())
    if date is None:
        raise UsageError(f"--lease: {path}'s first line is not gpu_session.sh's")
    return gpu, date


def import_lease(source: Path, folder: Path) -> list[Path]:
    """Copy a session's output (summary.txt, lease.tar's files, any loose ones: the stage a
    lease ended in) into ``folder``, the summary as session_summary.txt, and write its README;
    the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / SESSION_SUMMARY]
    shutil.copyfile(source / SUMMARY, written[0])
    archive = source / ARCHIVE
    if archive.is_file():
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix("./")
                if not member.isfile() or "/" in name or name.startswith("."):
                    raise UsageError(f"--lease: {archive} holds '{member.name}', not a file")
                data = tar.extractfile(member).read()
                (folder / name).write_bytes(data)
                written.append(folder / name)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in (SUMMARY, ARCHIVE):
            shutil.copyfile(path, folder / path.name)
            written.append(folder / path.name)
    readme = folder / "README.md"
    readme.write_text(lease_readme(folder))
    return [*written, readme]


def stages(summary: str) -> list[dict[str, Any]]:
    """Each stage's outcome as a session summary records it: ``name`` and ``outcome`` (its
    words), with ``s`` and ``limit`` for a stage that ran."""
    found = []
    for line in summary.splitlines():
        ran, skipped, idle = _STAGE.match(line), _SKIPPED.match(line), _NOT_RUN.match(line)
        if ran:
            name, rc, took, limit, _command = ran.groups()
            how = {"0": "completed", "124": "stopped at its time limit"}.get(
                rc, f"failed (rc={rc})"
            )
            found.append({"name": name, "outcome": how, "s": int(took), "limit": int(limit)})
        elif skipped:
            name, left = skipped.groups()
            found.append({"name": name, "outcome": f"skipped ({left} s left)"})
        elif idle:
            found.append({"name": idle.group(1), "outcome": f"not run ({idle.group(2)})"})
    return found


def stage_words(stage: Mapping[str, Any]) -> str:
    """One stage's outcome in a sentence's words: "`capture` completed (63 s of 210)"."""
    took = f" ({stage['s']} s of {stage['limit']})" if "s" in stage else ""
    return f"`{stage['name']}` {stage['outcome']}{took}"


def lease_readme(folder: Path) -> str:
    """A lease folder's README: the session's header, each stage's outcome and files."""
    summary = (folder / SESSION_SUMMARY).read_text()
    head = summary.splitlines()[:4]
    gpu, date = summary_identity(summary)
    lines = [
        f"# What the {gpu or 'CPU'} lease of {date or 'an unknown date'} printed",
        "",
        "<!-- written by `python tools/results_page.py --lease` from the session's output -->",
        "",
        "`tools/gpu_session.sh`'s header:",
        "",
        "```",
        *head,
        "```",
        "",
        "| stage | outcome | seconds (limit) | files |",
        "|---|---|---:|---|",
    ]
    for s in stages(summary):
        files = sorted(p.name for p in folder.iterdir() if p.stem == s["name"])
        took = f"{s['s']} ({s['limit']})" if "s" in s else "-"
        lines.append(f"| `{s['name']}` | {s['outcome']} | {took} | {', '.join(files) or '-'} |")
    lines += [
        "",
        "Each stage's command is its line in session_summary.txt; the figures: "
        "[../README.md](../README.md#on-a-gpu).",
    ]
    return "\n".join(lines) + "\n"

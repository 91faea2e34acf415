"""What the study's runs cost in time, read from their own ``log.txt``.

A run's log has a timestamp on every line the trainer writes: the start of training, each
evaluation, each resume, the final evaluation. A run interrupted and resumed has several
segments, each from its start line to the last timestamped line before the next start; the
run's time is the sum of its segments (the gap while it was stopped is not counted, nor the
work lost after a segment's last line, nor the seconds before the first line: building the
model and the data). ``metrics.jsonl`` holds no wall-clock timestamps (only seconds per
iteration, without evaluation), so a run without a ``log.txt`` falls back to its records in
the study's ``study_times.jsonl``.

The machine's time divides each run's time by the runs that shared the machine with it: the
``jobs`` its ``study_times.jsonl`` record names, or for a run it does not list the ``jobs`` most
of its records name (how the study is run; the report's ``--jobs`` when there are none). That
assumes the runs side by side shared the cores equally the whole time.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_RESUMED = " INFO resumed from "
_TRAINING = " INFO training "


@dataclass(frozen=True)
class RunTime:
    """One finished run's time: seconds, how many segments, where read, runs sharing."""

    name: str
    seconds: float
    segments: int
    source: str  # "log.txt" or "study_times.jsonl"
    jobs: int


@dataclass(frozen=True)
class RegimeTime:
    """The time of a regime's finished runs, summed over runs and as the machine's share."""

    regime: str
    runs: tuple[RunTime, ...]
    untimed: tuple[str, ...]  # finished runs with neither a log.txt nor a study_times record

    @property
    def hours(self) -> float:
        """Hours summed over runs."""
        return sum(r.seconds for r in self.runs) / 3600

    @property
    def machine_hours(self) -> float:
        """Hours of the machine: each run's time divided by the runs sharing it."""
        return sum(r.seconds / r.jobs for r in self.runs) / 3600


def log_segments(text: str) -> list[tuple[datetime, datetime]]:
    """(start, last timestamp) of each training segment of a run's log."""
    segments: list[list[datetime]] = []
    previous = ""
    for line in text.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        stamp = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
        starts = _RESUMED in line or (_TRAINING in line and _RESUMED not in previous)
        if starts:
            segments.append([stamp, stamp])
        elif segments:
            segments[-1][1] = stamp
        previous = line
    return [(a, b) for a, b in segments]


def read_times_file(path: Path) -> dict[str, list[dict]]:
    """Run name -> its records in a study_times.jsonl (empty when there is none)."""
    records: dict[str, list[dict]] = {}
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a stopped study
        if isinstance(record, dict) and isinstance(record.get("run"), str):
            records.setdefault(record["run"], []).append(record)
    return records


def usual_jobs(times: dict[str, list[dict]], default: int = 1) -> int:
    """The ``jobs`` most records name (``default`` without records): the study's usual --jobs."""
    counts = Counter(int(r["jobs"]) for rs in times.values() for r in rs if r.get("jobs"))
    return counts.most_common(1)[0][0] if counts else default


def run_time(run_dir: Path, name: str, records: Sequence[dict], jobs: int) -> RunTime | None:
    """A finished run's time from its log (or its study_times records); None with neither."""
    shared = next((int(r["jobs"]) for r in reversed(records) if r.get("jobs")), jobs)
    log = run_dir / "log.txt"
    if log.is_file():
        segments = log_segments(log.read_text(errors="replace"))
        if segments:
            seconds = sum((b - a).total_seconds() for a, b in segments)
            return RunTime(name, seconds, len(segments), "log.txt", shared)
    if records:
        seconds = sum(float(r.get("seconds", 0.0)) for r in records)
        return RunTime(name, seconds, len(records), "study_times.jsonl", shared)
    return None


def regime_time(out: Path, regime: str, times: dict[str, list[dict]], jobs: int) -> RegimeTime:
    """The time of every finished run (a folder with eval.json) of one regime folder."""
    timed, untimed = [], []
    folder = out / regime
    dirs = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    for run_dir in dirs:
        if not (run_dir / "eval.json").is_file():
            continue
        name = f"{regime}/{run_dir.name}"
        found = run_time(run_dir, name, times.get(name, []), jobs)
        if found is None:
            untimed.append(name)
        else:
            timed.append(found)
    return RegimeTime(regime, tuple(timed), tuple(untimed))


def time_table(rows: Sequence[RegimeTime]) -> list[str]:
    """Markdown: per regime, runs timed (from which file), hours summed and of the machine."""
    lines = [
        "| regime | finished runs | timed from log.txt | from study_times.jsonl "
        "| hours, summed over runs | hours of the machine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in [*rows, _total(rows)]:
        n_log = sum(r.source == "log.txt" for r in row.runs)
        label = f"**{row.regime}**" if row.regime == "all" else row.regime
        lines.append(
            f"| {label} | {len(row.runs) + len(row.untimed)} | {n_log} "
            f"| {len(row.runs) - n_log} | {row.hours:.1f} | {row.machine_hours:.1f} |"
        )
    return lines


def _total(rows: Sequence[RegimeTime]) -> RegimeTime:
    return RegimeTime(
        "all",
        tuple(r for row in rows for r in row.runs),
        tuple(u for row in rows for u in row.untimed),
    )

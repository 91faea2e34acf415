"""What the study's runs cost in time, read from their own ``log.txt`` (or, without one, the
study's ``study_times.jsonl``): each resumed segment from its start line to its last, plus the
iterations it trained past that line up to the checkpoint the next segment resumed from. The
report's time account (study_report.time_account) says the rule on the page, shapes.md.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rcnn_dropit.metrics_file import read_metrics

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_RESUMED = " INFO resumed from "
_TRAINING = " INFO training "
_AT = re.compile(r"(?:evaluation|resumed from .*) at iteration (\d+)")


@dataclass(frozen=True)
class Segment:
    """One stretch of training in a log: from its start line to its last timestamped line, the
    iteration that line stands at, and the iteration the next segment resumed from."""

    start: datetime
    end: datetime
    last_iter: int
    resumed_at: int | None = None

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


@dataclass(frozen=True)
class RunTime:
    """One finished run's time: seconds, where read, how many runs shared the machine."""

    seconds: float
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
        return sum(r.seconds for r in self.runs) / 3600

    @property
    def machine_hours(self) -> float:
        """Hours of the machine: each run's time divided by the runs sharing it."""
        return sum(r.seconds / r.jobs for r in self.runs) / 3600


def log_segments(text: str) -> list[Segment]:
    """The training segments of a run's log, in order."""
    found: list[Segment] = []
    previous = ""
    for line in text.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        stamp = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
        at = _AT.search(line)
        starts = _RESUMED in line or (_TRAINING in line and _RESUMED not in previous)
        if starts:
            resumed = int(at[1]) if _RESUMED in line and at else 0
            if found and _RESUMED in line:
                found[-1] = Segment(found[-1].start, found[-1].end, found[-1].last_iter, resumed)
            found.append(Segment(stamp, stamp, resumed))
        elif found:
            last = int(at[1]) if at else found[-1].last_iter
            found[-1] = Segment(found[-1].start, stamp, last)
        previous = line
    return found


def iteration_seconds(records: Sequence[dict]) -> dict[int, float]:
    """Logged iteration -> seconds of the iterations since the one logged before it, from the
    train records of metrics.jsonl (seconds per iteration x the iterations in the window); the
    first record of an iteration wins (a resumed run logs some iterations twice)."""
    per_iter: dict[int, float] = {}
    for r in records:
        it, t = r.get("iter"), r.get("time")
        if r.get("type") == "train" and isinstance(it, int) and isinstance(t, (int, float)):
            per_iter.setdefault(it, float(t))
    out, before = {}, 0
    for it in sorted(per_iter):
        out[it] = per_iter[it] * (it - before)
        before = it
    return out


def segments_seconds(segments: Sequence[Segment], records: Sequence[dict]) -> float:
    """Seconds of all segments, each with the iterations it trained past its last line up to
    the checkpoint the next segment resumed from."""
    windows = iteration_seconds(records)
    total = 0.0
    for seg in segments:
        total += seg.seconds
        if seg.resumed_at is not None and seg.resumed_at > seg.last_iter:
            total += sum(v for it, v in windows.items() if seg.last_iter < it <= seg.resumed_at)
    return total


def read_times_file(path: Path) -> dict[str, list[dict]]:
    """Run name -> its records in a study_times.jsonl (empty when there is none)."""
    records: dict[str, list[dict]] = {}
    for record in read_metrics(path):  # a line cut short by a stopped study is left out
        if isinstance(record, dict) and isinstance(record.get("run"), str):
            records.setdefault(record["run"], []).append(record)
    return records


def usual_jobs(times: dict[str, list[dict]], default: int) -> int:
    """The ``jobs`` most records name (``default`` without records): the study's usual --jobs."""
    counts = Counter(int(r["jobs"]) for rs in times.values() for r in rs if r.get("jobs"))
    return counts.most_common(1)[0][0] if counts else default


def run_time(run_dir: Path, records: Sequence[dict], jobs: int) -> RunTime | None:
    """A finished run's time from its log (or its study_times records); None with neither."""
    shared = next((int(r["jobs"]) for r in reversed(records) if r.get("jobs")), jobs)
    log = run_dir / "log.txt"
    if log.is_file():
        segments = log_segments(log.read_text(errors="replace"))
        if segments:
            seconds = segments_seconds(segments, read_metrics(run_dir / "metrics.jsonl"))
            return RunTime(seconds, "log.txt", shared)
    if records:
        seconds = sum(float(r.get("seconds", 0.0)) for r in records)
        return RunTime(seconds, "study_times.jsonl", shared)
    return None


def finished_run_dirs(out: Path, regime: str) -> list[Path]:
    """The finished runs (folders with eval.json) of one regime folder, planned or not, by name:
    what the time table counts."""
    folder = out / regime
    dirs = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    return [d for d in dirs if (d / "eval.json").is_file()]


def regime_time(out: Path, regime: str, times: dict[str, list[dict]], jobs: int) -> RegimeTime:
    """The time of every finished run (a folder with eval.json) of one regime folder."""
    timed, untimed = [], []
    for run_dir in finished_run_dirs(out, regime):
        name = f"{regime}/{run_dir.name}"
        found = run_time(run_dir, times.get(name, []), jobs)
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
    total = RegimeTime(
        "all",
        tuple(r for row in rows for r in row.runs),
        tuple(u for row in rows for u in row.untimed),
    )
    for row in [*rows, total]:
        n_log = sum(r.source == "log.txt" for r in row.runs)
        label = f"**{row.regime}**" if row.regime == "all" else row.regime
        lines.append(
            f"| {label} | {len(row.runs) + len(row.untimed)} | {n_log} "
            f"| {len(row.runs) - n_log} | {row.hours:.1f} | {row.machine_hours:.1f} |"
        )
    return lines

"""The study's committed pages are what the report tool writes from the committed runs and
the methods bench (``BENCH_FILE``): docs/results/shapes.md, docs/results/shapes_notes.md and the
study-choice block of docs/choosing.md. A page that quotes an older bench, or runs that changed
since, fails here with the command that rewrites it (as test_methods_bench.py checks the blocks
of memory.md against their JSON files)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from instruments.measure.methods_table import methods_by_setting
from instruments.measure.study_plan import load_plan
from instruments.measure.study_report import render_study_report, rendered_notes_path
from instruments.report.choice import BEGIN, END
from instruments.report.goal import BENCH_FILE, with_schedules
from tests.helpers import REPO

PLAN = "configs/study/plan.yaml"
JOBS = 2  # the study's usual --jobs (make study): the pages name the command with it
REGENERATE = f"python tools/study.py --plan {PLAN} --jobs {JOBS} --report-only"
BENCH = REPO / "docs/results" / BENCH_FILE
# The machine and torch that wrote the report: the writer's, not the data's, so not compared.
_WRITTEN_ON = re.compile(r" on [^;`]+, torch [^;`]+; run directories")
CHOICE_HEADER = "| setting | layers | seeds |"


def _unmatched(path: Path, written: str) -> list[str]:
    """The lines where ``path`` differs from what the tool writes now (none when equal)."""
    committed, written = (
        _WRITTEN_ON.sub(" on ...; run directories", t) for t in (path.read_text(), written)
    )
    return list(
        difflib.unified_diff(
            committed.splitlines(), written.splitlines(), str(path), "written now", lineterm="", n=0
        )
    )


def test_the_committed_study_pages_are_what_the_report_tool_writes(
    tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("matplotlib")  # without it the report says its figures are not drawn
    from matplotlib.figure import Figure

    monkeypatch.chdir(REPO)  # the plan's paths, and the paths the pages name, are relative
    # the figures are laid out (the report links those it could draw) but not saved: the test is
    # about the text, and saving is half of its time
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: None)
    plan = load_plan(PLAN)
    pages = render_study_report(plan, PLAN, JOBS, figure_dir=tmp_path)
    notes = rendered_notes_path(plan)
    assert plan.readme is not None and notes is not None and pages.notes is not None
    assert pages.readme is not None
    for path, written in (
        (plan.report, pages.report),
        (plan.readme, pages.readme),
        (notes, pages.notes),
    ):
        diff = _unmatched(path, written)
        assert not diff, (
            f"{path} is not what the study's report tool writes from the runs under {plan.out} "
            f"and {BENCH_FILE}; run: {REGENERATE}\n" + "\n".join(diff[:40])
        )


def _choice_ratios(text: str, where: str) -> dict[str, list[str]]:
    """setting -> its saved, peak and step-time cells in the choice table of ``text``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(CHOICE_HEADER)]
    assert len(starts) == 1, f"{where}: expected one table headed '{CHOICE_HEADER}'"
    header = [c.strip() for c in lines[starts[0]].strip("|").split("|")]
    assert header[-3:] == ["saved", "peak", "step time"], f"{where}: {header}"
    rows = {}
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[-3:]
    return rows


@pytest.mark.parametrize("doc", ["docs/choosing.md", "docs/results/shapes.md"])
def test_every_bench_ratio_of_the_choice_table_is_methods_bench_json(doc: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # the plan names its regimes' configs relative to the checkout
    text = (REPO / doc).read_text()
    if doc.endswith("choosing.md"):  # the generated block, not the prose around it
        assert text.count(BEGIN) == 1 and text.count(END) == 1
        text = text.split(BEGIN)[1].split(END)[0]
    rows = _choice_ratios(text, doc)
    assert rows, f"{doc}: the choice table has no rows"
    plan = load_plan(PLAN)
    bench = with_schedules(methods_by_setting(BENCH), [*plan.settings, *rows]) or {}
    wrong = []
    for setting, cells in rows.items():
        figures = bench.get(setting, {})
        for key, cell in zip(("saved_ratio", "peak_ratio", "step_ratio"), cells, strict=True):
            value = figures.get(key)
            expected = "-" if value is None else f"{float(value):.2f}x"
            if cell != expected:
                wrong.append(f"{setting} {key}: {cell} on the page, {expected} in {BENCH_FILE}")
    assert not wrong, f"{doc} quotes another bench than {BENCH}; run: {REGENERATE}\n" + "\n".join(
        wrong
    )

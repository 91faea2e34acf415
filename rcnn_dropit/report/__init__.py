"""Comparison report of run directories: AP/memory/speed tables and figures, no torch needed."""

from rcnn_dropit.report.build import NoUsableRuns, build_report
from rcnn_dropit.report.groups import Row, make_rows
from rcnn_dropit.report.runs import Run, RunNotUsable, load_run

__all__ = ["NoUsableRuns", "Row", "Run", "RunNotUsable", "build_report", "load_run", "make_rows"]

"""Run the shapes accuracy study of a plan (regimes x DropIT settings x seeds), resumably.

Finished runs are skipped and interrupted ones resumed; the report is written at the end
(--report-only writes it from the runs on disk without training).
"""

from __future__ import annotations

import argparse
import signal
import sys

from instruments.measure.study import run_study
from instruments.measure.study_plan import check_runs, load_plan, plan_runs
from rcnn_dropit.cli import run_cli


def main(argv: list[str] | None = None) -> int:
    """Entry point of tools/study.py."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", default="configs/study/plan.yaml")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained side by side, sharing the CPU cores (2 is fastest on 2 cores)",
    )
    parser.add_argument(
        "--threads", type=int, help="CPU threads per run (default: the cores / --jobs)"
    )
    parser.add_argument("--regimes", nargs="+", default=[], help="only these regimes")
    parser.add_argument("--list", action="store_true", help="print the planned runs and exit")
    parser.add_argument(
        "--report-only", action="store_true", help="write the report, train nothing"
    )
    args = parser.parse_args(argv)
    # `kill` (make study runs in the background) stops the study like Ctrl-C: its trainings
    # are terminated too and resume from their last checkpoints next time.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def go() -> None:
        if args.list:
            plan = load_plan(args.plan)
            runs = plan_runs(plan)
            check_runs(runs)
            for run in runs:
                done = (plan.out / run.name / "eval.json").is_file()
                print(f"{'done ' if done else 'todo '} {run.name}  {' '.join(run.overrides)}")
            return
        if args.report_only:
            from instruments.measure.study_report import write_study_report

            print(write_study_report(load_plan(args.plan), args.plan, args.jobs))
            return
        print(run_study(args.plan, args.jobs, args.regimes, args.threads))

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())

"""Run the shapes accuracy study (baseline, mink, parallel_mink, random at gamma=0.8; 2 seeds).

Resumable: finished runs are skipped and interrupted ones resumed. Writes the grouped report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from rcnn_dropit.engine.cli import run_cli  # noqa: E402
from rcnn_dropit.study import run_study  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/study/shapes_maskrcnn.yaml")
    parser.add_argument(
        "--out", default="docs/results/shapes_runs", help="folder of the run directories"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--report", default="docs/results/shapes.md")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained side by side, sharing the CPU cores (2 is fastest on 2 cores)",
    )
    args = parser.parse_args(argv)
    return run_cli(
        lambda: print(run_study(args.config, args.out, args.seeds, args.report, args.jobs))
    )


if __name__ == "__main__":
    sys.exit(main())

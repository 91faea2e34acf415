"""Compare run directories: Markdown tables of AP, memory and speed, plus PNG figures."""

import argparse
import sys

from rcnn_dropit.cli import run_cli
from rcnn_dropit.report import build_report


def main(argv: list[str] | None = None) -> int:
    """Entry point (``dropit-report``): write the report, print where it went (or the Markdown
    for --out -)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    parser.add_argument(
        "--baseline", metavar="RUN_DIR", help="baseline run (default: first run without DropIT)"
    )
    parser.add_argument(
        "--out",
        default="report.md",
        help="Markdown path, figures go next to it; '-' prints it (no figures)",
    )
    parser.add_argument(
        "--group-seeds", action="store_true", help="average runs that differ only in train.seed"
    )
    args = parser.parse_args(argv)
    out = None if args.out == "-" else args.out

    def go() -> None:
        markdown = build_report(
            args.run_dirs, baseline=args.baseline, out=out, group_seeds=args.group_seeds
        )
        if out is None:
            sys.stdout.write(markdown)
        else:
            print(f"wrote {out}")

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())

"""Train Faster/Mask R-CNN (optionally with DropIT) from a config; works under torchrun."""

from __future__ import annotations

import argparse
import sys

from rcnn_dropit.cli import add_opts_argument, finish, run_cli
from rcnn_dropit.engine import train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="e.g. configs/maskrcnn_g0.8.yaml")
    add_opts_argument(parser)
    parser.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue a run: 'auto' = newest checkpoint in the output dir, or a checkpoint file",
    )
    parser.add_argument("--output-dir", help="run directory (default: outputs/<config name>)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the run files of a used output dir"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``dropit-train``): the exit code; a process of a multi-process job ends here."""
    args = parse_args(argv)
    code = run_cli(
        lambda: train(
            args.config,
            overrides=args.opts,
            resume=args.resume,
            output_dir=args.output_dir,
            overwrite=args.overwrite,
        )
    )
    return finish(code)


if __name__ == "__main__":
    sys.exit(main())

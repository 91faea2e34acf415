"""Evaluate a checkpoint on the validation set of a config (COCO box/mask AP)."""

from __future__ import annotations

import argparse
import sys

from rcnn_dropit.cli import add_opts_argument, finish, run_cli
from rcnn_dropit.engine import test


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="config the model was trained with")
    parser.add_argument("--checkpoint", required=True, help="checkpoint file (.pth)")
    parser.add_argument(
        "--output-dir", help="where eval.json and COCO results go (default: outputs/<name>/test)"
    )
    add_opts_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``dropit-test``): the exit code; a process of a multi-process job ends here."""
    args = parse_args(argv)
    code = run_cli(
        lambda: test(args.config, args.checkpoint, output_dir=args.output_dir, overrides=args.opts)
    )
    return finish(code)


if __name__ == "__main__":
    sys.exit(main())

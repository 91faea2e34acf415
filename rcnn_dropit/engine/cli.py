"""Command-line plumbing shared by tools/train.py and tools/test.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_opts_argument(parser: argparse.ArgumentParser) -> None:
    """--opts key=value ... config overrides."""
    parser.add_argument(
        "--opts",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, e.g. --opts solver.lr=0.01 train.device=cpu",
    )


def run_cli(fn: Callable[[], object]) -> int:
    """Call fn; user errors become one 'error: ...' line and exit code 2, no traceback."""
    try:
        fn()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except FloatingPointError as err:
        # Training diverged: not a usage error, but the message says all there is to say.
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0

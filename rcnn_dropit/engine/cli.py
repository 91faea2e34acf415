"""Command-line plumbing shared by tools/train.py and tools/test.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rcnn_dropit.checkpoint import CheckpointWriteError


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
    except (FloatingPointError, CheckpointWriteError, OSError) as err:
        # Training diverged, or the disk is full: not a usage error, but the message says all
        # there is to say (the last good checkpoint stays usable for --resume auto).
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0

"""Command-line plumbing shared by tools/train.py and tools/test.py."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from rcnn_dropit.checkpoint.files import CheckpointWriteError
from rcnn_dropit.distributed import read_launch_env


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


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``: in a multi-process job, without interpreter shutdown.

    DistributedDataParallel keeps the gloo process group, and its worker threads, alive past
    ``destroy_process_group``. A worker that lets go of a tensor while the interpreter shuts
    down aborts the process ("terminate called without an active exception", SIGABRT): after
    the run had finished, or failed with its message, cleanly. By the time this is called the
    run's files are written and closed, so skipping the shutdown loses nothing; stdio is
    flushed first. A single process exits the ordinary way.
    """
    if read_launch_env().world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

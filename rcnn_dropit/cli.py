"""Command-line plumbing shared by every tool (rcnn_dropit.commands): the --opts argument, how a
failure reaches the console, and how a process of a multi-process job ends."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

from rcnn_dropit.errors import CheckpointWriteError, UsageError, one_line
from rcnn_dropit.provenance import note_other_checkout


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
    """Call fn and turn its failure into an exit code and what the console shows.

    A UsageError (the user can fix it) is one 'error: ...' line, exit code 2. A diverged run or a
    full disk is one line too, exit code 1: the message says all there is to say. Anything else
    is a bug: its full traceback, exit code 1. (A run's log.txt keeps the traceback either way.)
    """
    note_other_checkout(sys.argv[0])  # tools/X.py of one checkout running another's code
    try:
        fn()
    except UsageError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except (FloatingPointError, CheckpointWriteError, OSError) as err:
        # The last good checkpoint stays usable for --resume auto.
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def finish(code: int) -> int:
    """``code`` back to the caller; in a multi-process job, end the process here with it.

    DistributedDataParallel keeps the gloo process group, and its worker threads, alive past
    ``destroy_process_group``. A worker that lets go of a tensor while the interpreter shuts
    down aborts the process ("terminate called without an active exception", SIGABRT): after
    the run had finished, or failed with its message, cleanly. By the time this is called the
    run's files are written and closed, so skipping the shutdown loses nothing; stdio is
    flushed first. A single process returns, and exits the ordinary way.
    """
    from rcnn_dropit.distributed import read_launch_env  # here: the report tool needs no torch

    if read_launch_env().world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

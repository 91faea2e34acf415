"""``tools/results_page.py``: write docs/results/README.md and the blocks other pages quote from
it, or (``--check``) say which of them are not what the committed data gives; with ``--lease
OUT``, first bring a GPU lease's output (tools/gpu_session.sh's $OUT) into its folder,
docs/results/gpu_<gpu>_<date>/."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from instruments.report import gpu_pass
from instruments.report.results_page import COMMAND, REPO, lease_folder, render, stale, write
from rcnn_dropit.cli import run_cli
from rcnn_dropit.errors import UsageError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 under --check when a file is stale)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is stale"
    )
    parser.add_argument(
        "--lease-dir",
        action="store_true",
        help="print the folder a GPU table of this machine's GPU, today, goes into; write nothing",
    )
    parser.add_argument(
        "--lease",
        type=Path,
        metavar="OUT",
        help="first copy a lease's output (summary.txt, lease.tar, loose logs) into "
        "docs/results/gpu_<gpu>_<date>/ (named from summary.txt), with its README",
    )
    parser.add_argument(
        "--into",
        type=Path,
        metavar="FOLDER",
        help="with --lease: this folder instead (a lease whose GPU has no model number)",
    )
    args = parser.parse_args(argv)
    if args.into and not args.lease:
        parser.error("--into goes with --lease")
    if args.lease:
        status = run_cli(lambda: _import(args.lease, args.into))
        if status:
            return status
    if args.lease_dir:
        import datetime

        import torch

        if not torch.cuda.is_available():
            raise SystemExit("error: --lease-dir: no CUDA device on this machine")
        today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        print(lease_folder(torch.cuda.get_device_name(0), today).relative_to(REPO))
        return 0
    rendered = render()
    if args.check:
        old = stale(rendered)
        for path in old:
            print(f"stale: {path.relative_to(REPO)} (run: {COMMAND})", file=sys.stderr)
        return 1 if old else 0
    for path in write(rendered):
        print(f"wrote {path.relative_to(REPO)}")
    return 0


def _import(source: Path, into: Path | None) -> None:
    """Copy a lease's output into its folder and say where."""
    gpu, date = gpu_pass.lease_identity(source)
    if into is None:
        if gpu is None:
            raise UsageError(f"--lease: {source}/summary.txt names no GPU; give --into FOLDER")
        into = lease_folder(gpu, date)
    for path in gpu_pass.import_lease(source, into):
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")

"""``tools/results_page.py``: write docs/results/README.md and the blocks other pages quote from
it, or (``--check``) say which of them are not what the committed data gives."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from instruments.report.results_page import COMMAND, REPO, lease_folder, render, stale, write


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
    args = parser.parse_args(argv)
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

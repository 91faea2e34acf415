"""Writes README.md of this folder from the host bench files beside it.

python docs/results/host_ab_layout/make_readme.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEFORE, AFTER = "bc37f9d", "this session's tree (subpackages, one backward body per op)"


def _rows(name: str) -> dict[tuple[str, str], dict]:
    return {(r["stack"], r["dropit"]): r for r in json.loads((HERE / name).read_text())}


def main() -> None:
    rounds = sorted({int(p.stem.rsplit("_", 1)[1]) for p in HERE.glob("host_*_*.json")})
    lines = [
        "# Host time per DropIT layer, before and after dropit_core's subpackages (issue 57)",
        "",
        "`make bench-host`'s rows (the GPU path with its Triton launches stubbed, on the CPU;",
        "median of 31 rounds per row), each commit in a worktree with its own code on the path,",
        "alternating, twice, on the 2-core CPU machine with nothing else running (2026-12-02):",
        "",
        "```bash",
        "PYTHONPATH=. python tools/bench.py --host --repeats 31 --json <file>",
        "```",
        "",
        f"Before: {BEFORE}. After: {AFTER}. DropIT's time over the plain stack's, per round",
        "(the plain stack is timed in the same run); the issue's target is 1.6x for the `layers`",
        "rows:",
        "",
        "| stack | DropIT on | " + " | ".join(f"before {r} | after {r}" for r in rounds) + " |",
        "|---|---|" + "---:|" * (2 * len(rounds)),
    ]
    first = _rows(f"host_before_{rounds[0]}.json")
    for key in first:
        cells = []
        for r in rounds:
            for side in ("before", "after"):
                row = _rows(f"host_{side}_{r}.json").get(key)
                cells.append("-" if row is None else f"{row['dropit_us'] / row['plain_us']:.2f}x")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    lines.append("")
    (HERE / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

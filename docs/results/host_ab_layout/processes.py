"""The host bench's two `layers` rows (conv, conv+relu) in many short processes, before and after
alternating, written to host_processes.json: one process's ratio moves by a tenth or more on a
shared machine, so the page reads the median of many.

python docs/results/host_ab_layout/processes.py BEFORE_WORKTREE [--rounds 8]

Each process times one stack, plain against DropIT's `layers` row, the fastest of 21 rounds of 50
steps (as `tools/bench.py --host` does with 31), with the code of its own tree on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parents[2]
STACKS = ("conv", "conv+relu")

# Run in a child with one tree on the path: its own dropit_core and host bench.
_CHILD = """
import json, sys, torch
from instruments.measure import host_bench as hb
from dropit_core.timing import timed_rounds
torch.set_num_threads(1)
stack, x0 = sys.argv[1], torch.randn(1, 8, 8, 8)
plain = hb._stack(20, 8, stack)
models = [plain, hb._dropit(plain, "layers")]
def steps(m):
    def run():
        for _ in range(50):
            m(x0.clone().requires_grad_(True)).sum().backward()
    return run
with hb.stubbed_launches():
    times = timed_rounds([steps(m) for m in models], 21)
plain_us, dropit_us = (min(t) / 50 / 20 * 1e6 for t in times)
print(json.dumps({"plain_us": round(plain_us, 1), "dropit_us": round(dropit_us, 1)}))
"""


def _one(tree: Path, stack: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, stack], cwd=tree, env=env, check=True,
        capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="a worktree of the commit before")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for stack in STACKS:
        for round_ in range(1, args.rounds + 1):
            for side, tree in (("before", args.before.resolve()), ("after", CHECKOUT)):
                row = {"stack": stack, "side": side, "round": round_, **_one(tree, stack)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    (HERE / "host_processes.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

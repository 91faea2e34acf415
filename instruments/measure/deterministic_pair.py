"""``train.deterministic`` on a device (``tools/gpu_checks.py pair``): two short runs of one seed
with the key, whose logged losses should be the same, and one run of that seed without it, whose
step time prices the key.

Each run is ``tools/train.py`` in a fresh process (torch sizes cuBLAS's workspace once per
process, and the key sets it before CUDA starts), logging every iteration; the figures come from
the runs' metrics.jsonl: every ``loss*`` term of every logged iteration, compared as logged, and
each record's ``time`` (seconds per iteration), of which the first quarter (warm-up: kernels
chosen, Triton and torch.compile building) is left out of the step's median.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tools" / "train.py"
# (run name, train.deterministic): the pair first, then the run without the key
RUNS = (("deterministic_a", True), ("deterministic_b", True), ("default", False))


def run_command(
    config: str,
    out: Path,
    deterministic: bool,
    iters: int,
    device: str,
    amp: str,
    opts: Sequence[str],
) -> list[str]:
    """The training command of one run: ``opts`` after the pair's own overrides."""
    return [
        sys.executable,
        str(TRAIN),
        "--config",
        config,
        "--output-dir",
        str(out),
        "--overwrite",
        "--opts",
        f"train.deterministic={str(deterministic).lower()}",
        f"solver.max_iters={iters}",
        f"train.device={device}",
        f"solver.amp={amp}",
        "train.log_every=1",
        "train.measure_memory=false",
        *opts,
    ]


def train_records(run: Path) -> list[dict[str, Any]]:
    """The logged training records of a run ([] when it wrote none)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("type") == "train"]


def losses(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Every logged iteration's loss terms."""
    return [
        {k: v for k, v in r.items() if k.startswith("loss")} | {"iter": r["iter"]} for r in records
    ]


def compare(a: Sequence[Mapping], b: Sequence[Mapping]) -> dict[str, Any]:
    """Whether two runs logged the same losses: ``identical``, the first iteration where they
    differ and the largest difference of a loss term there and after."""
    first, largest = None, 0.0
    for x, y in zip(a, b, strict=False):
        keys = set(x) | set(y)
        gaps = [abs(x[k] - y[k]) for k in keys - {"iter"} if k in x and k in y]
        if any(k not in x or k not in y for k in keys) or any(gaps):
            first = x["iter"] if first is None else first
            largest = max([largest, *gaps])
    same_length = len(a) == len(b) and len(a) > 0
    return {
        "identical": first is None and same_length,
        "iterations": min(len(a), len(b)),
        "first_difference_iter": first,
        "largest_difference": largest,
    }


def step_seconds(records: Sequence[Mapping[str, Any]]) -> float | None:
    """The median logged seconds per iteration after the first quarter of the records."""
    times = [r["time"] for r in records[len(records) // 4 :] if r.get("time") is not None]
    return round(statistics.median(times), 4) if times else None


def deterministic_pair(
    config: str,
    workdir: Path,
    iters: int = 30,
    device: str = "cuda",
    amp: str = "fp16",
    opts: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the pair and the run without the key under ``workdir``; what they logged, compared."""
    runs = []
    for name, deterministic in RUNS:
        out = workdir / name
        cmd = run_command(config, out, deterministic, iters, device, amp, opts)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        if proc.returncode and not errors:
            errors = proc.stderr.strip().splitlines()[-1:]
        records = train_records(out)
        runs.append(
            {
                "name": name,
                "deterministic": deterministic,
                "rc": proc.returncode,
                "error": errors[-1] if proc.returncode and errors else None,
                "iterations": len(records),
                "step_s": step_seconds(records),
                "losses": losses(records),
            }
        )
    a, b, plain = runs
    ratio = None
    if a["step_s"] and b["step_s"] and plain["step_s"]:
        ratio = round(statistics.mean([a["step_s"], b["step_s"]]) / plain["step_s"], 4)
    return {
        "config": config,
        "iters": iters,
        "device": device,
        "amp": amp,
        "opts": list(opts),
        "pair": compare(a["losses"], b["losses"]),
        "without_key": compare(a["losses"], plain["losses"]),
        "key_step_ratio": ratio,
        "runs": runs,
    }

"""Shared test helpers and tiers.

Tiers: unmarked tests are the quick inner loop (`make test-fast`, `-m "not slow"`); `slow` marks
tests that train or start fresh interpreters, `dist` those that start several processes
(torchrun or plain processes with the launcher's variables). `make test` runs everything.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from rcnn_dropit.logging_utils import read_metrics

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY, TEST_PY = REPO / "tools/train.py", REPO / "tools/test.py"
FASTER_CFG = REPO / "configs/demo/fasterrcnn_shapes.yaml"
MASK_CFG = REPO / "configs/demo/maskrcnn_shapes_baseline.yaml"
MASK_DROPIT_CFG = REPO / "configs/demo/maskrcnn_shapes_g0.8.yaml"
# Launcher variables of an enclosing job must not leak into the jobs a test starts.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")


def pytest_configure(config) -> None:
    """Register the tier markers."""
    config.addinivalue_line("markers", "slow: trains a model or starts fresh interpreters")
    config.addinivalue_line("markers", "dist: starts several processes of one distributed job")


def tiny_opts(root: Path, *extra: str, num_val: int = 4, batch_size: int = 2) -> list[str]:
    """Overrides for a seconds-long CPU run: 8 train / ``num_val`` val shapes images of 64 px
    (generated under ``root`` on first use), ResNet-18 from the demo configs, few RoIs, logging
    every step, no evaluation before the end, no memory report."""
    return [
        f"data.root={root}",
        "data.shapes.num_train=8",
        f"data.shapes.num_val={num_val}",
        "data.shapes.image_size=64",
        "data.num_workers=0",
        "model.min_size=64",
        "model.max_size=64",
        "model.box_batch_size_per_image=32",
        "model.rpn_batch_size_per_image=32",
        "model.box_detections_per_img=20",
        f"solver.batch_size={batch_size}",
        "solver.warmup_iters=2",
        "train.device=cpu",
        "train.log_every=1",
        "train.eval_every=0",
        "train.measure_memory=false",
        *extra,
    ]


def train_records(run: Path) -> list[dict]:
    """The training records of a run's metrics.jsonl, in order."""
    return [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """Environment for a started job: this one without launcher variables, one thread each."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun(launch: list[str], script: Path, args: list[str]) -> list[str]:
    """Command line of `torchrun <launch> script args` (as `python -m torch.distributed.run`)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch, str(script), *args]


def single_node(nproc: int = 2) -> list[str]:
    """torchrun options for nproc processes on this machine, on a free port."""
    return [f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def run_tool(script: Path, *args: str, cwd: Path, timeout: float = 300):
    """A tool as a user starts it: a fresh interpreter (slow: imports torch)."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=job_env(),
        timeout=timeout,
        check=False,
    )


def sorted_results(path: Path) -> list[str]:
    """A COCO results file's entries as sorted JSON strings (order-free comparison)."""
    return sorted(json.dumps(r, sort_keys=True) for r in json.loads(path.read_text()))

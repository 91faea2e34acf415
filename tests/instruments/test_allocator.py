"""The benchmark's allocator switch: glibc's steady state while timing, the measuring mode after."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from instruments.measure.allocator import training_allocator
from tests.helpers import REPO

# In a fresh process started for measuring: RSS kept after freeing a 16 MB tensor, inside the
# context and after it. One torch thread: the thresholds, not the thread pool, are what this
# checks, and a pool thread's allocation placed in the main heap above the tensor can keep its
# block from going back with it (the likely cause of one failure in a full serial run,
# after=16.0, not seen again in 45 runs of the probe alone).
PROBE = """
import json, torch
from instruments.measure.allocator import training_allocator

torch.set_num_threads(1)

def rss_mb():
    status = open("/proc/self/status").read().splitlines()
    return next(int(ln.split()[1]) / 1024.0 for ln in status if ln.startswith("VmRSS:"))

def kept_after_free():
    before = rss_mb()
    t = torch.ones(4 << 20)  # 16 MB, touched
    del t
    return rss_mb() - before

with training_allocator(torch.device("cpu")) as mode:
    inside = kept_after_free()
after = kept_after_free()
print(json.dumps({"mode": mode, "inside": inside, "after": after}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_timing_keeps_freed_blocks_in_the_heap_and_measuring_returns_them() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["mode"] == "glibc steady state"
    assert got["inside"] > 12  # the freed 16 MB stayed in the heap, as in a training process
    assert got["after"] < 4  # back to measuring: a freed block leaves RSS at once


def test_nothing_changes_on_a_gpu_or_outside_a_measuring_process(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    with training_allocator(torch.device("cuda")) as mode:
        assert mode == "as started"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    with training_allocator(torch.device("cpu")) as mode:
        assert mode == "as started"

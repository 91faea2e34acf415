"""The GPU probe's CPU-side logic: replaying an allocator trace to the blocks alive at its peak
(the live probe's peak_of), and naming the frame that asked for each (the CUDA parts run on a
GPU only: docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from instruments.commands.gpu_probe import main as probe_main
from instruments.measure.gpu_probe import launch_costs
from instruments.measure.live_probe import frame_of, peak_of, report_of, trace_lives

TV = {"filename": "/site/torchvision/ops/feature_pyramid_network.py", "line": 194, "name": "fwd"}
OURS = {"filename": "/work/main/dropit_core/layers/functions.py", "line": 200, "name": "conv"}
TORCH = {"filename": "/site/torch/nn/functional.py", "line": 9, "name": "interpolate"}


def _alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def test_the_peak_of_a_trace_keeps_the_blocks_alive_at_the_highest_point() -> None:
    trace = [
        _alloc(1, 10, TORCH, TV),
        _alloc(2, 20),
        {"action": "free_requested", "addr": 1, "size": 10},
        _alloc(3, 5),
        _alloc(4, 15, OURS),
        {"action": "free_requested", "addr": 4, "size": 15},
        {"action": "free_completed", "addr": 4, "size": 15},  # counted once, at the request
        _alloc(5, 9),
    ]
    peak, at, blocks = peak_of(trace_lives(trace))
    assert (peak, at) == (40, 4)  # 20 + 5 + 15, before 4 is freed; 5's 9 comes after
    assert [(b.born, b.nbytes) for b in blocks] == [(1, 20), (3, 5), (4, 15)]
    assert blocks[2].where == "dropit_core/layers/functions.py:200 conv"
    # the report reads the same peak, by frame; the step's last events are its backward's
    report = report_of(trace_lives(trace), len(trace), {4: ("alloc", "x")}, saved_known=False)
    report.scope, report.forward_ops = "step", 2
    assert report.phase == "backward" and report.peak_mb * 2**20 == 40
    assert "saved for backward not known" in "\n".join(report.lines())


def test_the_peak_of_a_trace_ignores_frees_of_blocks_from_before_the_trace() -> None:
    trace = [{"action": "free_requested", "addr": 7, "size": 99}, _alloc(1, 3)]
    assert peak_of(trace_lives(trace))[:2] == (3, 1)


def test_frame_of_names_the_innermost_frame_of_ours_or_torchvisions() -> None:
    assert frame_of([TORCH, TV, OURS]) == "torchvision/ops/feature_pyramid_network.py:194 fwd"
    assert frame_of([OURS, TV]) == "dropit_core/layers/functions.py:200 conv"
    assert frame_of([TORCH]) == "(no frame of ours)"


def test_the_probe_without_cuda_says_so_in_one_line(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the probe runs (docs/gpu.md)")
    assert probe_main(["--settings", "baseline", "--what", "memory"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_launch_costs_time_each_call_on_the_kernel_path() -> None:
    # Without a GPU the kernels run under the interpreter (tests/conftest.py): a few calls only.
    pytest.importorskip("triton")
    from tests.core.kernel_env import DEVICE, NEEDS_KERNELS

    if NEEDS_KERNELS.args[0]:  # no GPU and no interpreter
        pytest.skip(NEEDS_KERNELS.kwargs["reason"])
    rows = launch_costs(DEVICE.type, reps=2, rounds=1, n=512)
    assert [r["call"].split(" ")[0] for r in rows] == [
        "torch.relu", "Triton", "relu_mask", "quant_pack", "quant_rebuild", "quant_pack_signed",
    ]  # fmt: skip
    assert all(r["host_us"] > 0 for r in rows)

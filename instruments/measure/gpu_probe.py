"""Where one GPU training step's host time and peak memory go (a diagnostic: tools/gpu_probe.py).

The Python functions with the most time of their own (cProfile), and the allocations alive at
the step's CUDA peak (the caching allocator's trace, read as the live probe reads its tensors:
instruments.measure.live_probe), summed by the frame of our code or torchvision's that asked for
them, with whether the peak falls in the forward or backward. And the host's cost of one launch:
an aten op's, a bare Triton launch's and each DropIT wrapper's, on a tiny tensor
(:func:`launch_costs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from instruments.measure.live_probe import report_of, trace_lives
from instruments.measure.workload import step_loss

# Untimed steps first: a Triton kernel compiles for each new specialisation of its integer
# arguments (a size divisible by 16 or not), which the first steps of a model meet.
WARMUP = 10


def memory(model, batch, top: int) -> None:
    """One step recorded by the allocator; the blocks alive at its peak, grouped by frame."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    model.zero_grad(set_to_none=True)
    loss = step_loss(model, batch, "fp16")
    torch.cuda.synchronize()
    forward_events = len(torch.cuda.memory._snapshot()["device_traces"][0])
    loss.backward()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    lives = trace_lives(trace)
    made = {life.born: ("alloc", life.where) for life in lives}
    report = report_of(lives, len(trace), made, saved_known=False)
    report.scope, report.forward_ops = "step", forward_events - 1  # events, not ops
    print("\n".join("  " + line for line in report.lines(top)))


def _warm_step(model, batch) -> Callable[[], None]:
    """One fp16 training step of ``model`` (forward and backward), run WARMUP times first."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        step_loss(model, batch, "fp16").backward()

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    return step


def python_time(model, batch, top: int) -> None:
    """cProfile over 3 steps: the Python functions with the most time of their own (the host
    time a torch.profiler table lumps into an autograd Function's self CPU time)."""
    import cProfile
    import io
    import pstats

    step = _warm_step(model, batch)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        print(out.getvalue()[-12000:])


def launch_costs(
    device: str = "cuda", reps: int = 2000, rounds: int = 5, n: int = 4096
) -> list[dict[str, float | str]]:
    """Host microseconds per call, on an ``n``-element fp16 tensor (fp32 off CUDA): an aten op
    (``torch.relu``, one kernel), a bare Triton launch (the ReLU kernel, grid and arguments
    ready), and the DropIT wrappers (the masked ReLU, quant 4-bit pack and rebuild, the pack
    with zero and sign flags), each the fastest of ``rounds`` rounds of ``reps`` calls. The
    calls are not synchronised: on a GPU that is the host's time to launch, while the tiny
    kernels keep up. Separates Triton's launcher from our Python in a step that waits on the
    host (docs/gpu.md)."""
    from dropit_core.backends import kernels

    kq, kr = kernels("quant"), kernels("relu")

    dev = torch.device(device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    x = torch.randn(n, device=dev, dtype=dtype)
    out = torch.empty_like(x)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev)
    packed = kq.quant_pack(x, 4, 256, 1)
    calls: dict[str, Callable[[], object]] = {
        "torch.relu (aten, one kernel)": lambda: torch.relu(x),
        "Triton launch alone (ReLU kernel)": lambda: kr.relu_mask_launch(x, out, bits),
        "relu_mask (wrapper + launch)": lambda: kr.relu_mask(x),
        "quant_pack 4-bit": lambda: kq.quant_pack(x, 4, 256, 1),
        "quant_rebuild 4-bit": lambda: kq.quant_rebuild(*packed, n, 4, 256, dtype),
        "quant_pack_signed 4-bit": lambda: kq.quant_pack_signed(x, 4, 256, 1),
    }
    rows = []
    for name, call in calls.items():
        for _ in range(min(reps, 20)):  # compiles the specialisation, warms the caches
            call()
        _sync(dev)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            best = min(best, time.perf_counter() - t0)
            _sync(dev)
        rows.append({"call": name, "host_us": round(best / reps * 1e6, 2)})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

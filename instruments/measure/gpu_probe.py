"""Where one GPU training step's time and peak memory go (a diagnostic: tools/gpu_probe.py).

The step's wall time against the GPU time of its kernels (a step whose wall time is well above
its kernel time waits on the host), the ops with the most host time (torch.profiler), the
Python functions with the most time of their own (cProfile), and the allocations alive at the
step's CUDA peak (the caching allocator's trace), summed by the frame of our code or
torchvision's that asked for them, with whether the peak falls in the forward or backward.
And the host's cost of one launch: an aten op's, a bare Triton launch's and each DropIT
wrapper's, on a tiny tensor (:func:`launch_costs`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from instruments.measure.workload import step_loss

# Untimed steps first: a Triton kernel compiles for each new specialisation of its integer
# arguments (a size divisible by 16 or not), which the first steps of a model meet.
WARMUP = 10
OURS = ("dropit_core", "rcnn_dropit", "torchvision", "instruments")


def frame_of(frames: list[dict]) -> str:
    """The innermost frame in our code or torchvision's (the frame that asked for the memory)."""
    for f in frames:
        name = f.get("filename", "")
        if any(f"/{part}/" in name for part in OURS):
            short = name[max(name.rfind(f"/{p}/") for p in OURS) + 1 :]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no frame of ours)"


def live_at_peak(trace: list[dict]) -> tuple[int, int, dict[int, tuple[int, list]]]:
    """Replay an allocator trace: (peak bytes above the start, the event index of the peak,
    the blocks alive then: address -> (size, frames))."""
    live: dict[int, tuple[int, list]] = {}
    now = peak = peak_at = 0
    best: dict[int, tuple[int, list]] = {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            now += ev["size"]
            if now > peak:
                peak, peak_at, best = now, i, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    return peak, peak_at, best


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
    peak, at, blocks = live_at_peak(trace)
    phase = "forward" if at < forward_events else "backward"
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in blocks.values():
        g = groups[frame_of(frames)]
        g[0] += size
        g[1] += 1
    print(f"  peak above the step's start: {peak / 2**20:.0f} MB, in the {phase}")
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {size / 2**20:8.1f} MB  {count:5d} blocks  {where}")


def _warm_step(model, batch) -> Callable[[], None]:
    """One fp16 training step of ``model`` (forward and backward), run WARMUP times first."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        step_loss(model, batch, "fp16").backward()

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    return step


def timing(model, batch, top: int) -> None:
    """Wall time against kernel time over 3 steps, and the ops with the most host time."""
    from torch.profiler import ProfilerActivity, profile

    step = _warm_step(model, batch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e.device_type, "name", "") == "CUDA"]
    gpu = sum(e.self_device_time_total for e in kernels or events) / 3e3
    print(
        f"  step wall {wall * 1e3:.1f} ms (under the profiler), kernels {gpu:.1f} ms of GPU "
        "time per step"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


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

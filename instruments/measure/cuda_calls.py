"""Kernel launches and host syncs per training step, counted from torch.profiler's events.

A step whose GPU idles is bound by the host: by the kernels it launches one by one and by the
host syncs that make it wait for the device (``.item()``, ``nonzero``, a boolean index, a copy to
the CPU). On the first GPU run min-k 0.8 launched about 9,000 kernels a step and synced 129
times, the baseline 60 (issue 26). The profiler records each CUDA runtime and driver call the
host makes as an event named after the call, and each copy the device runs as a ``Memcpy ...``
event, so both counts are a matter of names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, astuple, dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# cudaLaunchKernel, cudaLaunchKernelExC, cudaLaunchCooperativeKernel (runtime: torch's own
# kernels); cuLaunchKernel, cuLaunchKernelEx (driver: Triton's); a CUDA graph is one launch.
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch")
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
# Calls after which the host has waited for the device: the explicit syncs, and the copies
# without "Async" that return once done (what torch uses for a copy to the CPU is cudaMemcpyAsync
# then cudaStreamSynchronize: counted once, as the sync).
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cudaMemcpy3D",
        "cudaMemcpyFromSymbol",
        "cudaMemcpyToSymbol",
        "cuMemcpy",
        "cuMemcpyDtoH",
        "cuMemcpyHtoD",
        "cuMemcpyDtoD",
    }
)
DTOH_PREFIX = "Memcpy DtoH"  # the device's copy to the host: "Memcpy DtoH (Device -> Pinned)"
_COPIES = ("Memcpy", "Memset")  # the device's other copies and fills: not kernels
# Variants of one call: the per-thread default stream (_ptsz, _ptds) and versioned entry points.
_SUFFIXES = ("_ptsz", "_ptds", "_v2", "_v3")


@dataclass(frozen=True)
class CudaCalls:
    """What the host asked of the GPU over some steps."""

    launches: int = 0  # kernels launched (runtime and driver calls; a CUDA graph counts one)
    syncs: int = 0  # calls that waited for the device
    dtoh_copies: int = 0  # copies from the device to the host that the device ran
    kernels: int = 0  # kernels the device ran: a check on launches, should a call go unrecorded

    def __sub__(self, other: CudaCalls) -> CudaCalls:
        return CudaCalls(
            *(max(0, a - b) for a, b in zip(astuple(self), astuple(other), strict=True))
        )

    def per_step(self, steps: int) -> dict[str, float]:
        """The counts divided by ``steps``, as a bench row's columns."""
        return {f"{name}_per_step": round(count / steps, 1) for name, count in asdict(self).items()}


def _field(event: Any, name: str) -> Any:
    """An event's field: torch.profiler's FunctionEvents have attributes, KinetoEvents methods."""
    value = getattr(event, name, None)
    return value() if callable(value) else value


def _call_name(event: Any) -> str:
    """The event's name without a variant suffix (``cudaMemcpy_v2`` is ``cudaMemcpy``)."""
    name = _field(event, "name")
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def count_cuda_calls(events: Iterable[Any]) -> CudaCalls:
    """Kernel launches, host syncs, device-to-host copies and device kernels among profiler
    events (each with a ``name`` and a ``device_type``: ``prof.events()`` or
    ``prof.profiler.kineto_results.events()``)."""
    launches = syncs = dtoh = kernels = 0
    for event in events:
        name = _call_name(event)
        if name.startswith(LAUNCH_PREFIXES) or name in GRAPH_LAUNCHES:
            launches += 1
        elif name in SYNC_CALLS:
            syncs += 1
        elif name.startswith(DTOH_PREFIX):
            dtoh += 1
        elif _field(event, "device_type") == DeviceType.CUDA and not name.startswith(_COPIES):
            kernels += 1
    return CudaCalls(launches, syncs, dtoh, kernels)


def profile_cuda_calls(step: Callable[[], Any], steps: int, device: torch.device) -> CudaCalls:
    """The calls of ``steps`` runs of ``step`` under torch.profiler, less those of profiling
    nothing (starting and stopping the profiler may sync). On the CPU there are none."""

    def profiled(n: int) -> CudaCalls:
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(device)  # before the profile: not one of the step's syncs
        with profile(activities=activities) as prof:
            for _ in range(n):
                step()
        return count_cuda_calls(prof.profiler.kineto_results.events())

    return profiled(steps) - profiled(0)

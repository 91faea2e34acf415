"""The peak memory of one call as the device counts it, every tensor included: the CUDA
allocator's own peak, or on the CPU what is alive at the start plus the peak of torch's CPU
allocations over the call (the profiler's memory events: exact to the byte, whatever malloc
keeps; RSS would carry what earlier calls left in the heap).
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, *batch: object
) -> list[torch.Tensor]:
    """What a training step holds before it starts: weights, buffers, gradients, optimizer state
    and the batch's tensors (lists and dicts of them)."""
    held = [*model.parameters(), *model.buffers()]
    held += [p.grad for p in model.parameters() if p.grad is not None]
    held += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    stack = list(batch)
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            held.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return held


def cpu_allocation_peak(fn: Callable[[], object]) -> int:
    """Run ``fn``; the most bytes torch's CPU allocator held at once during it, above what it
    held when it began."""
    gc.collect()  # earlier garbage freed inside the window would count as this call's frees
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    sizes = [
        e.nbytes() for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    return max(itertools.accumulate(sizes, initial=0))


def step_peak_bytes(
    fn: Callable[[], object], device: torch.device, held: Callable[[], list[torch.Tensor]]
) -> int:
    """The peak over ``fn()`` of all the device holds: on CUDA ``max_memory_allocated`` after a
    reset; on the CPU the bytes of ``held()`` (what the step starts with) plus the allocations'
    peak above them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    start = tensors_bytes(t for t in held() if t.device.type == "cpu")
    return start + cpu_allocation_peak(fn)

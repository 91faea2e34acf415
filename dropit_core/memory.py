"""Memory accounting: the bytes autograd keeps for backward, and real (RSS / CUDA) peaks.

``saved_activations`` counts unique storages handed to autograd during one forward (through
``saved_tensors_hooks``, which also sees what custom Functions keep with ``save_for_backward``;
DropIT keeps nothing as plain ``ctx`` attributes but Python metadata). Parameters are excluded:
they are alive whatever the method. Each storage is charged to the innermost module running when
it was first saved, so the breakdown says which layer kind holds the memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .patch import is_dropit
from .recompute import is_checkpointed

MB = 1024.0 * 1024.0


@dataclass
class SavedReport:
    """Bytes autograd keeps after one forward, in total and broken down."""

    total_bytes: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    converted_bytes: int = 0
    unconverted_bytes: int = 0
    by_module: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers in MB, for JSON."""
        return {
            "saved_mb": self.total_bytes / MB,
            "by_type_mb": {k: v / MB for k, v in sorted(self.by_type.items())},
            "converted_mb": self.converted_bytes / MB,
            "unconverted_mb": self.unconverted_bytes / MB,
        }


def _kind(module: nn.Module) -> str:
    cls = type(module)
    if is_dropit(module) or is_checkpointed(module):  # the plain class the user knows
        cls = cls.__mro__[1]
    return cls.__name__


def saved_activations(model: nn.Module, forward: Callable[[], Any]) -> tuple[Any, SavedReport]:
    """Run ``forward()`` and count what autograd keeps for its backward; returns (result, report).

    The graph stays alive in the result, so the caller can still call ``backward``.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    names = {m: n for n, m in model.named_modules()}
    stack: list[nn.Module] = []
    seen: set[int] = set()
    report = SavedReport()
    by_type: dict[str, int] = defaultdict(int)
    by_module: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen or storage.nbytes() == 0:
            return t
        seen.add(ptr)
        nbytes = storage.nbytes()
        owner = stack[-1] if stack else model
        by_type[_kind(owner)] += nbytes
        by_module[names.get(owner, "?")] += nbytes
        report.total_bytes += nbytes
        if is_dropit(owner):
            report.converted_bytes += nbytes
        else:
            report.unconverted_bytes += nbytes
        return t

    def push(module, args):
        stack.append(module)

    def pop(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = forward()
    finally:
        for h in handles:
            h.remove()
    report.by_type = dict(by_type)
    report.by_module = dict(by_module)
    return result, report


def _proc_status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mb() -> float | None:
    """Resident memory of this process now (Linux), in MB."""
    kb = _proc_status_kb("VmRSS")
    return None if kb is None else kb / 1024.0


def peak_rss_mb() -> float | None:
    """Peak resident memory since start or the last :func:`reset_peak_rss` (Linux), in MB."""
    kb = _proc_status_kb("VmHWM")
    return None if kb is None else kb / 1024.0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _cuda_device(device: torch.device | str) -> torch.device | None:
    """The CUDA device to query, or None when ``device`` is not a CUDA device or CUDA is absent.

    ``torch.cuda`` statistics raise for a CPU device, so a CPU run on a GPU node must not reach
    them.
    """
    device = torch.device(device)
    return device if device.type == "cuda" and torch.cuda.is_available() else None


def peak_mb(device: torch.device | str, reset: bool = False) -> float | None:
    """Peak memory in MB since the last reset: the allocator's on a CUDA device, else this
    process's resident peak (VmHWM); ``reset=True`` starts a new window once it is read."""
    cuda = _cuda_device(device)
    peak = peak_rss_mb() if cuda is None else torch.cuda.max_memory_allocated(cuda) / MB
    if reset:
        reset_peak(device)
    return peak


def reset_peak(device: torch.device | str) -> None:
    """Start a new peak window for :func:`peak_mb` (where /proc/self/clear_refs is not
    writable, the CPU peak stays the all-time one)."""
    cuda = _cuda_device(device)
    if cuda is None:
        reset_peak_rss()
    else:
        torch.cuda.reset_peak_memory_stats(cuda)


def allocated_mb(device: torch.device | str) -> float | None:
    """Memory in use now, in MB: the allocator's on a CUDA device, else this process's RSS."""
    cuda = _cuda_device(device)
    return rss_mb() if cuda is None else torch.cuda.memory_allocated(cuda) / MB


class PeakMeter:
    """Memory of one process above a starting point: RSS on the CPU, allocator counters on CUDA.

    What else the process holds at :meth:`begin` (other models, earlier measurements) does not
    count in :meth:`now` and :meth:`peak`.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.start: float | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        """Take the starting allocation and reset the peak."""
        self._sync()
        reset_peak(self.device)
        self.start = allocated_mb(self.device)

    def now(self) -> float | None:
        """Memory in use now, above the start."""
        if self.start is None:
            return None
        now = allocated_mb(self.device)
        return None if now is None else now - self.start

    def peak(self) -> float | None:
        """Peak since :meth:`begin`, above the start."""
        if self.start is None:
            return None
        self._sync()
        peak = peak_mb(self.device)
        return None if peak is None else peak - self.start

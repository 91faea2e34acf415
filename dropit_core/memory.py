"""Memory accounting: the bytes autograd keeps for backward, and real (RSS / CUDA) peaks.

``measure_step`` measures one training step: what autograd keeps, the memory live after the
forward and the peak over the whole step, each above what the process held when it began
(:class:`StepMemory`). ``saved_activations`` counts the unique storages handed to autograd
during one forward (``saved_tensors_hooks`` also see what custom Functions save), parameters
excluded, each charged to the innermost module running when it was first saved. A model with
:func:`~dropit_core.saved.compress_saved` attached is charged what its block keeps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dropit_core.convert import is_dropit
from dropit_core.recompute import is_checkpointed
from dropit_core.saved import saved_compression

MB = 1024.0 * 1024.0


@dataclass
class SavedReport:
    """Bytes autograd keeps after one forward, in total and broken down."""

    total_bytes: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    converted_bytes: int = 0
    unconverted_bytes: int = 0
    by_module: dict[str, int] = field(default_factory=dict)
    norm_bytes: int = 0  # first saved by normalisation layers (their inputs), packed or not

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers in MB, for JSON."""
        return {
            "saved_mb": self.total_bytes / MB,
            "by_type_mb": {k: v / MB for k, v in sorted(self.by_type.items())},
            "converted_mb": self.converted_bytes / MB,
            "unconverted_mb": self.unconverted_bytes / MB,
            "norm_mb": self.norm_bytes / MB,
        }


# Normalisation layers whose backward reads their input (a frozen norm's does not: it saves none).
_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def saved_activations(model: nn.Module, forward: Callable[[], Any]) -> tuple[Any, SavedReport]:
    """Run ``forward()`` and count what autograd keeps for its backward; returns (result, report)
    with the graph alive in the result, for the caller's ``backward``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    names = {m: n for n, m in model.named_modules()}
    stack: list[nn.Module] = []
    seen: set[int] = set()
    report = SavedReport()

    def charge(t: torch.Tensor, kept: int | None) -> None:
        """Count ``t`` at ``kept`` bytes (a compressed copy) or, once, at its storage's."""
        if kept is None:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in params or ptr in seen or nbytes == 0:
                return
            seen.add(ptr)
        else:  # packed once by its block; its storage may be freed and the address reused
            nbytes = kept
        owner = stack[-1] if stack else model
        cls = type(owner)
        if is_dropit(owner) or is_checkpointed(owner):  # the plain class the user knows
            cls = cls.__mro__[1]
        kind, name = cls.__name__, names.get(owner, "?")
        report.by_type[kind] = report.by_type.get(kind, 0) + nbytes
        report.by_module[name] = report.by_module.get(name, 0) + nbytes
        report.total_bytes += nbytes
        if isinstance(owner, _NORMS):
            report.norm_bytes += nbytes
        if is_dropit(owner):
            report.converted_bytes += nbytes
        else:
            report.unconverted_bytes += nbytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        charge(t, None)
        return t

    def pop(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(lambda m, _: stack.append(m)))
        handles.append(module.register_forward_hook(pop))
    blocks = [b for b in map(saved_compression, model.modules()) if b is not None]
    for block in blocks:
        block.observer = charge
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = forward()
    finally:
        for h in handles:
            h.remove()
        for block in blocks:
            block.observer = None
    return result, report


def _proc_status_mb(key: str) -> float | None:
    """Field ``key`` of /proc/self/status (Linux; in kB there), in MB."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(ln.split()[1]) / 1024.0 for ln in lines if ln.startswith(key + ":")), None)


def rss_mb() -> float | None:
    """Resident memory of this process now (Linux), in MB."""
    return _proc_status_mb("VmRSS")


def peak_rss_mb() -> float | None:
    """Peak resident memory since start or the last :func:`reset_peak_rss` (Linux), in MB."""
    return _proc_status_mb("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _cuda_device(device: torch.device | str) -> torch.device | None:
    """The CUDA device to query, or None for another device or without CUDA (``torch.cuda``
    statistics raise for a CPU device, which a CPU run on a GPU node must not reach)."""
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
    """This process's memory above what it held at :meth:`begin`: RSS, or the CUDA allocator's."""

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


@dataclass(frozen=True)
class StepMemory:
    """The memory of one training step (forward and backward) on one device, in MB, above what
    the process held when it began (``held_at_start_mb``: weights, optimizer state, other
    models), except ``step_peak_total_mb``, what the device's peak counter reads."""

    source: str  # "cuda": the caching allocator's counters; "rss": this process's resident memory
    held_at_start_mb: float | None
    live_after_forward_mb: float | None  # what the first forward left alive for its backward
    forward_peak_mb: float | None  # the first forward's peak; None when later forwards ran
    step_peak_mb: float | None  # the peak over the whole step: every forward and backward
    saved: SavedReport  # what autograd kept in the first forward

    @property
    def step_peak_total_mb(self) -> float | None:
        """The step's peak with the start included: the device's own peak over the step."""
        if self.held_at_start_mb is None or self.step_peak_mb is None:
            return None
        return self.held_at_start_mb + self.step_peak_mb

    @property
    def peak_phase(self) -> str | None:
        """The pass that reaches the step's peak: "forward" or "backward" (None: not known)."""
        if self.step_peak_mb is None or self.forward_peak_mb is None:
            return None
        return "forward" if self.forward_peak_mb >= self.step_peak_mb else "backward"

    @property
    def forward_transient_mb(self) -> float | None:
        """What the forward's peak holds beyond the live state after it: the dense working set
        and the packing temporaries, not the caches."""
        if self.forward_peak_mb is None or self.live_after_forward_mb is None:
            return None
        return self.forward_peak_mb - self.live_after_forward_mb

    def as_dict(self) -> dict[str, Any]:
        """The step's figures by their names, for JSON (the saved report's are separate)."""
        return {
            "memory_source": self.source,
            "held_at_start_mb": self.held_at_start_mb,
            "live_after_forward_mb": self.live_after_forward_mb,
            "forward_peak_mb": self.forward_peak_mb,
            "step_peak_mb": self.step_peak_mb,
            "step_peak_total_mb": self.step_peak_total_mb,
            "peak_phase": self.peak_phase,
        }


def measure_step(
    model: nn.Module, forwards: Sequence[Callable[[], torch.Tensor]], device: torch.device | str
) -> StepMemory:
    """Measure the memory of one training step of ``model`` on ``device``: each of ``forwards``
    (one per micro-batch) returns its scalar loss, whose backward runs before the next forward;
    gradients are set to None before and after. What autograd keeps is counted in the first."""
    if not forwards:
        raise ValueError("measure_step needs at least one forward")
    model.zero_grad(set_to_none=True)
    gc.collect()  # garbage of earlier steps must not sit in the start
    meter = PeakMeter(device)
    meter.begin()
    loss, saved = saved_activations(model, forwards[0])
    live, forward_peak = meter.now(), meter.peak()
    loss.backward()
    del loss
    for forward in forwards[1:]:
        forward().backward()
    step_peak = meter.peak()
    model.zero_grad(set_to_none=True)
    return StepMemory(
        source="cuda" if meter.cuda else "rss",
        held_at_start_mb=meter.start,
        live_after_forward_mb=live,
        # a later micro-batch's forward may top the first one's: its peak is not the forward's
        forward_peak_mb=forward_peak if len(forwards) == 1 else None,
        step_peak_mb=step_peak,
        saved=saved,
    )

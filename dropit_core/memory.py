"""Memory accounting: the bytes autograd keeps for backward (:func:`saved_activations`), and the
peak of a call (:class:`PeakMeter`, the one meaning of "peak" every report reads), of a training
step (:func:`measure_step`) and of a window of steps (:class:`WindowPeak`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

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
    """Run ``forward()`` and count the unique storages autograd keeps for its backward, parameters
    excluded, each charged to the innermost module running when first saved (a
    :func:`~dropit_core.saved.compress_saved` block: what it keeps); returns (result, report)."""
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
            cls = next(c for c in cls.__mro__[1:] if issubclass(c, nn.Module))
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


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *batch: object
) -> list[torch.Tensor]:
    """What a training step holds before it starts: weights, buffers, gradients, optimizer state
    and the batch's tensors (lists and dicts of them)."""
    held = [*model.parameters(), *model.buffers()]
    held += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        held += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
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


_MARK = "dropit_core::peak_mark"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Keep the profiler's start and stop lines (kineto writes to file descriptor 2) off the
    console: a CPU run measures a step at every logged iteration."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class PeakMeter:
    """The peak of one call on one device, what was alive when it began included: on CUDA the
    allocator's counters (not its reserve, not the CUDA context); on the CPU the bytes of
    ``held()`` plus the peak of torch's allocations over the call, from the profiler's memory
    events: exact to the byte whatever malloc keeps (RSS would carry the heap earlier calls left).
    The profiler misses frees of blocks made before it started, so the call must not free what
    ``held()`` counted: set the gradients to None before measuring a step that would."""

    def __init__(
        self, device: torch.device | str, held: Callable[[], Iterable[torch.Tensor]] = tuple
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.held = held
        self.start_bytes = 0  # alive when the call began
        self.peak_bytes = 0  # the most alive at once during it, the start included
        self.marks: list[tuple[int, int]] = []  # at each mark: (alive, peak so far)

    @property
    def source(self) -> str:
        """What the figures count: "cuda" (the allocator's) or "cpu" (torch's allocations)."""
        return "cuda" if self.cuda else "cpu"

    def measure(self, fn: Callable[[], Any]) -> Any:
        self.marks = []
        gc.collect()  # earlier garbage freed inside the call would count as the call's frees
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            result = fn()
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return result
        self.start_bytes = storage_bytes(t for t in self.held() if t.device.type == "cpu")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            prof.start()
        try:
            result = fn()
        finally:
            with _quiet_stderr():
                prof.stop()
        alive = top = 0
        for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
                alive += event.nbytes()
                top = max(top, alive)
            elif event.name() == _MARK:
                self.marks.append((self.start_bytes + alive, self.start_bytes + top))
        self.peak_bytes = self.start_bytes + top
        return result

    def mark(self) -> None:
        """Inside the measured call: note what is alive now and the peak so far."""
        if not self.cuda:
            with record_function(_MARK):  # placed among the memory events by its time
                return
        torch.cuda.synchronize(self.device)
        alive = torch.cuda.memory_allocated(self.device)
        self.marks.append((alive, torch.cuda.max_memory_allocated(self.device)))


@dataclass(frozen=True)
class StepMemory:
    """One training step's memory on one device, in MB as :class:`PeakMeter` counts it, above
    what the step held when it began (``held_at_start_mb``) but ``step_peak_total_mb``."""

    source: str  # PeakMeter.source: "cuda" (the allocator's counters) or "cpu" (its allocations)
    held_at_start_mb: float
    live_after_forward_mb: float  # what the first forward left alive for its backward
    forward_peak_mb: float | None  # the first forward's peak; None when later forwards ran
    step_peak_mb: float  # the peak over the whole step: every forward and backward
    saved: SavedReport  # what autograd kept in the first forward

    @property
    def step_peak_total_mb(self) -> float:
        """The step's peak with the start included: the peak as PeakMeter means it."""
        return self.held_at_start_mb + self.step_peak_mb

    @property
    def peak_phase(self) -> str | None:
        """The pass that reaches the step's peak: "forward" or "backward" (None: not known)."""
        if self.forward_peak_mb is None:
            return None
        return "forward" if self.forward_peak_mb >= self.step_peak_mb else "backward"

    @property
    def forward_transient_mb(self) -> float | None:
        """The forward's peak beyond the live state after it (working set and temporaries)."""
        if self.forward_peak_mb is None:
            return None
        return self.forward_peak_mb - self.live_after_forward_mb

    def as_dict(self) -> dict[str, Any]:
        """The step's figures by their names, for JSON (not the saved report's)."""
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
    model: nn.Module,
    forwards: Sequence[Callable[[], torch.Tensor]],
    device: torch.device | str,
    batch: object = (),
) -> StepMemory:
    """The memory of one training step of ``model``: each of ``forwards`` (a micro-batch's)
    returns its loss, backward before the next; what autograd keeps is counted in the first.
    ``batch``: the tensors the forwards read, held at the start."""
    if not forwards:
        raise ValueError("measure_step needs at least one forward")
    model.zero_grad(set_to_none=True)  # freed before the meter starts: see PeakMeter
    meter = PeakMeter(device, lambda: training_tensors(model, None, batch))
    saved: list[SavedReport] = []

    def step() -> None:
        loss, report = saved_activations(model, forwards[0])
        saved.append(report)
        meter.mark()
        loss.backward()
        del loss
        for forward in forwards[1:]:
            forward().backward()

    meter.measure(step)
    model.zero_grad(set_to_none=True)
    start = meter.start_bytes
    ((live, forward_peak),) = meter.marks
    return StepMemory(
        source=meter.source,
        held_at_start_mb=start / MB,
        live_after_forward_mb=(live - start) / MB,
        # a later micro-batch's forward may top the first one's: its peak is not the forward's
        forward_peak_mb=(forward_peak - start) / MB if len(forwards) == 1 else None,
        step_peak_mb=(meter.peak_bytes - start) / MB,
        saved=saved[0],
    )


class WindowPeak:
    """The peak of a window of training steps (a log record's), as :class:`PeakMeter` means it:
    on CUDA every step's, at no cost; on the CPU only the steps :meth:`step` runs with
    ``measure`` (the profiler costs a step's worth of bookkeeping)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peak_bytes: int | None = None
        self.restart()

    def step(
        self, fn: Callable[[], Any], held: Callable[[], Iterable[torch.Tensor]], measure: bool
    ) -> Any:
        """Run one step ``fn()``, measured on the CPU when ``measure`` (``held``: PeakMeter's)."""
        if self.cuda or not measure:
            return fn()
        meter = PeakMeter(self.device, held)
        result = meter.measure(fn)
        self.peak_bytes = max(self.peak_bytes or 0, meter.peak_bytes)
        return result

    def restart(self) -> None:
        """Begin a new window (after a record, or after what is not training: evaluation)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = None

    def take_mb(self) -> float | None:
        """The window's peak in MB (None: no step measured), then a new window."""
        if self.cuda:
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        peak = self.peak_bytes
        self.restart()
        return None if peak is None else peak / MB

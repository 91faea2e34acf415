"""What the CPU allocator did while a function ran: bytes allocated, the peak, what stayed alive,
and what was alive when a marked region began (torch.profiler's memory events, one per
allocation and free, timed on the same clock as ``record_function`` ranges).

It sees every tensor torch allocates, whoever holds it (autograd's saved tensors, a compiled
function's buffers), which ``saved_tensors_hooks`` do not; it does not see memory that does not
come from torch's allocator (numpy's, Triton's interpreter's own copies).
"""

from __future__ import annotations

import bisect
import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass
class Allocations:
    """The CPU allocator's events during one call, in time order (bytes: + allocated, - freed)."""

    times: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    marks: dict[str, list[int]] = field(default_factory=dict)  # region name -> start times

    @property
    def allocated(self) -> int:
        """Bytes allocated in all (frees not subtracted)."""
        return sum(s for s in self.sizes if s > 0)

    @property
    def largest(self) -> int:
        """The largest single allocation."""
        return max((s for s in self.sizes if s > 0), default=0)

    @property
    def peak(self) -> int:
        """The most bytes alive at once, above what was alive at the start."""
        return max(itertools.accumulate(self.sizes, initial=0))

    @property
    def alive(self) -> int:
        """Bytes allocated during the call and still alive at its end."""
        return sum(self.sizes)

    def alive_at(self, mark: str, index: int = 0) -> int:
        """Bytes alive (above the start) when the ``index``-th region named ``mark`` began."""
        cut = bisect.bisect_right(self.times, self.marks[mark][index])
        return sum(self.sizes[:cut])


def allocations(fn: Callable[[], Any]) -> tuple[Any, Allocations]:
    """Run ``fn`` under the profiler; its result and the CPU allocator's events."""
    gc.collect()  # earlier garbage freed inside the window would count as this call's frees
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    out = Allocations()
    for e in events:
        if e.name() == "[memory]":
            if e.device_type() == DeviceType.CPU:
                out.times.append(e.start_ns())
                out.sizes.append(e.nbytes())
        else:
            out.marks.setdefault(e.name(), []).append(e.start_ns())
    return result, out

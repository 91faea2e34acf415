"""The C allocator's settings while a benchmark times steps on the CPU.

``tools/bench.py`` starts itself with ``MALLOC_MMAP_THRESHOLD_=65536``: every freed tensor then
goes back to the OS at once, and RSS follows live memory, which is what the memory figures need.
The price is that every temporary above 64 KiB costs fresh page faults each time it is made.
A training process does not pay this. glibc raises its threshold to the largest block it has
freed, up to 32 MiB on 64-bit, so most temporaries are then reused from the heap. DropIT's pack and
unpack make many temporaries of one to sixteen MB. Timed in the measuring mode they cost 2-4x
what they cost in training (docs/results/memory.md), and the baseline's convolutions do not.

:func:`training_allocator` puts glibc into its steady state for the timed steps, and then
returns it to the measuring mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the dynamic mmap threshold on 64-bit, and the trim threshold it pairs
# with it (twice the mmap threshold).
STEADY_MMAP_THRESHOLD = 32 << 20
_STEADY_TRIM_THRESHOLD = 2 * STEADY_MMAP_THRESHOLD
_DEFAULT_TRIM_THRESHOLD = 128 << 10


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to switch
        return None
    return libc if hasattr(libc, "mallopt") else None


def measuring_threshold() -> int | None:
    """The mmap threshold this process was started with for measuring, or None."""
    value = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    return int(value) if value and value.isdigit() else None


@contextlib.contextmanager
def training_allocator(device: torch.device) -> Iterator[str]:
    """Inside: glibc as a training process has it (on the CPU, when started for measuring).

    Yields what the timed steps ran under, for the results: ``"glibc steady state"`` or
    ``"as started"`` (on a GPU, without glibc, or when the process was not started for
    measuring, where there is nothing to change).
    """
    threshold = measuring_threshold()
    libc = _glibc() if device.type == "cpu" and threshold is not None else None
    if libc is None:
        yield "as started"
        return
    libc.mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _STEADY_TRIM_THRESHOLD)
    try:
        yield "glibc steady state"
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)  # what the heap kept goes back, so RSS measures live memory again

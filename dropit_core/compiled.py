"""The CPU quant pack of whole groups as one compiled loop (``torch.compile``, inductor's C++).

Eager torch makes a pass over memory per operation, ten or so for a pack; compiled, the group
minimum and step, the hash draw, the rounding and the packing of codes into bytes are one loop
that stores into the pack's final buffers, called a slice at a time (its temporaries, an fp32
value per element, stay a slice's); the rebuild stays eager: a few passes, and faster so. It is
the eager path's arithmetic, op for op, and inductor compiles without unsafe math or contraction
(torch's defaults), so its bytes are the eager ones bit for bit
(tests/core/test_dropit_kernels.py checks it, marked slow).

Compiling takes 10-30 s, once per process and dtype and bit width (inductor caches it on disk):
it happens in the first training step that packs a large input, never in a later one. Where
compiling fails (no C++ compiler, an old torch) one warning is given and the eager path packs;
``DROPIT_COMPILE=0`` or :func:`set_compile` turns it off. Inputs below :data:`COMPILE_MIN` values
always pack eagerly: their compile would cost more than it saves."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable

import torch

from .seeds import MASK32, MIX_MUL1, MIX_MUL2, TABLE_BITS, UNIFORM_BITS

COMPILE_MIN = 1 << 16  # values of whole groups in a pack, below which it packs eagerly
ENV = "DROPIT_COMPILE"

_enabled: bool | None = None  # set_compile's choice; None: the environment's
_COMPILED: dict[str, Callable] = {}
_failed = False


def set_compile(enabled: bool | None) -> None:
    """Use the compiled CPU pack (True), never (False), or as ``$DROPIT_COMPILE`` says (None;
    default on)."""
    global _enabled
    _enabled = enabled


def compile_enabled() -> bool:
    """Whether a large CPU quant pack is compiled."""
    if _enabled is not None:
        return _enabled
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "off", "no")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """seeds.mix32 on int64 values in [0, 2**32) (out of place: compiled, it costs nothing)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def quant_rows(
    rows: torch.Tensor,
    params: torch.Tensor,
    bits: int,
    inv_levels: float,
    codes: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> None:
    """Pack ``rows`` (one group each, whole bytes of codes) into ``codes``, ``mins`` and
    ``scales``, views of the pack's final buffers: compiled, the loop stores there directly.

    ``params`` (int64: the hash keys k0 and k1, and the pack's index of ``rows``' first
    element) is a tensor so that new values do not recompile. ``dtype``: each value is rounded
    to it first (the autocast cast the layer ran, never made here). The same operations as
    ``Quant._quantize`` with ``seeds.hash_bits``.
    """
    packed, lo, scale = quant_fields(rows, params, bits, inv_levels, dtype)
    mins.copy_(lo)
    scales.copy_(scale)
    codes.copy_(packed)


def quant_fields(
    rows: torch.Tensor,
    params: torch.Tensor,
    bits: int,
    inv_levels: float,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, minima, steps) of ``rows`` (one group each, whole bytes of codes) as new tensors:
    :func:`quant_rows` without its buffers, in plain torch ops that a compiler can fuse with
    whatever produced ``rows`` (``dropit_core.traced`` packs a compiled layer's input so)."""
    levels, per_byte = (1 << bits) - 1, 8 // bits
    g = (rows if dtype is None else rows.to(dtype)).float()
    lo = g.amin(1)
    scale = ((g.amax(1) - lo) * inv_levels).clamp_min(torch.finfo(torch.float32).tiny)
    idx = (torch.arange(rows.numel(), device=rows.device) + params[2]).view(rows.shape)
    low = _mix32(((idx & ((1 << TABLE_BITS) - 1)) + params[0]) & MASK32)
    high = _mix32(((idx >> TABLE_BITS) + params[1]) & MASK32)
    noise = (low >> (32 - UNIFORM_BITS)) ^ (high >> (32 - UNIFORM_BITS))
    y = (g - lo[:, None]) / scale[:, None]
    y = y + noise.float() * 2.0**-UNIFORM_BITS
    code = y.clamp_max(levels).to(torch.uint8).view(-1, per_byte)
    packed = code[:, 0]
    for j in range(1, per_byte):
        packed = packed | (code[:, j] << (bits * j))
    return packed.view(-1), lo, scale


def compile_available() -> bool:
    """Whether large CPU packs go through the compiled loop."""
    return not _failed and compile_enabled()


def compiled_quant_rows(bits: int) -> Callable:
    """:func:`quant_rows` for ``bits``-bit codes, compiled (once per process and bit width; it
    compiles on its first call). The width is a constant of the compiled function, not an
    argument: torch 2.11's compiler failed on ``1 << bits`` with a symbolic ``bits`` (an H200
    run's CPU packs went eager there), and the byte-packing loop's length is set by it anyway.
    """

    def rows_of_width(rows, params, inv_levels, codes, mins, scales, dtype=None) -> None:
        quant_rows(rows, params, bits, inv_levels, codes, mins, scales, dtype)

    return _compiled(f"quant_rows_{bits}", rows_of_width)


class _NoCudaRuntime(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No CUDA runtime is found" not in record.getMessage()


def _import_cpp_extension_quietly() -> None:
    """Import ``torch.utils.cpp_extension`` (inductor's compiler needs it) without its warning
    "No CUDA runtime is found": true on a machine with a CUDA toolkit and no GPU, harmless for a
    CPU pack, and it reads like an error on a CPU-only run. Other records pass."""
    if "torch.utils.cpp_extension" in sys.modules:
        return
    log = logging.getLogger("torch.utils.cpp_extension")
    quiet = _NoCudaRuntime()
    log.addFilter(quiet)
    try:
        import torch.utils.cpp_extension  # noqa: F401  (imported for its side effect)
    finally:
        log.removeFilter(quiet)


def _compiled(name: str, fn: Callable) -> Callable:
    if name not in _COMPILED:
        _import_cpp_extension_quietly()
        # emulate_precision_casts: inductor would otherwise drop the rounding of a cast to
        # bf16/fp16 followed by one back (the autocast cast quant_rows reads its rows as).
        options = {"emulate_precision_casts": True}
        _COMPILED[name] = torch.compile(fn, dynamic=True, options=options)
    return _COMPILED[name]


def compile_failed(err: Exception) -> None:
    """Stop compiling for this process after ``err``, with one warning."""
    global _failed
    _failed = True
    warnings.warn(
        f"DropIT: the compiled CPU quant pack is unavailable ({type(err).__name__}: {err}); "
        "packing eagerly (same bytes, slower)",
        RuntimeWarning,
        stacklevel=3,
    )

"""No second copy: a quant pack is written once into its final buffers (bytes counted by the CPU
allocator: tests/core/allocations.py). The kernel and compiled paths' own counts are in
tests/core/test_dropit_kernels.py."""

from __future__ import annotations

import pytest
import torch

from dropit_core import base, build_strategy, compiled, dispatch
from tests.core.allocations import allocations

SLICE = 8192  # the strategies' slice, made small so that a test input spans many


@pytest.fixture
def eager(monkeypatch):
    """The eager path (no kernels, no compiled loop), with small slices."""
    monkeypatch.setattr(base, "SLICE", SLICE)
    dispatch.set_kernels("eager")
    compiled.set_compile(False)
    yield
    dispatch.set_kernels(None)
    compiled.set_compile(None)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_eager_quant_pack_is_written_once_into_its_final_buffers(eager, bits: int) -> None:
    # 32 slices and a last partial group: per slice a few temporaries, nothing of the whole size.
    x = torch.randn(32 * SLICE + 300, generator=torch.Generator().manual_seed(0))
    strategy = build_strategy("quant", 0.0, bits=bits)
    packed, made = allocations(lambda: strategy.pack(x, "linear", 5))
    codes = packed.values.nbytes
    assert made.alive == packed.nbytes()  # the pack, and nothing else, outlives it
    # The only allocation as large as the codes is the codes' own buffer: no joined copy.
    assert [size for size in made.sizes if size >= codes] == [codes]
    # What it needs besides is one slice's temporaries, whatever the input's length.
    assert made.peak - packed.nbytes() <= 16 * SLICE
    assert made.largest <= max(codes, 4 * SLICE)

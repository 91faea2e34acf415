"""No second copy: a quant pack is written once into its final buffers, and autocast's copy of a
layer input lives no longer than the layer (bytes counted by the CPU allocator:
tests/core/allocations.py), the layer still the plain one under autocast. The kernel and
C loops' own counts are in tests/core/test_dropit_kernels.py and test_dropit_native.py."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from dropit_core import build_strategy, configure, reset_settings, to_dropit
from dropit_core.formats import packed as base
from tests.core.allocations import allocations

SLICE = 8192  # the strategies' slice, made small so that a test input spans many


@pytest.fixture
def eager(monkeypatch):
    """The eager path (no kernels, no C loops), with small slices."""
    monkeypatch.setattr(base, "SLICE", SLICE)
    configure(kernels="eager")
    yield
    reset_settings()


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


def _converted(kind: str, strategy: str) -> tuple[nn.Module, nn.Module, tuple[int, ...]]:
    """(plain layer, its DropIT copy, an input shape)."""
    torch.manual_seed(3)
    if kind == "conv":
        plain, shape = nn.Conv2d(16, 8, 3, padding=1), (2, 16, 32, 32)
    else:
        plain, shape = nn.Linear(256, 64), (512, 256)
    holder = nn.Sequential(copy.deepcopy(plain))
    to_dropit(holder, strategy=strategy, gamma=0.8)
    return plain, holder[0], shape


def _recorded(layer: nn.Module) -> list:
    """The (arguments, pack) of each pack the layer's strategy makes, each inside a profiler
    range named "pack"; the tensor packed held weakly (a reference would keep it alive)."""
    strategy = layer.dropit_cache.strategy
    real_pack, packs = strategy.pack, []

    def pack(x, *args):
        with record_function("pack"):
            packs.append(((weakref.ref(x), *args), real_pack(x, *args)))
            return packs[-1][1]

    strategy.pack = pack
    return packs


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_autocast_copy_of_a_quant_layer_input_goes_with_the_layer(eager, kind) -> None:
    plain, layer, shape = _converted(kind, "quant")
    packs = _recorded(layer)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    xp = x.detach().clone().requires_grad_(True)
    h = x * 1.0  # an fp32 activation inside a network
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(h * 1.0)  # the bf16 weight cast and lazy inits, before counting
        gc.collect()  # whatever an earlier test left in reference cycles, gone before counting
        out, made = allocations(lambda: layer(h))
        ref = plain(xp * 1.0)
    (source, layout, key, *dtype), packed = packs[-1]
    weight_cast, bias_cast = layer.weight.numel() * 2, layer.bias.numel() * 2
    copy = h.numel() * 2
    # (The weight casts may be made at another moment when other tests ran first, so their bytes
    # bound the figures instead of fixing them; the bf16 copy would add far more.)
    # When the pack starts, the op's output and its weight and bias casts are alive, not the
    # bf16 copy of h the op ran on: it went with the op. The pack read h itself.
    assert (
        out.nbytes
        <= made.alive_at("pack")
        <= out.nbytes + weight_cast + bias_cast
        < copy + out.nbytes
    )
    assert source() is h and dtype == [torch.bfloat16]
    # After the forward: the output, the pack and the weight cast (the backward's).
    assert out.nbytes + packed.nbytes() <= made.alive <= out.nbytes + weight_cast + packed.nbytes()
    # The pack is the one of that copy, bit for bit, and rebuilds as bf16.
    strategy = layer.dropit_cache.strategy
    of_cast = build_strategy("quant", 0.8).pack(h.detach().to(torch.bfloat16), layout, key)
    assert all(torch.equal(a, b) for a, b in zip(packed.stored(), of_cast.stored(), strict=True))
    assert packed.meta.dtype == torch.bfloat16
    # The layer is the plain one under autocast: output, input and bias gradients; its weight
    # gradient is the bf16 op's backward on the rebuilt bf16 input.
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.float().backward(g)
    ref.float().backward(g)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xp.grad)
    assert torch.equal(layer.bias.grad, plain.bias.grad)
    x_hat = strategy.unpack(of_cast)
    w = plain.weight.detach().to(torch.bfloat16).requires_grad_(True)
    op = F.conv2d(x_hat, w, None, padding=1) if kind == "conv" else F.linear(x_hat, w)
    op.float().backward(g)
    assert torch.equal(layer.weight.grad, w.grad.float())


def test_a_strategy_that_keeps_values_packs_the_cast_which_goes_with_the_forward(eager) -> None:
    # mink keeps bf16 values: it packs the bf16 copy itself; nothing of it outlives the layer.
    _, layer, shape = _converted("linear", "mink")
    packs = _recorded(layer)
    h = torch.randn(shape, requires_grad=True) * 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(h * 1.0)
        out, made = allocations(lambda: layer(h))
    ((cast, *_), packed) = packs[-1]
    assert cast() is None and packed.values.dtype == torch.bfloat16  # the cast was packed
    # The output, the weight cast and the pack (and its 2-byte threshold in the metadata).
    assert 0 <= made.alive - (out.nbytes + layer.weight.numel() * 2 + packed.nbytes()) <= 8

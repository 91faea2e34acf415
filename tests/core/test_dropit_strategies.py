"""Each DropIT strategy against a reconstruction built independently here, plus its cache bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dropit_core import REGISTRY, STRATEGIES, build_strategy, to_dropit
from dropit_core.formats import packed as base_mod
from dropit_core.layers.cache import InputCache

GAMMAS = (0.5, 0.8)
CONV_SHAPE = (2, 3, 5, 7)  # 6 planes of 5x7: odd sizes exercise tails and padding
LINEAR_SHAPE = (12, 10)  # R x F


def _x(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen)


def _roundtrip(strategy, x: torch.Tensor, layout: str, key: int = 0):
    packed = strategy.pack(x, layout, key)
    out = strategy.unpack(packed)
    assert out.shape == x.shape and out.dtype == x.dtype
    return out, packed


def _cache_bytes(packed) -> int:
    return sum(t.nbytes for t in packed.stored())


def _kept_count(gamma: float, n: int) -> int:
    # strategies.py documents kept = int((1 - gamma) * n).
    return int((1.0 - gamma) * n)


def _value_bytes(values: str, kept: int, chunk: int = 16) -> int:
    if values == "same":
        return 4 * kept
    if values in ("fp16", "bf16"):
        return 2 * kept
    if values == "int4":
        return math.ceil(kept / 2) + 4 * math.ceil(kept / chunk)
    return kept + 4 * math.ceil(kept / chunk)


def _keep_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Zero all but the k largest |x| of the whole tensor."""
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    idx = torch.topk(flat.abs(), k).indices
    out[idx] = flat[idx]
    return out.view(x.shape)


# ----------------------------------------------------------------------------------- element-wise


@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", LINEAR_SHAPE)])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_mink_keeps_global_topk(layout: str, shape, gamma: float) -> None:
    x = _x(shape, seed=1)
    n = x.numel()
    k = _kept_count(gamma, n)
    out, packed = _roundtrip(build_strategy("mink", gamma), x, layout)
    assert torch.equal(out, _keep_topk(x, k))
    assert _cache_bytes(packed) == math.ceil(n / 8) + 4 * k


@pytest.mark.parametrize("values", ["fp16", "bf16", "int8", "int4"])
def test_mink_narrow_values_bytes_and_error(values: str) -> None:
    x = _x(CONV_SHAPE, seed=2)
    n, k = x.numel(), _kept_count(0.8, x.numel())
    options = {"values": values}
    if values.startswith("int"):
        options[f"{values}_chunk"] = 16
    out, packed = _roundtrip(build_strategy("mink", 0.8, **options), x, "conv")
    expected = _keep_topk(x, k)
    assert _cache_bytes(packed) == math.ceil(n / 8) + _value_bytes(values, k)
    assert torch.equal(out != 0, expected != 0)
    if values.startswith("int"):
        # Each value is off by at most half a quantisation step of its chunk of 16 kept values.
        kept_vals = expected.reshape(-1)[expected.reshape(-1) != 0]
        levels = 127 if values == "int8" else 7
        scales = F.pad(kept_vals.abs(), (0, (-k) % 16)).view(-1, 16).amax(1) / levels
        bound = scales.repeat_interleave(16)[:k] / 2 * (1 + 1e-5)
        err = (out.reshape(-1)[expected.reshape(-1) != 0] - kept_vals).abs()
        assert bool((err <= bound).all())
    else:
        dtype = torch.float16 if values == "fp16" else torch.bfloat16
        assert torch.equal(out, expected.to(dtype).float())


def test_mink_bf16_input_keeps_ties() -> None:
    x = _x(CONV_SHAPE, seed=3).to(torch.bfloat16)
    n, k = x.numel(), _kept_count(0.8, x.numel())
    out, packed = _roundtrip(build_strategy("mink", 0.8), x, "conv")
    a = x.float().abs()
    kth = torch.topk(a.reshape(-1), k).values.min()
    expected = torch.where(a >= kth, x, torch.zeros_like(x))
    assert torch.equal(out, expected)
    kept = int((a >= kth).sum())
    assert kept >= k
    assert _cache_bytes(packed) == math.ceil(n / 8) + 2 * kept


def test_mink_never_stores_zeros() -> None:
    x = _x((4, 10), seed=4)
    x[:, ::2] = 0.0  # half the elements are exact zeros
    out, packed = _roundtrip(build_strategy("mink", 0.0), x, "linear")
    assert torch.equal(out, x)
    assert _cache_bytes(packed) == math.ceil(40 / 8) + 4 * 20
    # gamma 0.4 wants 24 elements but only 20 are non-zero: nothing more is stored.
    out, packed = _roundtrip(build_strategy("mink", 0.4), x, "linear")
    assert torch.equal(out, x)
    assert _cache_bytes(packed) == 5 + 4 * 20


def _parallel_expected(x: torch.Tensor, gamma: float, chunk: int) -> tuple[torch.Tensor, int]:
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    kept = 0
    for start in range(0, flat.numel(), chunk):
        piece = flat[start : start + chunk]
        k = _kept_count(gamma, piece.numel())
        idx = torch.topk(piece.abs(), k).indices + start
        out[idx] = flat[idx]
        kept += k
    return out.view(x.shape), kept


@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", LINEAR_SHAPE)])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_parallel_mink_topk_per_chunk_with_tail(layout: str, shape, gamma: float) -> None:
    x = _x(shape, seed=5)
    n = x.numel()
    assert n % 64 != 0  # a tail chunk exists
    expected, kept = _parallel_expected(x, gamma, 64)
    out, packed = _roundtrip(build_strategy("parallel_mink", gamma, chunk=64), x, layout)
    assert torch.equal(out, expected)
    assert _cache_bytes(packed) == math.ceil(n / 8) + 4 * kept
    # One global top-k would keep a different set: the chunking is real.
    assert not torch.equal(out, _keep_topk(x, _kept_count(gamma, n)))


def _threshold_expected(x: torch.Tensor, gamma: float, stride: int) -> torch.Tensor:
    # Documented: the gamma-quantile of |x| read at a prime stride (the ceil(gamma*m)-th smallest
    # of the m sampled values); everything at or above it is kept.
    sample = x.abs().reshape(-1)[::stride]
    thr = torch.sort(sample).values[math.ceil(gamma * sample.numel()) - 1]
    return torch.where(x.abs() >= thr, x, torch.zeros_like(x))


@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", (14, 15))])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_threshold_is_the_quantile_of_a_prime_stride_sample(
    layout: str, shape, gamma: float
) -> None:
    x = _x(shape, seed=6)
    n = x.numel()
    assert n == 210
    # sample=42: n // sample = 5, a prime, so the sample is x[::5] (42 values).
    out, packed = _roundtrip(build_strategy("threshold", gamma, sample=42), x, layout)
    expected = _threshold_expected(x, gamma, 5)
    assert torch.equal(out, expected)
    kept = int((expected != 0).sum())
    assert abs(kept / n - (1 - gamma)) < 0.1
    assert _cache_bytes(packed) == math.ceil(n / 8) + 4 * kept


@pytest.mark.parametrize("shape,options", [((4, 16, 8, 8), {}), ((5, 8, 8, 8), {"sample": 1024})])
def test_threshold_sample_does_not_lock_onto_columns(shape, options) -> None:
    # Even columns are 100x smaller than odd ones: a sample of even columns only puts the
    # threshold among the small values and keeps about 75% instead of 50%.
    x = _x(shape, seed=18)
    x[..., 0::2] *= 0.01
    out, _ = _roundtrip(build_strategy("threshold", 0.5, **options), x, "conv")
    kept = int((out != 0).sum()) / x.numel()
    assert abs(kept - 0.5) < 0.05


@pytest.mark.parametrize("gamma", GAMMAS)
def test_threshold_small_sample_properties(gamma: float) -> None:
    x = _x((4, 8, 16, 16), seed=7)
    n = x.numel()
    out, packed = _roundtrip(build_strategy("threshold", gamma, sample=2048), x, "conv")
    kept_mask = out != 0
    assert torch.equal(out[kept_mask], x[kept_mask])  # kept values are exact
    # The kept set is an upper set of |x|: {|x| >= t} for some t.
    assert x.abs()[kept_mask].min() > x.abs()[~kept_mask].max()
    kept = int(kept_mask.sum())
    assert abs(kept / n - (1 - gamma)) < 0.04
    assert _cache_bytes(packed) == math.ceil(n / 8) + 4 * kept


@pytest.mark.parametrize("layout,shape", [("conv", (4, 8, 16, 16)), ("linear", (64, 128))])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_random_fraction_values_and_seed(layout: str, shape, gamma: float) -> None:
    x = _x(shape, seed=8)
    n = x.numel()
    strat = build_strategy("random", gamma, seed=3)
    out, packed = _roundtrip(strat, x, layout)
    kept_mask = out != 0
    assert torch.equal(out[kept_mask], x[kept_mask])
    kept = int(kept_mask.sum())
    assert abs(kept / n - (1 - gamma)) < 0.03
    assert packed.bits is None and len(packed.stored()) == 1  # mask rebuilt from the seed
    assert _cache_bytes(packed) == 4 * kept
    again, _ = _roundtrip(build_strategy("random", gamma, seed=3), x, layout)
    assert torch.equal(again, out)
    other, _ = _roundtrip(build_strategy("random", gamma, seed=4), x, layout)
    assert not torch.equal(other != 0, kept_mask)
    # The pack's key (step and layer, from the InputCache) picks the draw: another key, another
    # mask; the same key, the same mask.
    second, _ = _roundtrip(strat, x, layout, key=1)
    assert not torch.equal(second != 0, kept_mask)
    assert torch.equal(_roundtrip(strat, x, layout, key=1)[0], second)


def test_random_int8_bytes() -> None:
    x = _x((4, 8, 8, 8), seed=9)
    strat = build_strategy("random", 0.8, values="int8", int8_chunk=16, seed=5)
    _, packed = _roundtrip(strat, x, "conv")
    # int8 may round tiny kept values to zero: count the kept set with fp32 values, same seed.
    exact, _ = _roundtrip(build_strategy("random", 0.8, seed=5), x, "conv")
    kept = int((exact != 0).sum())
    assert _cache_bytes(packed) == kept + 4 * math.ceil(kept / 16)


# ----------------------------------------------------------------------- planes, blocks, pooling


def _units(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "conv":
        return x.reshape(-1, x.shape[-2] * x.shape[-1])
    return x.reshape(-1, x.shape[-1]).t()


@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", LINEAR_SHAPE)])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_channel_mink_keeps_largest_norm_units(layout: str, shape, gamma: float) -> None:
    x = _x(shape, seed=10)
    units = _units(x, layout)
    n_units, width = units.shape
    k = _kept_count(gamma, n_units)
    assert k >= 1
    norms = torch.tensor([math.sqrt(sum(v * v for v in row.tolist())) for row in units])
    keep = set(torch.argsort(norms, descending=True)[:k].tolist())
    expected = x.clone()
    for u in range(n_units):
        if u in keep:
            continue
        if layout == "conv":
            expected.view(-1, shape[-2], shape[-1])[u] = 0
        else:
            expected[..., u] = 0
    out, packed = _roundtrip(build_strategy("channel_mink", gamma), x, layout)
    assert torch.equal(out, expected)
    assert _cache_bytes(packed) == k * width * 4 + 4 * k


def _kept_units(out: torch.Tensor, x: torch.Tensor, layout: str) -> list[int]:
    """Indices of units that are kept whole; asserts every other unit is all zeros."""
    uo, ux = _units(out, layout), _units(x, layout)
    kept = []
    for u in range(ux.shape[0]):
        if torch.equal(uo[u], ux[u]):
            kept.append(u)
        else:
            assert torch.equal(uo[u], torch.zeros_like(uo[u]))
    return kept


@pytest.mark.parametrize("layout,shape", [("conv", (2, 5, 3, 4)), ("linear", (6, 20))])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_channel_random_whole_units_count_and_seed(layout: str, shape, gamma: float) -> None:
    x = _x(shape, seed=11)
    units = _units(x, layout)
    k = _kept_count(gamma, units.shape[0])
    out, packed = _roundtrip(build_strategy("channel_random", gamma, seed=1), x, layout)
    kept = _kept_units(out, x, layout)
    assert len(kept) == k
    assert _cache_bytes(packed) == k * units.shape[1] * 4 + 4 * k
    again, _ = _roundtrip(build_strategy("channel_random", gamma, seed=1), x, layout)
    assert torch.equal(again, out)
    picks = {
        tuple(_kept_units(_roundtrip(build_strategy("channel_random", gamma, seed=s), x, layout)[0],
                          x, layout))
        for s in range(6)
    }  # fmt: skip
    assert len(picks) > 1  # the seed matters


def _block_expected(planes: torch.Tensor, gamma: float, b: int) -> tuple[torch.Tensor, int]:
    m, h, w = planes.shape
    hb, wb = math.ceil(h / b), math.ceil(w / b)
    scored = []
    for p in range(m):
        for i in range(hb):
            for j in range(wb):
                block = planes[p, i * b : (i + 1) * b, j * b : (j + 1) * b]
                scored.append((float(block.double().pow(2).sum().sqrt()), p, i, j))
    k = _kept_count(gamma, len(scored))
    scored.sort(reverse=True)
    out = torch.zeros_like(planes)
    for _, p, i, j in scored[:k]:
        sl = (p, slice(i * b, (i + 1) * b), slice(j * b, (j + 1) * b))
        out[sl] = planes[sl]
    return out, k


@pytest.mark.parametrize(
    "layout,shape,block",
    [
        ("conv", (2, 3, 4, 6), 2),  # divisible by the block
        ("conv", CONV_SHAPE, 2),  # 5x7: padded blocks at the bottom and right
        ("conv", CONV_SHAPE, 3),
        ("linear", LINEAR_SHAPE, 4),  # 12x10 matrix, 10 not divisible by 4
    ],
)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_block_mink_keeps_largest_norm_blocks(layout: str, shape, block: int, gamma: float) -> None:
    x = _x(shape, seed=12)
    planes = x.reshape(-1, shape[-2], shape[-1]) if layout == "conv" else x.reshape(1, *shape)
    expected, k = _block_expected(planes, gamma, block)
    out, packed = _roundtrip(build_strategy("block_mink", gamma, block=block), x, layout)
    assert torch.equal(out, expected.reshape(shape))
    assert _cache_bytes(packed) == k * block * block * 4 + 4 * k


def _pool_expected(x: torch.Tensor, layout: str, f: int) -> tuple[torch.Tensor, int]:
    out = torch.empty_like(x)
    if layout == "conv":
        planes, dst = x.reshape(-1, x.shape[-2], x.shape[-1]), out.view(-1, *x.shape[-2:])
        h, w = x.shape[-2:]
        cells = 0
        for p in range(planes.shape[0]):
            for i in range(0, h, f):
                for j in range(0, w, f):
                    win = planes[p, i : i + f, j : j + f]
                    dst[p, i : i + f, j : j + f] = win.double().mean().float()
                    cells += 1
        return out, cells
    rows, dst = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    cells = 0
    for r in range(rows.shape[0]):
        for j in range(0, rows.shape[1], f * f):
            dst[r, j : j + f * f] = rows[r, j : j + f * f].double().mean().float()
            cells += 1
    return out, cells


@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", LINEAR_SHAPE)])
@pytest.mark.parametrize(
    "gamma,options,factor", [(0.5, {}, 1), (0.8, {}, 2), (0.8, {"factor": 3}, 3)]
)
def test_pool_window_means_repeated(layout: str, shape, gamma: float, options, factor: int) -> None:
    x = _x(shape, seed=13)
    strat = build_strategy("pool", gamma, **options)
    out, packed = _roundtrip(strat, x, layout)
    expected, cells = _pool_expected(x, layout, factor)
    # Means are summed in a different order than avg_pool: equal up to float rounding.
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    if factor == 1:
        assert torch.equal(out, x)
    else:
        # Every window is one repeated value, exactly.
        if layout == "conv":
            h, w = shape[-2:]
            planes = out.reshape(-1, h, w)
            for i in range(0, h, factor):
                for j in range(0, w, factor):
                    win = planes[:, i : i + factor, j : j + factor]
                    assert torch.equal(win, win[:, :1, :1].expand_as(win))
        else:
            for j in range(0, shape[-1], factor * factor):
                win = out[:, j : j + factor * factor]
                assert torch.equal(win, win[:, :1].expand_as(win))
    assert _cache_bytes(packed) == cells * 4
    if layout == "conv":
        h, w = shape[-2:]
        planes = shape[0] * shape[1]
        assert cells == math.ceil(h / factor) * math.ceil(w / factor) * planes


# --------------------------------------------------------------------------------- all strategies


# quant quantises whatever gamma is: gamma means nothing to it.
@pytest.mark.parametrize("name", [n for n in STRATEGIES if REGISTRY.get(n).uses_gamma])
@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", LINEAR_SHAPE)])
def test_gamma_zero_is_exact(name: str, layout: str, shape) -> None:
    x = _x(shape, seed=14)
    out, _ = _roundtrip(build_strategy(name, 0.0), x, layout)
    assert torch.equal(out, x)


def test_strategy_list() -> None:
    assert set(STRATEGIES) == {
        "mink",
        "parallel_mink",
        "random",
        "channel_mink",
        "channel_random",
        "block_mink",
        "pool",
        "threshold",
        "importance",
        "quant",
    }


@pytest.mark.parametrize(
    "name,options",
    [
        ("mink", {}),
        ("threshold", {}),
        ("parallel_mink", {"chunk": 3}),  # 24-element slices, chunks of 3 and a tail
        ("parallel_mink", {"chunk": 5}),
    ],
)
def test_elementwise_slicing_does_not_change_the_result(monkeypatch, name: str, options) -> None:
    x = _x(CONV_SHAPE, seed=15)
    whole, whole_t = _roundtrip(build_strategy(name, 0.8, **options), x, "conv")
    monkeypatch.setattr(base_mod, "SLICE", 16)
    sliced, sliced_t = _roundtrip(build_strategy(name, 0.8, **options), x, "conv")
    assert torch.equal(sliced, whole)
    assert _cache_bytes(sliced_t) == _cache_bytes(whole_t)


def test_random_multi_slice_round_trip(monkeypatch) -> None:
    monkeypatch.setattr(base_mod, "SLICE", 16)
    x = _x((4, 8, 8, 8), seed=16)
    out, packed = _roundtrip(build_strategy("random", 0.5, seed=2), x, "conv")
    kept_mask = out != 0
    assert torch.equal(out[kept_mask], x[kept_mask])
    assert abs(int(kept_mask.sum()) / x.numel() - 0.5) < 0.05
    assert _cache_bytes(packed) == 4 * int(kept_mask.sum())


@pytest.mark.parametrize("name", STRATEGIES)
def test_empty_input_round_trips(name: str) -> None:
    x = torch.zeros(0, 3, 4, 4)
    out, _ = _roundtrip(build_strategy(name, 0.8), x, "conv")
    assert out.shape == x.shape


@pytest.mark.parametrize(
    "name,options,match",
    [
        ("parallel_mink", {"chunk": 0}, "chunk=0"),
        ("threshold", {"sample": 0}, "sample=0"),
        ("block_mink", {"block": 0}, "block=0"),
        ("pool", {"factor": 0}, "factor=0"),
        ("mink", {"int8_chunk": 0}, "int8_chunk=0"),
        ("pool", {"int4_chunk": 0}, "int4_chunk=0"),
    ],
)
def test_option_ranges(name: str, options, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_strategy(name, 0.5, **options)


# ------------------------------------------------------------------------------------ input cache


def _same(a, b) -> bool:
    """Two packs are one: the same tensors (the cache hands back what it packed)."""
    return a.meta == b.meta and all(x is y for x, y in zip(a[1:], b[1:], strict=True))


def test_input_cache_shares_packs_until_the_tensor_changes() -> None:
    cache = InputCache(build_strategy("mink", 0.5))
    x = _x(CONV_SHAPE, seed=17)
    first = cache.pack(x, "conv")
    assert _same(cache.pack(x, "conv"), first)
    # Another tensor with equal values is a different input: its own pack.
    assert not _same(cache.pack(x.clone(), "conv"), first)
    # The same tensor seen with another layout is packed again.
    assert not _same(cache.pack(x, "linear"), first)
    x.mul_(2.0)  # in-place change: version bump
    second = cache.pack(x, "conv")
    assert not _same(second, first)
    assert _same(cache.pack(x, "conv"), second)
    assert torch.equal(cache.unpack(second), _keep_topk(x, _kept_count(0.5, x.numel())))
    assert torch.equal(cache.unpack(first) * 2.0, cache.unpack(second))


def test_a_backward_ends_the_forward_whose_packs_are_shared() -> None:
    # Without set_step, a tensor fed again in a later step (a fixed input, one batch trained on
    # repeatedly) is packed afresh, with the next draw: the cache forgets its packs once a
    # backward begins, and holds none past the graph that saved it.
    cache = InputCache(build_strategy("quant", 0.0, bits=2))
    x = _x(CONV_SHAPE, seed=18)
    first = cache.pack(x, "conv")
    assert _same(cache.pack(x, "conv"), first)  # within one forward: shared
    cache.end_forward()
    assert not torch.equal(cache.pack(x, "conv").values, first.values)  # a new draw
    model = to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3)), strategy="quant", bits=2, strict=False)
    grads = []
    for _ in range(2):  # the same tensor object twice, no set_step between
        model.zero_grad()
        model(x).sum().backward()
        grads.append(model[0].weight.grad.clone())
    assert not torch.equal(*grads)


@pytest.mark.parametrize("name", [n for n in STRATEGIES if "values" in REGISTRY.options(n)])
@pytest.mark.parametrize("layout,shape", [("conv", CONV_SHAPE), ("linear", LINEAR_SHAPE)])
def test_int4_values_round_trip_for_every_strategy(name: str, layout: str, shape) -> None:
    # Odd value counts (a padding code in the last byte) included: channel and block rows.
    # The same key, so random choices are the same: only the value format differs.
    x = _x(shape, seed=19)
    exact, _ = _roundtrip(build_strategy(name, 0.5), x, layout, key=5)
    options = {"values": "int4", "int4_chunk": 8}
    out, _ = _roundtrip(build_strategy(name, 0.5, **options), x, layout, key=5)
    # Within half a step of each chunk's scale: at most 1/14 of the largest kept magnitude.
    assert float((out - exact).abs().max()) <= float(exact.abs().max()) / 14 * (1 + 1e-5)


@pytest.mark.parametrize("name", ["mink", "threshold", "parallel_mink", "importance"])
def test_sparse_bits_positions_round_trip_and_bytes(monkeypatch, name: str) -> None:
    # The CPU's packs, sized to their count (tests/core/test_dropit_fixed.py: sized from the
    # shape, as on a GPU).
    monkeypatch.setattr(base_mod, "SLICE", 64)
    x = _x((2, 4, 10, 10), seed=20)
    x[:, :2] = 0.0  # whole zero planes: zero mask bytes
    options = {"chunk": 32} if name == "parallel_mink" else {}
    dense, dense_t = _roundtrip(build_strategy(name, 0.9, **options), x, "conv")
    out, packed = _roundtrip(
        build_strategy(name, 0.9, positions="sparse_bits", **options), x, "conv"
    )
    assert torch.equal(out, dense)
    bits = dense_t.bits
    nonzero = int((bits != 0).sum())
    assert nonzero < bits.numel() // 2
    assert packed.bits.numel() == math.ceil(bits.numel() / 8) and torch.equal(
        packed.mask_bytes, bits[bits != 0]
    )
    assert (
        _cache_bytes(packed) == _cache_bytes(dense_t) - bits.numel() + packed.bits.numel() + nonzero
    )


def test_positions_option_is_checked() -> None:
    with pytest.raises(ValueError, match="positions='rle' is invalid: allowed"):
        build_strategy("mink", 0.9, positions="rle")
    with pytest.raises(ValueError, match="'positions' does not apply to strategy 'random'"):
        build_strategy("random", 0.9, positions="sparse_bits")


@pytest.mark.parametrize("name", ["channel_mink", "block_mink"])
@pytest.mark.parametrize("layout,shape", [("conv", (3, 4, 8, 8)), ("linear", (40, 12))])
def test_norms_in_slices_choose_the_same_units(monkeypatch, name: str, layout: str, shape) -> None:
    # A bf16 input is turned into fp32 norms a few rows at a time, never copied whole.
    x = _x(shape, seed=21).to(torch.bfloat16)
    whole, whole_t = _roundtrip(build_strategy(name, 0.5), x, layout)
    monkeypatch.setattr(base_mod, "SLICE", 40)
    sliced, sliced_t = _roundtrip(build_strategy(name, 0.5), x, layout)
    assert torch.equal(sliced, whole)
    assert torch.equal(torch.sort(sliced_t.index).values, torch.sort(whole_t.index).values)

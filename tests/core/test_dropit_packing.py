"""Bit masks and value codecs of dropit_core.formats.bits: exact round trips and exact byte
counts."""

from __future__ import annotations

import math

import pytest
import torch

from dropit_core.formats.bits import (
    bit_positions,
    compact_bits,
    compact_into,
    kept_indices,
    pack_bits,
    scatter_kept,
    unpack_bits,
    zero_flagged,
)
from dropit_core.formats.bits import pack_low_bits as pack_codes
from dropit_core.formats.quant import unpack_codes
from dropit_core.formats.values import VALUE_FORMATS, ValueCodec


def _reference_pack(mask: torch.Tensor) -> torch.Tensor:
    """Little-endian bit packing written the slow, obvious way."""
    flags = mask.tolist()
    out = []
    for start in range(0, len(flags), 8):
        byte = 0
        for i, flag in enumerate(flags[start : start + 8]):
            byte |= int(flag) << i
        out.append(byte)
    return torch.tensor(out, dtype=torch.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_pack_bits_round_trip_and_size(n: int, p: float) -> None:
    gen = torch.Generator().manual_seed(n * 10 + int(p * 10))
    mask = torch.rand(n, generator=gen) < p
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8
    assert bits.numel() == math.ceil(n / 8)
    assert bits.nbytes == math.ceil(n / 8)
    assert torch.equal(bits, _reference_pack(mask))
    back = unpack_bits(bits, n)
    assert back.dtype == torch.bool
    assert back.shape == (n,)
    assert torch.equal(back, mask)


def test_pack_bits_bit_order_is_little_endian() -> None:
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert pack_bits(mask).tolist() == [1, 6]
    every = torch.ones(16, dtype=torch.bool)
    every[7] = False
    assert pack_bits(every).tolist() == [127, 255]


def test_unpack_bits_of_a_byte_slice() -> None:
    # Strategies rebuild masks slice by slice from byte ranges of one packed tensor.
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(64, generator=gen) < 0.5
    bits = pack_bits(mask)
    assert torch.equal(unpack_bits(bits[2:5], 20), mask[16:36])


def test_pack_bits_accepts_a_sliced_mask() -> None:
    gen = torch.Generator().manual_seed(2)
    big = torch.rand(20, generator=gen) < 0.5
    view = big[1:9]
    assert torch.equal(unpack_bits(pack_bits(view), 8), view)


def _values(m: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, generator=gen) * torch.linspace(0.01, 10.0, max(m, 1))[:m]


@pytest.mark.parametrize("m", [0, 1, 37, 300])
def test_codec_same_is_identity(m: int) -> None:
    codec = ValueCodec("same")
    v = _values(m)
    parts = codec.encode(v)
    assert len(parts) == 1
    assert torch.equal(codec.decode(parts, torch.float32), v)
    assert sum(t.nbytes for t in parts) == codec.nbytes(m, 4) == 4 * m


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("m", [0, 1, 37, 300])
def test_codec_half_formats(fmt: str, dtype: torch.dtype, m: int) -> None:
    codec = ValueCodec(fmt)
    v = _values(m, seed=3)
    parts = codec.encode(v)
    assert len(parts) == 1 and parts[0].dtype == dtype
    decoded = codec.decode(parts, torch.float32)
    assert decoded.dtype == torch.float32
    assert torch.equal(decoded, v.to(dtype).to(torch.float32))
    assert sum(t.nbytes for t in parts) == codec.nbytes(m, 4) == 2 * m


@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("m", [0, 1, 16, 37, 300])
def test_codec_int8_error_and_bytes(chunk: int, m: int) -> None:
    codec = ValueCodec("int8", int8_chunk=chunk)
    v = _values(m, seed=chunk + m)
    q, scale = codec.encode(v)
    assert q.dtype == torch.int8 and q.numel() == m
    n_chunks = math.ceil(m / chunk)
    assert scale.dtype == torch.float32 and scale.numel() == n_chunks
    decoded = codec.decode((q, scale), torch.float32)
    assert decoded.shape == (m,)
    for c in range(n_chunks):
        part = v[c * chunk : (c + 1) * chunk]
        expect_scale = part.abs().max() / 127.0
        assert torch.allclose(scale[c], expect_scale, rtol=1e-6, atol=0)
        err = (decoded[c * chunk : (c + 1) * chunk] - part).abs()
        assert bool((err <= expect_scale / 2 * (1 + 1e-5)).all())
    assert q.nbytes + scale.nbytes == codec.nbytes(m, 4) == m + 4 * n_chunks


def test_codec_int8_zero_chunk_and_exact_extremes() -> None:
    codec = ValueCodec("int8", int8_chunk=4)
    v = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, -1.0, 0.5, -2.0])
    decoded = codec.decode(codec.encode(v), torch.float32)
    assert torch.equal(decoded[:4], torch.zeros(4))
    # The chunk's absmax is exactly representable: it maps to +-127 and back.
    assert decoded[4].item() == pytest.approx(2.0, rel=1e-6)
    assert decoded[7].item() == pytest.approx(-2.0, rel=1e-6)
    assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
def test_codec_decodes_to_requested_dtype(fmt: str) -> None:
    codec = ValueCodec(fmt, int8_chunk=8, int4_chunk=8)
    v = _values(20, seed=5).to(torch.bfloat16)
    out = codec.decode(codec.encode(v), torch.bfloat16, 20)
    assert out.dtype == torch.bfloat16
    assert codec.nbytes(20, 2) == sum(t.nbytes for t in codec.encode(v))


@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("m", [0, 1, 16, 37, 300])
def test_codec_int4_two_codes_per_byte_error_and_bytes(chunk: int, m: int) -> None:
    codec = ValueCodec("int4", int4_chunk=chunk)
    v = _values(m, seed=chunk + m + 1)
    q, scale = codec.encode(v)
    assert q.dtype == torch.uint8 and q.numel() == math.ceil(m / 2)
    n_chunks = math.ceil(m / chunk)
    assert scale.numel() == n_chunks
    decoded = codec.decode((q, scale), torch.float32, m)
    assert decoded.shape == (m,)
    for c in range(n_chunks):
        part = v[c * chunk : (c + 1) * chunk]
        expect_scale = part.abs().max() / 7.0
        assert torch.allclose(scale[c], expect_scale, rtol=1e-6, atol=0)
        err = (decoded[c * chunk : (c + 1) * chunk] - part).abs()
        assert bool((err <= expect_scale / 2 * (1 + 1e-5)).all())
        # 15 levels: every decoded value is an integer multiple of the scale within +-7.
        levels = decoded[c * chunk : (c + 1) * chunk] / scale[c]
        assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= 7.0001
    assert q.nbytes + scale.nbytes == codec.nbytes(m, 4) == math.ceil(m / 2) + 4 * n_chunks


def test_codec_int4_needs_the_count() -> None:
    codec = ValueCodec("int4")
    with pytest.raises(ValueError, match="needs their count"):
        codec.decode(codec.encode(torch.ones(3)), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 8, 13, 4099])
def test_zero_flagged_is_masked_fill_bit_for_bit(dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=gen).to(dtype)
    specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=dtype)[:n]
    values[: specials.numel()] = specials
    flags = torch.rand(n, generator=gen) < 0.5
    flags[0] = False  # the NaN passes
    out = zero_flagged(values, pack_bits(flags))
    ref = values.masked_fill(flags, 0)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    assert out.dtype == dtype and out.shape == values.shape
    assert torch.equal(out.view(ints), ref.view(ints))  # NaN, inf and the sign of zero included
    assert math.isnan(float(out[0]))


def test_zero_flagged_takes_strided_values_and_keeps_their_shape() -> None:
    values = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # not contiguous
    flags = values.contiguous() % 3 == 0
    out = zero_flagged(values, pack_bits(flags.reshape(-1)))
    assert out.shape == (6, 4)
    assert torch.equal(out, values.masked_fill(flags, 0))


@pytest.mark.parametrize("n", [0, 1, 9, 64, 1003])
@pytest.mark.parametrize("slice_len", [8, 64, 4096])
@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("spare", [0, 5])
def test_scatter_kept_rebuilds_what_masked_scatter_would(n, slice_len, p, spare) -> None:
    # `spare` unused slots after the kept values: a pack sized from the shape.
    gen = torch.Generator().manual_seed(n + slice_len)
    mask = torch.rand(n, generator=gen) < p
    kept = torch.randn(int(mask.sum()), generator=gen)
    slots = torch.cat([kept, torch.full((spare,), 7.0)])
    dense = scatter_kept(pack_bits(mask), slots, n, slice_len)
    assert torch.equal(dense, torch.zeros(n).masked_scatter_(mask, kept))


@pytest.mark.parametrize("slice_len", [8, 64, 4096])
@pytest.mark.parametrize("slots", [0, 30, 77, 200])
def test_scatter_kept_from_rebuilt_flags_zeroes_the_flags_past_the_last_slot(slice_len, slots):
    # A mask rebuilt from a seed may flag more values than a fixed capacity stored: the first
    # `slots` flagged (in flat order) take the values, the rest rebuild as zeros.
    gen = torch.Generator().manual_seed(slots)
    mask = torch.rand(1003, generator=gen) < 0.1
    values = torch.randn(slots, generator=gen) + 10
    count = int(mask.sum())
    assert 77 < count < 200
    dense = scatter_kept(
        None, values, 1003, slice_len, lambda s, length: pack_bits(mask[s : s + length])
    )
    stored = torch.zeros(1003, dtype=torch.bool)
    stored[torch.nonzero(mask).squeeze(1)[:slots]] = True
    expected = torch.zeros(1003).masked_scatter_(stored, values[: min(slots, count)])
    assert torch.equal(dense, expected)


def test_bit_positions_count_set_flags_before_each_and_take_wide_indices_when_needed() -> None:
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    pos, end = bit_positions(pack_bits(mask), mask.numel(), base=5)
    assert pos.dtype == torch.int32
    assert pos.tolist() == [6, 0, 7, 8, 0, 0, 0, 9, 10, 0, 11]
    assert int(end) == 5 + 6  # the next slice's base
    wide, _ = bit_positions(pack_bits(mask), mask.numel(), base=5, total=2**31)
    assert wide.dtype == torch.int64 and torch.equal(wide, pos.long())
    # A base on the device (the running count of a rebuild) gives the same.
    pos2, end2 = bit_positions(pack_bits(mask), mask.numel(), torch.tensor(5), total=100)
    assert torch.equal(pos2, pos) and int(end2) == 11


@pytest.mark.parametrize("length", [0, 1, 13, 64])
@pytest.mark.parametrize("capacity", [0, 3, 10, 64])
@pytest.mark.parametrize("base", [0, 2, 70])
def test_compact_into_appends_what_fits_and_flags_exactly_that(length, capacity, base) -> None:
    gen = torch.Generator().manual_seed(length * 7 + capacity)
    values = torch.randn(length, generator=gen)
    mask = torch.rand(length, generator=gen) < 0.5
    out = torch.full((capacity + 1,), -1.0)
    flags, end, flagged = compact_into(values, mask, out, torch.tensor(base))
    fits = max(0, min(int(mask.sum()), capacity - base))
    first = torch.nonzero(mask).squeeze(1)[:fits]
    assert int(flagged) == int(mask.sum()) and int(end) == base + fits
    assert flags.dtype == torch.bool and flags.shape == (length,)
    assert torch.equal(torch.nonzero(flags).squeeze(1), first)  # the first that fit, in order
    assert torch.equal(out[base : base + fits], values[first])
    untouched = torch.cat([out[: min(base, capacity)], out[base + fits : capacity]])
    assert bool((untouched == -1.0).all())  # nothing else written, the spare slot aside
    again = torch.full((capacity + 1,), -1.0)
    none, end2, _ = compact_into(values, mask, again, torch.tensor(base), flags=False)
    assert none is None and int(end2) == int(end) and torch.equal(again[:capacity], out[:capacity])


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1001, 1 << 16])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.2, 0.5, 1.0])
def test_kept_indices_are_nonzero_of_the_flags(n: int, density: float) -> None:
    gen = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=gen) < density
    idx = kept_indices(pack_bits(mask))
    assert idx.dtype == torch.int32
    assert torch.equal(idx.long(), torch.nonzero(mask).squeeze(1))
    x = torch.randn(n, generator=gen)
    assert torch.equal(compact_bits(x, pack_bits(mask)), x[mask])


def test_kept_indices_by_hand() -> None:
    # bytes 0b00001101, 0b00000000, 0b10000001: flags 0, 2, 3, then 16 and 23
    bits = torch.tensor([0b1101, 0, 0b10000001], dtype=torch.uint8)
    assert kept_indices(bits).tolist() == [0, 2, 3, 16, 23]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 8, 37])
def test_pack_codes_round_trip_and_size(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n + bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=gen).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_pack_codes_order_is_low_bits_first() -> None:
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    assert pack_codes(codes[:2], 4).tolist() == [1 | 2 << 4]


def test_the_relu_mask_packed_and_applied_by_slices_is_the_whole_maps() -> None:
    """pack_blocked and zero_flagged_sliced work a slice at a time (their temporaries stay a
    slice's): the same bytes and values as the one-pass forms, a ragged last slice included."""
    from dropit_core.formats.bits import (
        MASK_SLICE,
        pack_blocked,
        zero_flagged,
        zero_flagged_sliced,
    )

    gen = torch.Generator().manual_seed(0)
    n = 2 * MASK_SLICE + 13
    out = torch.randn(n, generator=gen).relu_().view(1, -1, 1)
    out[0, 5, 0] = float("nan")  # passes, as the plain ReLU's backward lets it
    bits = pack_blocked(out)
    assert torch.equal(bits, pack_bits((out <= 0).reshape(-1)))
    grad = torch.randn(out.shape, generator=gen)
    assert torch.equal(zero_flagged_sliced(grad, bits), zero_flagged(grad, bits))
    small = out[:, :100]
    assert torch.equal(pack_blocked(small), pack_bits((small <= 0).reshape(-1)))

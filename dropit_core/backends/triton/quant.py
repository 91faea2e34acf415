"""The quant pack and rebuild, one Triton launch each (reference: :mod:`dropit_core.formats.quant`).

Each program owns whole groups (a [ROWS, group] tile), so its minima and steps stay in registers,
and each group's codes fill whole bytes, so no two programs share a byte. The fp32 operations are
the eager path's, in its order, with no fused multiply-add: the bytes are eager's.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from dropit_core.backends.triton.launch import tile
from dropit_core.backends.triton.noise import uniform
from dropit_core.formats.quant import buffers as quant_buffers
from dropit_core.formats.quant import inv_levels
from dropit_core.formats.seeds import UNIFORM_BITS, hash_keys

PACK_BLOCK = 2048  # elements per program (whole groups: at least one group)
REBUILD_BLOCK = 2048
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TINY = torch.finfo(torch.float32).tiny
_TINY = {dtype: torch.finfo(dtype).tiny for dtype in FLOATS}

assert UNIFORM_BITS <= 24  # the draws are exact in fp32


# Keys are random 32-bit words: one that happens to be 1 must not become a constant.
@triton.jit(do_not_specialize=["key_low", "key_high"])
def quant_codes_kernel(
    x_ptr, codes_ptr, mins_ptr, scales_ptr, zero_ptr, negative_ptr, n, n_groups, n_bytes,
    key_low, key_high, keys_ptr,
    GROUP: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
    INV_LEVELS: tl.constexpr, TINY_F32: tl.constexpr, ROUND: tl.constexpr, SIGNS: tl.constexpr,
    KEYS_IN_MEMORY: tl.constexpr,
):  # fmt: skip
    if KEYS_IN_MEMORY:  # a CUDA graph's pack: the step's keys, written there before the replay
        key_low = tl.load(keys_ptr)
        key_high = tl.load(keys_ptr + 1)
    levels: tl.constexpr = (1 << BITS) - 1
    per_byte: tl.constexpr = 8 // BITS
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, WIDTH)
    idx = row[:, None] * GROUP + col[None, :]
    ok = (col[None, :] < GROUP) & (idx < n)
    x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    if ROUND == 1:  # read as the fp16 values autocast's cast holds
        x = x.to(tl.float16).to(tl.float32)
    elif ROUND == 2:  # as the bf16 ones
        x = _bf16_value(x)
    lo = tl.min(tl.where(ok, x, float("inf")), axis=1)
    hi = tl.max(tl.where(ok, x, float("-inf")), axis=1)
    # A multiply by the rounded 1/levels (not a division by levels): the same on every device.
    scale = tl.maximum((hi - lo) * INV_LEVELS, TINY_F32)
    row_ok = row < n_groups
    tl.store(mins_ptr + row, lo, mask=row_ok)
    tl.store(scales_ptr + row, scale, mask=row_ok)
    y = tl.math.div_rn(x - lo[:, None], scale[:, None])  # IEEE division, as torch's
    y = tl.math.floor(y + uniform(key_low, key_high, idx))
    code = tl.where(ok, tl.minimum(tl.maximum(y, 0.0), levels).to(tl.int32), 0)
    bytes_per_group: tl.constexpr = GROUP // per_byte
    byte_cols: tl.constexpr = WIDTH // per_byte
    if per_byte == 1:
        packed = code
    else:
        # Codes of one byte side by side: their shifted sum is their OR (disjoint bits).
        shifts = tl.arange(0, per_byte) * BITS
        parts = tl.reshape(code, (ROWS, byte_cols, per_byte)) << shifts[None, None, :]
        packed = tl.sum(parts, axis=2)
    bcol = tl.arange(0, byte_cols)
    bidx = row[:, None] * bytes_per_group + bcol[None, :]
    bok = (bcol[None, :] < bytes_per_group) & (bidx < n_bytes)
    tl.store(codes_ptr + bidx, packed.to(tl.uint8), mask=bok)
    if SIGNS:  # 1 bit each for "is zero" and "is negative" (GROUP a multiple of 8: whole bytes)
        _store_flags(zero_ptr, (x == 0) & ok, row, n, GROUP, WIDTH, ROWS)
        _store_flags(negative_ptr, (x < 0) & ok, row, n, GROUP, WIDTH, ROWS)


@triton.jit
def _store_flags(
    flags_ptr, flags, row, n, GROUP: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr
):
    """The [ROWS, WIDTH] tile's flags as bytes of 8, little-endian, as ``formats.bits.pack_bits``
    writes them (flags past ``n`` are zero: the last byte's padding)."""
    shifts = tl.arange(0, 8)
    parts = tl.reshape(tl.where(flags, 1, 0), (ROWS, WIDTH // 8, 8)) << shifts[None, None, :]
    byte = tl.sum(parts, axis=2)
    bcol = tl.arange(0, WIDTH // 8)
    bidx = row[:, None] * (GROUP // 8) + bcol[None, :]
    ok = (bcol[None, :] < GROUP // 8) & (bidx < (n + 7) // 8)
    tl.store(flags_ptr + bidx, byte.to(tl.uint8), mask=ok)


def quant_pack(
    flat: torch.Tensor,
    bits: int,
    group: int,
    seed: int,
    block: int = PACK_BLOCK,
    cast: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, mins, scales) of a flat float tensor, one launch reading the input once; ``block``
    changes no byte. ``cast`` (fp16 or bf16): the pack of ``flat.to(cast)``, rounded in registers.
    """
    _check_pack(flat, bits, group, cast)
    keys = hash_keys(seed)
    return pack_contiguous(flat.contiguous(), bits, group, keys, cast, False, block)[:3]


def quant_pack_signed(
    flat: torch.Tensor, bits: int, group: int, seed: int, block: int = PACK_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quant_pack`'s (codes, mins, scales) and the flags of ``flat == 0`` and ``flat < 0``
    (``pack_bits``' bytes) in the same launch (``group`` a multiple of 8): ``CompressSaved``'s."""
    if group % 8:
        raise ValueError(f"quant_pack_signed: group {group} is not whole bytes of flags")
    _check_pack(flat, bits, group, None)
    return pack_contiguous(flat.contiguous(), bits, group, hash_keys(seed), None, True, block)


def _check_pack(flat: torch.Tensor, bits: int, group: int, cast: torch.dtype | None) -> None:
    if flat.dim() != 1 or flat.dtype not in FLOATS or cast not in (None, *FLOATS):
        raise ValueError(
            "quant_pack takes a flat fp16/bf16/fp32 tensor (and a float cast), got "
            f"{flat.shape} {flat.dtype} (cast {cast})"
        )
    if group % (8 // bits):
        raise ValueError(f"quant_pack: group {group} is not whole bytes of {bits}-bit codes")


def pack_contiguous(
    x: torch.Tensor,
    bits: int,
    group: int,
    keys: tuple[int, int] | torch.Tensor,
    cast: torch.dtype | None = None,
    signs: bool = False,
    block: int = PACK_BLOCK,
) -> tuple[torch.Tensor, ...]:
    """:func:`quant_pack`'s (codes, mins, scales), and with ``signs`` the two flag buffers, of a
    contiguous tensor of any shape read flat, without the checks (every layer of every step:
    host time). ``keys``: ``seeds.hash_keys(seed)``, as ints or as an int64 tensor ``(k0, k1,
    ...)`` on the device, read by the kernel (a CUDA graph's pack: keys as data)."""
    n = x.numel()
    if n > 1 << 44:
        raise ValueError("quant_pack draws for element indices below 2**44")
    codes, mins, scales = quant_buffers(n, bits, group, x.device)
    if signs:  # n flags each, 8 to a byte
        zero = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
        negative = torch.empty_like(zero)
    else:  # the kernel never reads its flag pointers: the codes stand in for them
        zero, negative = codes, codes
    if n == 0:
        return codes, mins, scales, zero, negative
    in_memory = isinstance(keys, torch.Tensor)
    rows, constants = _pack_constants(bits, group, block, cast, signs, in_memory)
    groups = mins.numel()
    key_words = (0, 0, keys) if in_memory else (*keys, codes)
    quant_codes_kernel[(-(-groups // rows),)](
        x, codes, mins, scales, zero, negative, n, groups, codes.numel(), *key_words,
        **constants,
    )  # fmt: skip
    return codes, mins, scales, zero, negative


@cache
def _pack_constants(
    bits: int, group: int, block: int, cast: torch.dtype | None, signs: bool, keyed: bool
) -> tuple[int, dict]:
    """(groups per program, the pack kernel's compile-time arguments) of a setting: made once."""
    width, rows = tile(group, block)
    return rows, {
        "GROUP": group, "WIDTH": width, "ROWS": rows, "BITS": bits,
        "INV_LEVELS": inv_levels(bits), "TINY_F32": TINY, "ROUND": _ROUND.get(cast, 0),
        "SIGNS": signs, "KEYS_IN_MEMORY": keyed, "enable_fp_fusion": False,
    }  # fmt: skip


# quant_pack's cast: the kernel's ROUND (0: values as they are, fp32 or already narrow).
_ROUND = {torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _bf16_value(value):
    """``value`` (fp32) rounded to the nearest bf16, as fp32: torch's ``.to(torch.bfloat16)``."""
    return (_bf16_bits(value).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
        tl.float32, bitcast=True
    )


@triton.jit
def _bf16_bits(value):
    """The bf16 nearest ``value`` (ties to even), as int16 bits: the interpreter's own cast
    truncates, the GPU's rounds; spelled out, both give torch's ``.to(torch.bfloat16)``."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.uint32) >> 16
    rounded = tl.where(value != value, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def quant_rebuild_kernel(
    codes_ptr, mins_ptr, scales_ptr, zero_ptr, negative_ptr, out_ptr, n, n_groups,
    GROUP: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
    BF16: tl.constexpr, SIGNS: tl.constexpr, TINY_OUT: tl.constexpr,
):  # fmt: skip
    per_byte: tl.constexpr = 8 // BITS
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, WIDTH)
    idx = row[:, None] * GROUP + col[None, :]
    ok = (col[None, :] < GROUP) & (idx < n)
    byte = tl.load(codes_ptr + idx // per_byte, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((idx % per_byte).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
    row_ok = row < n_groups
    lo = tl.load(mins_ptr + row, mask=row_ok, other=0.0)
    scale = tl.load(scales_ptr + row, mask=row_ok, other=0.0)
    value = code.to(tl.float32) * scale[:, None] + lo[:, None]  # two roundings, as eager
    if SIGNS:
        # The value as the output dtype holds it (exact in fp32), then the original's sign and
        # zeros: magnitude at least the dtype's smallest normal, as the eager path's clamp.
        if BF16:
            value = _bf16_value(value)
        else:
            value = value.to(out_ptr.dtype.element_ty).to(tl.float32)
        magnitude = tl.abs(value)
        magnitude = tl.where(magnitude < TINY_OUT, TINY_OUT, magnitude)  # NaN stays NaN
        value = tl.where(_flag(negative_ptr, idx, ok), -magnitude, magnitude)
        value = tl.where(_flag(zero_ptr, idx, ok), 0.0, value)
    if BF16:  # out_ptr is the bf16 output viewed as int16
        tl.store(out_ptr + idx, _bf16_bits(value), mask=ok)
    else:
        tl.store(out_ptr + idx, value.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _flag(flags_ptr, idx, ok):
    """Element ``idx``'s flag in bytes packed by ``formats.bits.pack_bits``."""
    byte = tl.load(flags_ptr + idx // 8, mask=ok, other=0).to(tl.int32)
    return ((byte >> (idx % 8).to(tl.int32)) & 1) != 0


def quant_rebuild(
    codes: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    bits: int,
    group: int,
    dtype: torch.dtype,
    block: int = REBUILD_BLOCK,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
    shape: tuple[int, ...] | None = None,
    check: bool = True,
) -> torch.Tensor:
    """The ``dtype`` tensor of n values (flat, or of ``shape``) a quant pack rebuilds to, one
    launch. ``signs``: :func:`quant_pack_signed`'s (zero, negative) flags, restored as
    ``strategies.quant.unpack_signed`` does. ``check=False``: no argument checks (host time).
    """
    if check:
        _check_rebuild(codes, mins, n, bits, group, dtype, signs)
    sizes = (n,) if shape is None else shape
    if sizes:  # as separate ints: torch.empty parses them faster than a tuple of them (timeit)
        out = torch.empty(*sizes, dtype=dtype, device=codes.device)
    else:  # 0-d
        out = torch.empty((), dtype=dtype, device=codes.device)
    if n == 0:
        return out
    rows, constants = _rebuild_constants(bits, group, block, dtype, signs is not None)
    groups = mins.numel()
    zero, negative = (codes, codes) if signs is None else signs  # unread without flags
    quant_rebuild_kernel[(-(-groups // rows),)](
        codes, mins, scales, zero, negative, out.view(torch.int16) if dtype is torch.bfloat16
        else out, n, groups, **constants,
    )  # fmt: skip
    return out


def _check_rebuild(codes, mins, n, bits, group, dtype, signs) -> None:
    if codes.dtype != torch.uint8 or mins.dtype != torch.float32 or dtype not in FLOATS:
        raise ValueError("quant_rebuild takes uint8 codes, fp32 minima and steps, a float dtype")
    if codes.numel() != (n * bits + 7) // 8 or mins.numel() != -(-n // group):
        raise ValueError(f"quant_rebuild: the pack does not hold {n} values of group {group}")
    if signs is not None and any(
        f.dtype != torch.uint8 or f.numel() != (n + 7) // 8 for f in signs
    ):
        raise ValueError(f"quant_rebuild: signs must be two uint8 tensors of {n} flags")


@cache
def _rebuild_constants(
    bits: int, group: int, block: int, dtype: torch.dtype, signs: bool
) -> tuple[int, dict]:
    """(groups per program, the rebuild kernel's compile-time arguments) of a setting."""
    width, rows = tile(group, block)
    return rows, {
        "GROUP": group, "WIDTH": width, "ROWS": rows, "BITS": bits,
        "BF16": dtype is torch.bfloat16, "SIGNS": signs, "TINY_OUT": _TINY[dtype],
        "enable_fp_fusion": False,
    }  # fmt: skip

"""The C loops of the CPU packs (dropit_core/backends/native.c) against eager torch, byte for byte:
the quant pack and rebuild, the ReLU's mask and its gradient; the build, its cache and the fallback
where no compiler works."""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch import nn

from dropit_core import (
    build_strategy,
    configure,
    current_settings,
    reset_settings,
    set_step,
    to_dropit,
)
from dropit_core.backends import dispatch, native
from dropit_core.formats import packed as base
from dropit_core.formats.bits import pack_blocked, zero_flagged_sliced
from dropit_core.layers.relu import relu_and_mask, relu_mask_grad


@pytest.fixture
def loops():
    """The C loops built (skipped where no C compiler works: the eager path then packs)."""
    configure(native=True)
    if native.library() is None:
        reset_settings()
        pytest.skip("no C compiler here: the eager path packs")
    yield
    reset_settings()


def _eager(fn):
    configure(native=False)
    try:
        return fn()
    finally:
        configure(native=True)


def _values(n: int, seed: int) -> torch.Tensor:
    """Signed values with a constant run (a group of one value: the smallest step) and zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    x[n // 3 : n // 3 + 300] = 1.5
    x[::11] = 0.0
    return x


# Sizes: none, under a group, a last partial group, several of the draw table's 4096-value rows.
SIZES = (0, 1, 7, 257, 4095, 4097, 20011)


@pytest.mark.parametrize("bits,group", [(4, 256), (2, 100), (8, 256), (4, 4096), (4, 6000)])
def test_quant_pack_and_rebuild_are_the_eager_ones_bit_for_bit(loops, bits, group) -> None:
    strategy = build_strategy("quant", 0.0, bits=bits, group=group, seed=3)
    for n in SIZES:
        x = _values(n, n)
        assert _loops_take(x)
        packed = strategy.pack(x, "linear", 11)
        eager = _eager(lambda: strategy.pack(x, "linear", 11))  # noqa: B023
        for mine, theirs in zip(packed.stored(), eager.stored(), strict=True):
            assert torch.equal(mine, theirs), (bits, group, n)
        rebuilt = strategy.unpack(packed)
        assert torch.equal(rebuilt, _eager(lambda: strategy.unpack(packed)))  # noqa: B023
        # and close to x: one step of its group at most
        step = packed.scales.repeat_interleave(group)[:n]
        assert ((rebuilt - x).abs() <= step * (1 + 1e-6)).all()


def test_threads_split_a_call_into_the_same_bytes(loops, monkeypatch) -> None:
    # Ranges of whole groups (pack, rebuild) and whole flag bytes (ReLU) per thread: each
    # element's draw and code do not depend on the range it falls in.
    monkeypatch.setattr(native, "PARALLEL_MIN", 1000)
    threads = torch.get_num_threads()
    strategy = build_strategy("quant", 0.0, bits=4, group=100, seed=5)
    x = _values(10007, 7)  # 101 groups, the last of 7 values; 3 parts of 34, 34 and 33 groups
    out, grad = x.relu(), _values(10007, 8)
    try:
        torch.set_num_threads(3)
        assert native._parts(x.numel()) == 3
        packed, bits = strategy.pack(x, "linear", 9), relu_and_mask(out, False)[1]
        rebuilt, result = strategy.unpack(packed), relu_mask_grad(grad, bits)
    finally:
        torch.set_num_threads(threads)
    eager = _eager(lambda: strategy.pack(x, "linear", 9))
    for mine, theirs in zip(packed.stored(), eager.stored(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(rebuilt, _eager(lambda: strategy.unpack(packed)))
    assert torch.equal(bits, _eager(lambda: pack_blocked(out)))
    assert torch.equal(result, _eager(lambda: zero_flagged_sliced(grad, bits)))


@pytest.mark.parametrize("n", [5000, 4096, 100])
def test_a_narrower_packs_rebuild_is_the_eager_one(loops, monkeypatch, n) -> None:
    # A bf16 input packs eagerly (the loops take fp32); its rebuild is fp32 values rounded by
    # the cast the eager path makes, a slice at a time: no fp32 copy of the whole map
    monkeypatch.setattr(base, "SLICE", 2048)  # slices of 2048 values: 3, 2 and 1 of them
    made = []  # the values of each call (its argument n)
    rebuild = native.quant_rebuild
    monkeypatch.setattr(native, "quant_rebuild", lambda *a: made.append(a[3]) or rebuild(*a))
    strategy = build_strategy("quant", 0.0, bits=4, seed=1)
    x = _values(n, 2).to(torch.bfloat16)
    packed = strategy.pack(x, "linear", 4)
    rebuilt = strategy.unpack(packed)
    assert rebuilt.dtype == torch.bfloat16
    assert made == [min(2048, n - start) for start in range(0, n, 2048)]
    assert torch.equal(rebuilt, _eager(lambda: strategy.unpack(packed)))
    assert torch.equal(rebuilt, strategy.unpack(_eager(lambda: strategy.pack(x, "linear", 4))))


@pytest.mark.parametrize("n", [0, 1, 8, 9, 1000, 12347])
def test_relu_mask_and_gradient_are_the_eager_ones(loops, n) -> None:
    gen = torch.Generator().manual_seed(n)
    out = torch.randn(n, generator=gen).relu()
    out[::7] = -0.0  # flagged like +0.0
    out[1::13] = float("nan")  # not <= 0: passes
    grad = torch.randn(n, generator=gen)
    grad[2::5] = float("inf")
    grad[3::17] = float("nan")
    # the C loops run both (else this would compare eager with eager)
    assert dispatch.choose("relu_mask", out) == dispatch.choose("relu_grad", grad) == "native"
    bits = relu_and_mask(out, False)[1]
    assert torch.equal(bits, _eager(lambda: pack_blocked(out)))
    result = relu_mask_grad(grad, bits)
    eager = _eager(lambda: zero_flagged_sliced(grad, bits))
    assert torch.equal(result.view(torch.int32), eager.view(torch.int32))  # +0.0, NaN bits
    assert torch.equal(result == 0, (out <= 0) | (grad == 0))


def _cast_values(n: int, seed: int) -> torch.Tensor:
    """Values whose bf16 and fp16 roundings exercise every branch: ties, fp16 subnormals and
    their rounding, values near fp16's largest (65504), exact zeros of both signs."""
    x = _values(n, seed)
    x[::5] *= 1e-6  # fp16 subnormals (below 2**-14 = 6.1e-5)
    x[1::7] = 65519.0  # rounds down to 65504 in fp16
    x[2::13] = 1.0 + 2.0**-11  # a tie for fp16: to even (1.0)
    x[3::17] = 1.0 + 3 * 2.0**-11  # a tie the other way (up)
    x[4::19] = 1.0 + 2.0**-8  # a tie for bf16
    x[5::23] = -0.0
    x[6::29] = 2.0**-24 * 1.5  # half-way between fp16 subnormals 1 and 2 (of 2**-24): to 2
    return x


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group", [(4, 256), (2, 100), (8, 256), (4, 6000)])
def test_a_pack_read_through_a_cast_is_the_eager_pack_of_the_cast(loops, cast, bits, group):
    # autocast's layers pack their fp32 input as the fp16/bf16 values the op computed with:
    # the loops round each value as they read it, the bytes of the eager pack of x.to(cast)
    strategy = build_strategy("quant", 0.0, bits=bits, group=group, seed=3)
    for n in SIZES:
        x = _cast_values(n, n)
        packed = strategy.pack(x, "linear", 11, cast)
        eager = _eager(lambda: strategy.pack(x.to(cast), "linear", 11))  # noqa: B023
        assert packed.meta == eager.meta
        for mine, theirs in zip(packed.stored(), eager.stored(), strict=True):
            assert torch.equal(mine, theirs), (cast, bits, group, n)


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
def test_a_cast_pack_is_written_once_into_its_final_buffers(loops, cast) -> None:
    from tests.core.allocations import allocations

    x = _cast_values(3 * 4096 * 8 + 300, 6)
    strategy = build_strategy("quant", 0.0, bits=4)
    packed, made = allocations(lambda: strategy.pack(x, "linear", 8, cast))
    # no rounded copy of x: what is left is the pack, and nothing larger was made on the way
    assert made.alive == packed.nbytes()
    assert made.peak == packed.nbytes()


def test_a_training_step_is_the_eager_one(loops) -> None:
    # conv -> BatchNorm -> ReLU -> max-pool -> linear, every input 4-bit: the same gradients.
    def step(use: bool) -> list[torch.Tensor]:
        configure(native=use)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 5),
        )  # fmt: skip
        to_dropit(model, strategy="quant", bits=4, norm=True, pool=True, exclude=[])
        set_step(model, 7)
        x = torch.randn(4, 3, 16, 16)
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    for mine, theirs in zip(step(True), step(False), strict=True):
        assert torch.equal(mine, theirs)


def _loops_take(t: torch.Tensor) -> bool:
    """Whether dispatch gives a quant pack of ``t`` to the C loops."""
    return dispatch.choose("quant_pack", t) == "native"


def test_only_contiguous_fp32_cpu_tensors_take_the_loops(loops) -> None:
    x = torch.randn(4, 6)
    assert _loops_take(x)
    assert not _loops_take(x.t())
    assert not _loops_take(x.half())
    configure(kernels="eager")  # pure torch, for comparisons with the kernels
    try:
        assert not _loops_take(x)
    finally:
        reset_settings()


def test_the_environment_turns_the_loops_off(monkeypatch) -> None:
    monkeypatch.setenv("DROPIT_NATIVE", "0")
    reset_settings()
    try:
        assert not current_settings().native
        assert not _loops_take(torch.randn(8))
    finally:
        monkeypatch.setenv("DROPIT_NATIVE", "1")
        reset_settings()
    assert current_settings().native


def test_the_build_is_cached_per_source(loops, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DROPIT_CACHE_DIR", str(tmp_path))
    built = native._build()
    assert built.parent == tmp_path and built.exists()
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary left

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native._build() == built


def test_without_a_compiler_one_warning_and_eager_packs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_failed", False)
    monkeypatch.setenv("DROPIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    configure(native=True)
    strategy = build_strategy("quant", 0.0, bits=4)
    x = _values(3000, 1)
    try:
        with pytest.warns(RuntimeWarning, match="no-such-cc"):
            packed = strategy.pack(x, "linear", 2)
        again = strategy.pack(x, "linear", 2)  # no second warning, no second try
        assert not _loops_take(x)
        configure(native=False)
        eager = strategy.pack(x, "linear", 2)
    finally:
        reset_settings()
    for pack in (packed, again):
        assert all(torch.equal(a, b) for a, b in zip(pack.stored(), eager.stored(), strict=True))


def test_the_thread_pool_is_made_once_and_grown_when_needed(monkeypatch) -> None:
    monkeypatch.setattr(native, "_pool", None)
    monkeypatch.setattr(native, "_pool_key", None)
    done: list[int] = []
    native._run([lambda i=i: done.append(i) for i in range(3)])
    pool = native._pool
    native._run([lambda i=i: done.append(i) for i in range(2)])
    assert native._pool is pool  # fewer workers needed: the same pool
    native._run([lambda i=i: done.append(i) for i in range(4)])
    assert native._pool is not pool and native._pool_key[1] == 3
    native._run([])  # an empty tensor's call list
    assert sorted(done) == [0, 0, 0, 1, 1, 1, 2, 2, 3]
    native._pool.shutdown()

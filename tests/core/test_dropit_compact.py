"""The element-wise packs' Triton kernels (``dropit_core.backends.triton.compact``) against the
eager fixed-capacity path: the same bytes from the pack, the same tensor from the rebuild, either
path rebuilding the other's pack, whatever the block size; ties, overflows, odd and empty sizes.

Run under Triton's interpreter on CPU tensors where there is no GPU (tests/conftest.py sets
TRITON_INTERPRET=1), compiled on a GPU where there is one; tensors stay near 1e4 elements.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dropit_core import (
    build_strategy,
    configure,
    dropped_values,
    reset_settings,
    set_step,
    to_dropit,
)
from dropit_core.formats.bits import compact_into, pack_bits, scatter_kept
from dropit_core.formats.keep_rule import AT_LEAST, DRAW, IMPORTANCE, TIES, KeepRule
from dropit_core.formats.seeds import hash_uniform
from dropit_core.strategies import elementwise as elementwise_mod
from tests.core.kernel_env import DEVICE, FLOATS, NEEDS_KERNELS, same_bits
from tests.core.test_dropit_fixed import SETTINGS, _x, small_slices  # noqa: F401 (a fixture)

triton = pytest.importorskip("triton")
pytestmark = NEEDS_KERNELS

from dropit_core.backends.triton import compact as compact_mod  # noqa: E402  (after the skip)
from dropit_core.backends.triton.compact import compact_pack, scatter_pack  # noqa: E402


@pytest.fixture
def paths(monkeypatch):
    """Fixed-capacity packs on every device, and a switch between the kernels and eager torch."""
    monkeypatch.setattr(elementwise_mod, "fixed_capacity", lambda device: True)
    yield lambda mode: configure(kernels=mode)
    reset_settings()


@pytest.mark.usefixtures("small_slices")  # slices of 1000, mink's radix select from 256 on
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name,options", SETTINGS)
def test_kernel_pack_and_rebuild_are_the_eager_ones_bit_for_bit(paths, dtype, name, options):
    x = _x(seed=1).to(dtype).to(DEVICE)  # half exact zeros, as after a ReLU
    strategy = build_strategy(name, 0.8, **options)
    paths("eager")
    eager = strategy.pack(x, "conv", 5)
    eager_rebuilt = strategy.unpack(eager)
    paths("triton")
    kernel = strategy.pack(x, "conv", 5)
    assert kernel.meta == eager.meta
    for field, a, b in zip(eager._fields[1:], eager[1:], kernel[1:], strict=True):
        assert same_bits(a, b), field
    # Each path rebuilds the other's pack: the same bytes give the same tensor.
    assert same_bits(strategy.unpack(eager), eager_rebuilt)
    paths("eager")
    assert same_bits(strategy.unpack(kernel), eager_rebuilt)


@pytest.mark.parametrize("block", [256, 4096])
@pytest.mark.parametrize("kind", [AT_LEAST, TIES, DRAW, IMPORTANCE])
def test_pack_bytes_do_not_depend_on_the_block_size(kind: int, block: int) -> None:
    x = (_x(seed=2, relu=False).reshape(-1)[:9999] * 2).round().to(DEVICE)  # many ties, odd n
    t = torch.tensor(2.0, device=DEVICE)
    rule = {
        AT_LEAST: KeepRule(AT_LEAST, t),
        TIES: KeepRule(TIES, t, torch.tensor(700, device=DEVICE)),
        DRAW: KeepRule(DRAW, seed=11, gamma=0.7),
        IMPORTANCE: KeepRule(IMPORTANCE, t.float(), seed=11),
    }[kind]
    ref = compact_pack(x, rule, 4000, block=BLOCKS_REF)
    got = compact_pack(x, rule, 4000, block=block)
    for a, b in zip(ref, got, strict=True):
        assert same_bits(a, b)
    assert torch.equal(scatter_pack(got[0], got[1], x.numel(), block=block), _dense(ref, x.numel()))


BLOCKS_REF = 1024


def _dense(packed, n: int) -> torch.Tensor:
    bits, values, _ = packed
    return scatter_kept(bits, values, n, 1 << 20)


def test_the_rules_choose_what_their_strategies_mask() -> None:
    # Each rule keeps what the eager expression keeps; a capacity of n stores them all.
    x = _x(seed=3, relu=False).reshape(-1).to(DEVICE)
    n = x.numel()
    t = torch.tensor(0.9, device=DEVICE)
    u = hash_uniform(17, 0, n, DEVICE)
    cases = [
        (KeepRule(AT_LEAST, t), x.abs() >= t),
        (KeepRule(DRAW, seed=17, gamma=0.8), u >= 0.8),
        (KeepRule(IMPORTANCE, t, seed=17), x.abs() > u * t),
        # a gamma that one draw equals exactly: that element is kept (u >= gamma, not >)
        (KeepRule(DRAW, seed=17, gamma=float(u[123])), u >= u[123]),
    ]
    assert bool(cases[-1][1][123])
    for rule, mask in cases:
        bits, values, chosen = compact_pack(x, rule, n)
        assert torch.equal(bits, pack_bits(mask)) and int(chosen) == int(mask.sum())
        assert torch.equal(values[: int(chosen)], x[mask]) and not values[int(chosen) :].any()


@pytest.mark.parametrize("left", [0, 1, 37, 10_000])
def test_ties_are_kept_in_flat_order_up_to_the_budget(left: int) -> None:
    x = (torch.randn(6001, generator=torch.Generator().manual_seed(4)) * 3).round().to(DEVICE)
    t = torch.tensor(2.0, device=DEVICE)
    bits, values, chosen = compact_pack(
        x, KeepRule(TIES, t, torch.tensor(left, device=DEVICE)), 6001, block=256
    )
    tie = x.abs() == 2
    ties_kept = torch.zeros_like(tie)
    ties_kept[torch.nonzero(tie).squeeze(1)[:left]] = True
    mask = (x.abs() > 2) | ties_kept
    assert torch.equal(bits, pack_bits(mask)) and int(chosen) == int(mask.sum())
    assert torch.equal(values[: int(chosen)], x[mask])


@pytest.mark.parametrize("slots", [0, 1, 300])
def test_an_overflow_stores_the_first_values_as_the_eager_compaction(slots: int) -> None:
    x = _x(seed=5, relu=False).reshape(-1).to(DEVICE)
    t = torch.tensor(0.5, device=DEVICE)
    bits, values, chosen = compact_pack(x, KeepRule(AT_LEAST, t), slots, block=512)
    out = torch.zeros(slots + 1, dtype=x.dtype, device=DEVICE)
    flags, stored, count = compact_into(x, x.abs() >= t, out, torch.zeros((), dtype=torch.int64))
    assert int(chosen) == int(count) > slots and int(stored) == slots
    assert torch.equal(values, out[:slots]) and torch.equal(bits, pack_bits(flags))
    # The rebuild reads back exactly the stored ones.
    dense = scatter_pack(bits, values, x.numel(), block=512)
    assert torch.equal(dense, torch.where(flags, x, torch.zeros_like(x)))


@pytest.mark.parametrize("n", [0, 1, 7, 9, 4097])
def test_odd_and_empty_sizes(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    rule = KeepRule(AT_LEAST, torch.tensor(0.3, device=DEVICE))
    bits, values, chosen = compact_pack(x, rule, n)
    mask = x.abs() >= 0.3
    assert bits.numel() == (n + 7) // 8 and torch.equal(bits, pack_bits(mask))
    assert int(chosen) == int(mask.sum()) and values.numel() == n
    assert torch.equal(scatter_pack(bits, values, n), torch.where(mask, x, torch.zeros_like(x)))


def test_a_drawn_rebuild_zeroes_the_flags_past_its_last_slot() -> None:
    # random stores no mask: its rebuild draws the flags again; those past the stored values
    # (an overflowed pack) rebuild as zeros, as the eager scatter does.
    x = _x(seed=7, relu=False).reshape(-1).to(DEVICE)
    draw = KeepRule(DRAW, seed=5, gamma=0.5)
    _, values, chosen = compact_pack(x, draw, 1000, write_bits=False)
    assert int(chosen) > 1000
    dense = scatter_pack(None, values, x.numel(), draw=draw)
    flags = hash_uniform(5, 0, x.numel(), DEVICE) >= 0.5
    first = torch.zeros_like(flags)
    first[torch.nonzero(flags).squeeze(1)[:1000]] = True
    assert torch.equal(dense, torch.where(first, x, torch.zeros_like(x)))


def test_one_launch_of_each_kernel_per_pack_whatever_the_slices(paths, monkeypatch) -> None:
    # The eager fixed pack loops over slices of SLICE elements; the kernels cover the tensor.
    from dropit_core.formats import packed as base_mod

    monkeypatch.setattr(base_mod, "SLICE", 512)
    launches: list[str] = []
    for name in ("_count_kernel", "_compact_kernel", "_flag_count_kernel", "_scatter_kernel"):
        kernel = getattr(compact_mod, name)
        monkeypatch.setattr(compact_mod, name, _Counting(kernel, name, launches))
    strategy = build_strategy("threshold", 0.8)
    paths("triton")
    strategy.unpack(strategy.pack(_x(seed=8).to(DEVICE), "conv", 1))
    assert sorted(launches) == sorted(
        ["_count_kernel", "_compact_kernel", "_flag_count_kernel", "_scatter_kernel"]
    )


class _Counting:
    """A kernel whose launches are recorded (``kernel[grid](...)``)."""

    def __init__(self, kernel, name: str, launches: list[str]) -> None:
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


def test_bad_arguments_are_named() -> None:
    x = torch.randn(10, device=DEVICE)
    with pytest.raises(ValueError, match="flat float"):
        compact_pack(x.view(2, 5), KeepRule(AT_LEAST, x[0]), 10)
    with pytest.raises(ValueError, match="power of two"):
        compact_pack(x, KeepRule(AT_LEAST, x[0]), 10, block=100)
    with pytest.raises(ValueError, match="one of them"):
        scatter_pack(None, x, 10)
    with pytest.raises(ValueError, match="DRAW"):
        scatter_pack(None, x, 10, draw=KeepRule(AT_LEAST, x[0]))


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("name", ["mink", "threshold", "importance", "random", "parallel_mink"])
def test_converted_layers_train_the_same_on_either_path(paths, name: str) -> None:
    # Conv + ReLU + conv: the packs made in the forward, rebuilt in the backward by each path,
    # give the same weight gradients, and what capacities dropped is read the same way.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).to(DEVICE)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = {}
    for path in ("eager", "triton"):
        model = to_dropit(copy.deepcopy(plain), name, 0.8)
        paths(path)
        set_step(model, 5)
        model(x).square().sum().backward()
        grads[path] = [p.grad for p in model.parameters()]
        assert dropped_values(model) == 0
    for a, b in zip(grads["eager"], grads["triton"], strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------ mink's radix select


@pytest.mark.parametrize("dtype", FLOATS)
def test_radix_histograms_and_kth_value_are_the_eager_ones(paths, dtype) -> None:
    from dropit_core.backends.triton.select import abs_bits_histogram
    from dropit_core.strategies import select as select_mod

    x = (_x(seed=9, relu=False) * 3).to(dtype).to(DEVICE).reshape(-1)  # signs, ties (16-bit)
    x[::3] = 0  # a third zeros, as a ReLU leaves: summed per program, not by atomics
    bits_dtype = select_mod._BITS[dtype]
    shift = 16 if dtype == torch.float32 else 0
    first = abs_bits_histogram(x, shift, block=512)
    zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(first, select_mod._abs_bits_histogram(x, bits_dtype, shift, 0, zero, 1000))
    if dtype == torch.float32:  # the second pass, inside the most populated non-zero bucket
        prefix = (first[1:].argmax() + 1).to(torch.int32).reshape(1)
        second = abs_bits_histogram(x, 0, prefix, block=512)
        eager = select_mod._abs_bits_histogram(x, bits_dtype, 0, 1, prefix, 1000)
        assert torch.equal(second, eager) and int(second.sum()) == int(first[prefix])
    for k in (1, 100, 2000, x.numel() - 1):  # the last: k-th value 0, floored, every tie kept
        paths("triton")
        got = select_mod.radix_kth_largest_abs(x, k, 1000)
        paths("eager")
        want = select_mod.radix_kth_largest_abs(x, k, 1000)
        assert same_bits(got.value, want.value) and int(got.ties) == int(want.ties), k

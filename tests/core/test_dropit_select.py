"""The exact k-th largest magnitude (dropit_core.strategies.select): the CPU's sampled bracket and
the radix select that accelerators run (no host read).

Small tensors with a small sample and slices exercise the same code the R50 layers run (where
n is millions and the sample 64Ki); the reference is the published method's dense kthvalue.
"""

from __future__ import annotations

import math

import pytest
import torch

from dropit_core import build_strategy
from dropit_core.formats import packed as base_mod
from dropit_core.strategies import elementwise as elementwise_mod
from dropit_core.strategies import select as select_mod
from dropit_core.strategies.select import (
    kth_largest_abs,
    largest,
    radix_kth_largest_abs,
    sample_stride,
    select_superset,
)

N = 20_000
SLICE = 3_000  # slices with a tail


@pytest.fixture
def small_sample(monkeypatch) -> None:
    """Bracket from a 512-element sample for tensors above 256 elements."""
    monkeypatch.setattr(select_mod, "DIRECT", 256)
    monkeypatch.setattr(select_mod, "SAMPLE", 512)


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """The published method: kthvalue on a dense fp32 |x| copy, floored at the smallest normal."""
    a = x.reshape(-1).abs().float()
    t = torch.kthvalue(a, a.numel() - k + 1).values
    return t.clamp_min(torch.finfo(x.dtype).tiny).to(x.dtype)


def _tensor(kind: str, dtype: torch.dtype, n: int = N, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "relu":  # post-ReLU: 60% exact zeros
        x = torch.where(torch.rand(n, generator=gen) < 0.6, 0.0, x.abs())
    elif kind == "ties":  # a handful of distinct magnitudes, thousands of ties each
        x = (x * 4).round() / 4
    elif kind == "sparse":  # 95% zeros: the k-th largest at gamma 0.8 is zero
        x = torch.where(torch.rand(n, generator=gen) < 0.95, 0.0, x)
    elif kind == "channels":  # per-"channel" scales spanning 1000x, as in feature maps
        x = x * torch.logspace(-3, 0, 50).repeat_interleave(n // 50)
    return x.to(dtype)


def _kth(x: torch.Tensor, k: int, fixed: bool) -> torch.Tensor | None:
    """The CPU's bracket (None on a miss) or the accelerators' radix select."""
    return kth_largest_abs(x, k, SLICE).value if fixed else select_superset(x, k, SLICE).t


@pytest.mark.usefixtures("small_sample")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "relu", "ties", "sparse", "channels"])
@pytest.mark.parametrize("fixed", [False, True])
def test_both_selections_find_the_exact_kth_value(dtype, kind: str, fixed: bool) -> None:
    x = _tensor(kind, dtype)
    for gamma in (0.5, 0.8, 0.9):
        k = int((1 - gamma) * N)
        t = _kth(x, k, fixed)
        assert t is not None, (kind, gamma)
        assert t.dtype == dtype
        assert torch.equal(t, _reference(x, k)), (kind, gamma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "relu", "ties", "sparse"])
def test_radix_select_is_exact(dtype, kind: str) -> None:
    x = _tensor(kind, dtype, n=5_000, seed=1)
    a = x.abs().float()
    for k in (1, 2, 777, 2_500, 4_999, 5_000):
        value, ties = radix_kth_largest_abs(x, k, 1_234)
        assert torch.equal(value, _reference(x, k)), k
        # The ties the k largest hold: all of them where the floor (exact zeros) was reached.
        if float(value) > float(torch.kthvalue(a, a.numel() - k + 1).values):
            assert int(ties) == k
        else:
            assert int(ties) == k - int((a > value.float()).sum()) >= 1, k


def _adversarial(n: int = N) -> torch.Tensor:
    """Every element the strided sample reads is 100x larger than the rest."""
    x = _tensor("normal", torch.float32, n, seed=2)
    stride = sample_stride(n, select_mod.SAMPLE)
    x[::stride] *= 100.0
    return x


@pytest.mark.usefixtures("small_sample")
def test_a_misleading_sample_is_reported_not_hidden() -> None:
    # The CPU's bracket reports the miss (min-k then runs the radix select); the accelerators'
    # radix select has nothing to miss.
    x = _adversarial()
    k = int(0.2 * N)
    assert select_superset(x, k, SLICE).t is None
    assert torch.equal(radix_kth_largest_abs(x, k, SLICE).value, _reference(x, k))
    assert torch.equal(kth_largest_abs(x, k, SLICE).value, _reference(x, k))


def _keep_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    t = _reference(x, k)
    return torch.where(x.abs() >= t, x, torch.zeros_like(x))


@pytest.mark.usefixtures("small_sample")
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("adversarial", [False, True])
def test_mink_pack_is_the_exact_topk_on_both_paths(monkeypatch, fixed, adversarial) -> None:
    monkeypatch.setattr(base_mod, "SLICE", 2_048)
    monkeypatch.setattr(elementwise_mod, "fixed_capacity", lambda device: fixed)
    x = _adversarial() if adversarial else _tensor("relu", torch.float32, seed=4)
    x = x.view(4, 5, 25, 40)
    strategy = build_strategy("mink", 0.8)
    packed = strategy.pack(x, "conv")
    k = int((1 - 0.8) * N)  # as strategies.py counts k
    expected = _keep_topk(x, k)
    assert torch.equal(strategy.unpack(packed), expected)
    assert int((expected != 0).sum()) == k  # no ties here: both paths store exactly k values
    assert packed.nbytes() == math.ceil(N / 8) + 4 * k


def test_channel_random_draws_its_permutation_on_the_input_device(monkeypatch) -> None:
    strategy = build_strategy("channel_random", 0.5, seed=7)
    x = _tensor("normal", torch.float32, n=2 * 6 * 16).view(2, 6, 4, 4)
    seen = []
    real = torch.randperm
    monkeypatch.setattr(
        torch,
        "randperm",
        lambda *a, **kw: seen.append((kw["device"], kw["generator"].device)) or real(*a, **kw),
    )
    strategy.pack(x, "conv")
    assert seen == [(x.device, x.device)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_largest_is_the_sorted_order_statistic_with_ties(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(0, 50, (1001,), generator=gen).to(dtype)  # many ties
    ordered = torch.sort(values, descending=True).values
    ranks = [0, 1, 500, 999, 1000]
    for r, got in zip(ranks, largest(values, ranks), strict=True):
        assert got.dtype == dtype and got.shape == ()
        assert got == ordered[r], r

"""The exact k-th largest magnitude (dropit_core.select) and the sync-free pack used on GPUs.

Small tensors with a small sample and slices exercise the same code the R50 layers run (where
n is millions and the sample 64Ki); the reference is the published method's dense kthvalue.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dropit_core import base as base_mod
from dropit_core import build_strategy
from dropit_core import elementwise as elementwise_mod
from dropit_core import select as select_mod
from dropit_core.select import kth_largest_abs, largest, radix_kth_largest_abs, sample_stride

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


@pytest.mark.usefixtures("small_sample")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "relu", "ties", "sparse", "channels"])
@pytest.mark.parametrize("static", [False, True])
def test_bracket_finds_the_exact_kth_value(dtype, kind: str, static: bool) -> None:
    x = _tensor(kind, dtype)
    for gamma in (0.5, 0.8, 0.9):
        k = int((1 - gamma) * N)
        t, ok = kth_largest_abs(x, k, SLICE, static)
        assert bool(ok), (kind, gamma)
        assert t.dtype == dtype
        assert torch.equal(t, _reference(x, k)), (kind, gamma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "relu", "ties", "sparse"])
def test_radix_select_is_exact(dtype, kind: str) -> None:
    x = _tensor(kind, dtype, n=5_000, seed=1)
    for k in (1, 2, 777, 2_500, 4_999, 5_000):
        assert torch.equal(radix_kth_largest_abs(x, k, 1_234), _reference(x, k)), k


def _adversarial(n: int = N) -> torch.Tensor:
    """Every element the strided sample reads is 100x larger than the rest."""
    x = _tensor("normal", torch.float32, n, seed=2)
    stride = sample_stride(n, select_mod.SAMPLE)
    x[::stride] *= 100.0
    return x


@pytest.mark.usefixtures("small_sample")
@pytest.mark.parametrize("static", [False, True])
def test_a_misleading_sample_is_reported_not_hidden(static: bool) -> None:
    x = _adversarial()
    k = int(0.2 * N)
    _, ok = kth_largest_abs(x, k, SLICE, static)
    assert not bool(ok)
    assert torch.equal(radix_kth_largest_abs(x, k, SLICE), _reference(x, k))


def test_the_cuda_gather_reports_a_slice_over_its_buffer(monkeypatch, small_sample) -> None:
    # One slice holds nearly all the elements near the k-th value: its fixed buffer overflows.
    monkeypatch.setattr(select_mod, "CAP_FACTOR", 1.0)
    monkeypatch.setattr(select_mod, "CAP_FLOOR", 0)
    x = _tensor("normal", torch.float32, seed=3)
    k = int(0.2 * N)
    ref = _reference(x, k)
    x[:SLICE] = ref * (1 + torch.linspace(-1e-3, 1e-3, SLICE))
    t, ok = kth_largest_abs(x, k, SLICE, static=False)
    assert bool(ok) and torch.equal(t, _reference(x, k))
    _, ok = kth_largest_abs(x, k, SLICE, static=True)
    assert not bool(ok)


def _keep_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    t = _reference(x, k)
    return torch.where(x.abs() >= t, x, torch.zeros_like(x))


@pytest.mark.usefixtures("small_sample")
@pytest.mark.parametrize("counts_first", [False, True])
@pytest.mark.parametrize("adversarial", [False, True])
def test_mink_pack_is_the_exact_topk_on_both_paths(monkeypatch, counts_first, adversarial) -> None:
    monkeypatch.setattr(base_mod, "SLICE", 2_048)
    monkeypatch.setattr(elementwise_mod, "counts_first", lambda device: counts_first)
    x = _adversarial() if adversarial else _tensor("relu", torch.float32, seed=4)
    x = x.view(4, 5, 25, 40)
    strategy = build_strategy("mink", 0.8)
    packed = strategy.pack(x, "conv")
    expected = _keep_topk(x, int((1 - 0.8) * N))  # as strategies.py counts k
    assert torch.equal(strategy.unpack(packed), expected)
    kept = int((expected != 0).sum())
    assert packed.nbytes() == math.ceil(N / 8) + 4 * kept


@pytest.mark.parametrize(
    "name,options",
    [
        ("mink", {}),
        ("mink", {"values": "int8"}),
        ("threshold", {}),
        ("parallel_mink", {"chunk": 100}),
        ("random", {"seed": 3}),
        ("importance", {}),
        ("importance", {"positions": "sparse_bits", "values": "int8"}),
    ],
)
def test_counts_first_pack_equals_the_one_pass_pack(monkeypatch, name, options) -> None:
    monkeypatch.setattr(base_mod, "SLICE", 1_000)
    x = _tensor("normal", torch.float32, n=6_400, seed=5).view(2, 8, 20, 20)
    one_pass = build_strategy(name, 0.8, **options)
    packed_a = one_pass.pack(x, "conv")
    monkeypatch.setattr(elementwise_mod, "counts_first", lambda device: True)
    counts_first = build_strategy(name, 0.8, **options)
    packed_b = counts_first.pack(x, "conv")
    assert packed_a.meta.counts == packed_b.meta.counts  # kept count per slice
    for field, a in packed_a._asdict().items():  # the same tensors in the same fields
        b = getattr(packed_b, field)
        assert (a is None) == (b is None), field
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field
    assert torch.equal(one_pass.unpack(packed_a), counts_first.unpack(packed_b))


class _SyncOps(TorchDispatchMode):
    """Records the aten ops that make a CUDA host wait for the device (or learn a shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "equal"):
            self.syncs.append(name)
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.syncs.append("index with a bool mask")
        return func(*args, **(kwargs or {}))


@pytest.mark.usefixtures("small_sample")
@pytest.mark.parametrize(
    "name,options",
    [("mink", {}), ("threshold", {}), ("parallel_mink", {}), ("random", {}), ("importance", {})],
)
def test_counts_first_pack_reads_the_device_once_per_layer(monkeypatch, name, options) -> None:
    monkeypatch.setattr(base_mod, "SLICE", 2_048)
    monkeypatch.setattr(elementwise_mod, "counts_first", lambda device: True)
    reads = []
    real = elementwise_mod.host_ints
    monkeypatch.setattr(elementwise_mod, "host_ints", lambda v: reads.append(len(v)) or real(v))
    strategy = build_strategy(name, 0.8, **options)
    x = _tensor("relu", torch.float32, seed=6).view(4, 5, 25, 40)
    with _SyncOps() as mode:
        strategy.pack(x, "conv", key=12345)
    # random's per-pack seed is a host integer mixed from its key: no device read either.
    assert mode.syncs == []
    n_slices = math.ceil(N / strategy.slice_len())
    assert reads == [n_slices + (1 if name == "mink" else 0)]  # counts (+ mink's bracket flag)


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

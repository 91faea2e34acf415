"""Element-wise packs sized from the shape (what a GPU runs): no host read, the same rebuild as the
CPU's packs sized to their count, the bytes of the stated capacities, and overflow handled.

On the CPU the fixed-capacity path is forced (``elementwise.fixed_capacity``); host reads are
caught by a dispatch mode (ops that make a CUDA host wait for the device or learn a
data-dependent shape) and a function mode (Python reading a tensor: ``bool``, ``int``,
``tolist``, ``torch.tensor`` from host data).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dropit_core import build_strategy, dropped_values, set_step, to_dropit
from dropit_core.formats import packed as base_mod
from dropit_core.formats.bits import unpack_bits
from dropit_core.strategies import elementwise as elementwise_mod
from dropit_core.strategies import select as select_mod
from dropit_core.strategies.elementwise import CAPACITY_SLACK, CAPACITY_SPREAD, expected_capacity

ELEMENTWISE = ("mink", "parallel_mink", "threshold", "importance", "random")
SETTINGS = [
    ("mink", {}),
    ("mink", {"values": "int8", "int8_chunk": 64}),
    ("mink", {"positions": "sparse_bits"}),
    ("parallel_mink", {"chunk": 100}),
    ("threshold", {}),
    ("threshold", {"positions": "sparse_bits", "values": "int4", "int4_chunk": 16}),
    ("importance", {}),
    ("importance", {"values": "bf16", "rescale": "norm"}),
    ("random", {"seed": 3}),
    ("random", {"scale": True}),
]


@pytest.fixture
def small_slices(monkeypatch) -> None:
    """Slices of 1000 elements and mink's radix select from 256 elements on: the code paths of
    the R50 layers (millions of elements) on tensors of a few thousand."""
    monkeypatch.setattr(base_mod, "SLICE", 1_000)
    monkeypatch.setattr(select_mod, "DIRECT", 256)


def _fixed(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(elementwise_mod, "fixed_capacity", lambda device: on)


def _x(shape=(2, 8, 20, 20), seed: int = 0, relu: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    return x.relu_() if relu else x  # half exact zeros, as after a ReLU


class _HostReads(TorchDispatchMode):
    """Records the aten ops that make a CUDA host wait for the device or learn a shape from it."""

    SYNCING = {
        "nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "equal", "bincount",
        "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "masked_scatter",
        "histc", "_assert_async",
    }  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.SYNCING:
            self.reads.append(name)
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.reads.append(f"{name} with a bool mask")
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.reads.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


class _PythonReads(TorchFunctionMode):
    """Records Python reading a tensor's value, or making a tensor from host data (on CUDA a
    blocking copy)."""

    READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "tensor", "cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _host_reads(run) -> list[str]:
    with _PythonReads() as python, _HostReads() as dispatch:
        run()
    return python.reads + dispatch.reads


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("name,options", SETTINGS)
def test_fixed_pack_and_rebuild_never_read_the_device(monkeypatch, name, options) -> None:
    _fixed(monkeypatch, True)
    strategy = build_strategy(name, 0.8, **options)
    x = _x()
    strategy.unpack(strategy.pack(x, "conv", 11))  # warm-up: the byte tables are built once
    packed = []
    assert _host_reads(lambda: packed.append(strategy.pack(x, "conv", 12))) == []
    assert _host_reads(lambda: strategy.unpack(packed[0])) == []


def test_the_checks_catch_what_the_cpu_path_reads(monkeypatch, small_slices) -> None:
    # The same checks flag the CPU's pack, which reads each slice's count on the host.
    _fixed(monkeypatch, False)
    strategy = build_strategy("threshold", 0.8)
    reads = _host_reads(lambda: strategy.pack(_x(), "conv"))
    assert "nonzero" in reads and "__int__" in reads


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("name,options", SETTINGS)
def test_fixed_pack_rebuilds_as_the_tight_pack(monkeypatch, name, options) -> None:
    x = _x(seed=1)
    n = x.numel()
    strategy = build_strategy(name, 0.8, **options)
    _fixed(monkeypatch, False)
    tight = strategy.pack(x, "conv", 5)
    _fixed(monkeypatch, True)
    fixed = strategy.pack(x, "conv", 5)
    slots = strategy.capacity(n)
    kept = tight.meta.kept
    assert fixed.meta.kept == slots >= kept and tight.dropped is None
    if strategy.exact_capacity:
        assert fixed.dropped is None and slots == kept  # no ties in these values
    else:
        assert fixed.dropped.dtype == torch.int64 and int(fixed.dropped) == 0
    assert fixed.meta.shape == tight.meta.shape and fixed.meta.dtype == tight.meta.dtype
    if options.get("values", "same") == "same":  # the kept values, then zeros
        assert torch.equal(fixed.values[:kept], tight.values)
        assert not fixed.values[kept:].any()
    for field in ("bits", "threshold", "norm"):
        a, b = getattr(tight, field), getattr(fixed, field)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), field
    if tight.mask_bytes is not None:
        assert torch.equal(fixed.mask_bytes[: tight.mask_bytes.numel()], tight.mask_bytes)
    # Either pack rebuilds with the same code, to the same tensor.
    assert torch.equal(strategy.unpack(fixed), strategy.unpack(tight))


def _value_bytes(slots: int, options: dict) -> int:
    fmt = options.get("values", "same")
    if fmt == "same":
        return 4 * slots
    if fmt in ("fp16", "bf16"):
        return 2 * slots
    chunk = options.get(f"{fmt}_chunk")
    codes = slots if fmt == "int8" else (slots + 1) // 2
    return codes + 4 * math.ceil(slots / chunk)


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("name,options", SETTINGS)
def test_fixed_pack_bytes_are_its_capacity(monkeypatch, name, options) -> None:
    _fixed(monkeypatch, True)
    x = _x(seed=2)
    n = x.numel()
    strategy = build_strategy(name, 0.8, **options)
    packed = strategy.pack(x, "conv", 6)
    slots = strategy.capacity(n)
    mask = 0 if name == "random" else math.ceil(n / 8)
    if options.get("positions") == "sparse_bits":  # 1 bit per mask byte + as many bytes as fit
        mask = math.ceil(mask / 8) + min(mask, slots)
    expected = mask + _value_bytes(slots, options)
    expected += 8 * (packed.dropped is not None) + 4 * (name == "importance")
    expected += 4 * (options.get("rescale") == "norm")
    assert packed.nbytes() == expected


def test_capacities_at_an_r50_layer_size() -> None:
    # The figures cache_bytes states for a 4Mi-element input at gamma 0.8 (sample 64Ki: a prime
    # stride of 67, 62602 values read).
    n, p = 4 << 20, 1.0 - 0.8  # as the strategies compute it
    caps = {name: build_strategy(name, 0.8).capacity(n) for name in ELEMENTWISE}
    assert caps["mink"] == int(p * n) == 838860
    assert caps["parallel_mink"] == 256 * int(p * 16384) == 838656  # per chunk of 16Ki
    assert caps["random"] == math.ceil(p * n + CAPACITY_SPREAD * math.sqrt(n * p * (1 - p))) + 64
    quantile = CAPACITY_SPREAD * n * math.sqrt(p * (1 - p) / 62602)
    assert caps["threshold"] == math.ceil(p * n + quantile) + CAPACITY_SLACK
    assert caps["threshold"] < caps["importance"] < caps["threshold"] + 500  # + its draws
    per_value = {name: cap / n for name, cap in caps.items()}
    assert per_value["random"] == pytest.approx(0.2016, abs=1e-4)
    assert per_value["threshold"] == pytest.approx(0.2128, abs=1e-4)
    assert per_value["importance"] == pytest.approx(0.2128, abs=1e-4)
    assert expected_capacity(1000, 1.0) == expected_capacity(1000, 0.5, sample=1) == 1000


# ------------------------------------------------------------------------------------- overflow


def _chosen(strategy, x: torch.Tensor, key: int) -> torch.Tensor:
    """The elements a strategy chooses (its CPU pack, sized to the count, keeps them all)."""
    return strategy.unpack(strategy.pack(x, "conv", key)) != 0


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize(
    "name,options", [s for s in SETTINGS if s[0] in ("threshold", "importance", "random")]
)
def test_an_overflow_keeps_the_first_values_consistently_and_counts_the_rest(
    monkeypatch, name, options
) -> None:
    x = _x(seed=3, relu=False)  # no zeros: every chosen element rebuilds as non-zero
    strategy = build_strategy(name, 0.8, **options)
    chosen = _chosen(strategy, x, 7).reshape(-1)
    count = int(chosen.sum())
    slots = count // 3  # far too few: the first slices fill them
    _fixed(monkeypatch, True)
    full = strategy.unpack(strategy.pack(x, "conv", 7))  # its own capacity holds them all
    monkeypatch.setattr(strategy, "capacity", lambda n: slots)
    packed = strategy.pack(x, "conv", 7)
    assert packed.meta.kept == slots and int(packed.dropped) == count - slots
    # The first `slots` chosen elements in flat order rebuild as without the overflow, the
    # others as zeros; the mask marks exactly those stored.
    first = torch.zeros_like(chosen)
    first[torch.nonzero(chosen).squeeze(1)[:slots]] = True
    expected = torch.where(first.view(x.shape), full, torch.zeros_like(full))
    rebuilt = strategy.unpack(packed)
    if options.get("rescale") == "norm":  # scaled to the input's norm: a different factor
        expected *= rebuilt.norm() / expected.norm()
    if options.get("values", "same").startswith("int"):
        # Chunk scales differ where the stored values end: within half a step of the largest.
        assert not rebuilt.reshape(-1)[~first].any()
        torch.testing.assert_close(rebuilt, expected, rtol=0, atol=float(x.max()) / 14 * 1.01)
    else:
        torch.testing.assert_close(rebuilt, expected, rtol=1e-6, atol=0)
    if packed.bits is not None and packed.mask_bytes is None:
        assert torch.equal(unpack_bits(packed.bits, x.numel()), first)


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,options", [("mink", {}), ("parallel_mink", {"chunk": 100})])
def test_fixed_min_k_stores_k_values_taking_ties_in_flat_order(monkeypatch, dtype, name, options):
    # Many values equal the k-th magnitude: the CPU keeps them all; a fixed pack keeps every
    # value above it, then the ties in flat order until k (per chunk for parallel_mink).
    x = (_x(seed=4) * 4).round().to(dtype)
    n = x.numel()
    chunk = options.get("chunk", n)
    k = int((1 - 0.8) * chunk)
    strategy = build_strategy(name, 0.8, **options)
    tight = strategy.unpack(strategy.pack(x, "conv"))
    assert int((tight != 0).sum()) > strategy.capacity(n)
    _fixed(monkeypatch, True)
    packed = strategy.pack(x, "conv")
    rebuilt = strategy.unpack(packed)
    assert packed.meta.kept == strategy.capacity(n) and packed.dropped is None
    assert torch.equal(rebuilt[rebuilt != 0], x[rebuilt != 0])
    for a, kept in zip(
        x.abs().float().reshape(-1, chunk), (rebuilt != 0).reshape(-1, chunk), strict=True
    ):
        kth = a.topk(k).values.min()
        assert int(kept.sum()) == k and bool(kept[a > kth].all())
        ties = torch.nonzero(a == kth).squeeze(1)
        assert torch.equal(torch.nonzero(kept & (a == kth)).squeeze(1), ties[: k - (a > kth).sum()])


# ------------------------------------------------------------------------------ converted layers


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 4, 1),
    )  # fmt: skip


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    # the same draws at every step, in every model: set_step(model, 0) before (outside a count
    # of host reads: it makes the step's draw keys on the host, before the forward)
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_a_converted_stack_steps_without_host_reads_and_as_on_the_cpu(monkeypatch, name) -> None:
    x = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(5))
    tight = to_dropit(_stack(), name, 0.8)
    fixed = to_dropit(_stack(), name, 0.8)
    set_step(tight, 0)
    expected = _step(tight, x)
    _fixed(monkeypatch, True)
    set_step(fixed, 0)
    _step(fixed, x)  # warm-up
    grads = {}
    set_step(fixed, 0)
    assert _host_reads(lambda: grads.update(_step(fixed, x))) == []
    for key, grad in expected.items():
        assert torch.equal(grads[key], grad), key
    assert dropped_values(fixed) == 0 and dropped_values(tight) == 0


@pytest.mark.usefixtures("small_slices")
def test_dropped_values_sums_the_overflows_of_every_layer(monkeypatch) -> None:
    model = to_dropit(_stack(), "threshold", 0.8)
    strategy = next(m.dropit_cache.strategy for m in model.modules() if hasattr(m, "dropit_cache"))
    monkeypatch.setattr(strategy, "capacity", lambda n: 10)
    _fixed(monkeypatch, True)
    x = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(6))
    set_step(model, 0)
    _step(model, x)
    packs = []
    real = strategy.pack
    monkeypatch.setattr(strategy, "pack", lambda *a: packs.append(real(*a)) or packs[-1])
    set_step(model, 0)
    _step(model, x)
    assert len(packs) == 3
    assert dropped_values(model) == 2 * sum(int(p.dropped) for p in packs) > 0

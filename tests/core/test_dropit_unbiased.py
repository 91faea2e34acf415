"""The unbiased estimators (importance, random with scale, quant): their packs, their bytes as the
registry states them, the layer contracts, and the mean over many draws of the rebuilt input and
of the weight gradient against the exact ones; min-k and unscaled random, by contrast, are biased.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dropit_core import REGISTRY, build_strategy, from_dropit, set_step, to_dropit
from dropit_core.formats import packed as base_mod
from dropit_core.strategies.importance import water_level
from tests.core.contracts import contract_layers

UNBIASED = [
    ("importance", {}),
    ("random", {"scale": True}),
    ("quant", {"bits": 2}),
    ("quant", {"bits": 4}),
]
IDS = ["importance", "random-scale", "quant2", "quant4"]
INPUT_DRAWS = 256
GRAD_DRAWS = 128  # a forward and backward each: half the draws, for time


def _activation(shape=(2, 6, 12, 12), seed: int = 0) -> torch.Tensor:
    """A conv input like a ReLU output: 55% exact zeros, channels of scales 0.1 to 3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).abs()
    x = torch.where(torch.rand(shape, generator=gen) < 0.55, 0.0, x)
    return x * torch.logspace(-1, 0.5, shape[1]).view(1, -1, 1, 1)


def _signed(shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- mean over many draws


def _error_in_noise_units(samples: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(T, sd) for N draws of an estimate of ``exact``.

    T = ||mean - exact||^2 / (tr C / N), with C the draws' own covariance: for an unbiased
    estimator the mean of N independent draws misses by tr C / N in expectation, so T is about 1;
    its spread (the mean being near Gaussian) is sd = sqrt(2 tr C^2) / tr C. A bias b adds
    ||b||^2 / (tr C / N) to T: it shows once ||b|| exceeds the standard error sqrt(tr C / N),
    1/16 of one draw's noise norm at N = 256, 1/11 at N = 128.
    """
    n = samples.shape[0]
    draws = samples.reshape(n, -1).double()
    mean = draws.mean(0)
    centered = draws - mean
    gram = centered @ centered.T / (n - 1)  # N x N: the same non-zero spectrum as C
    trace = float(gram.trace())
    if trace == 0.0:  # no spread at all: any miss is infinitely many standard errors
        return (math.inf if not torch.equal(mean, exact.reshape(-1).double()) else 0.0), 0.0
    t = float(((mean - exact.reshape(-1).double()) ** 2).sum()) / (trace / n)
    return t, math.sqrt(2.0 * float((gram**2).sum())) / trace


def _input_draws(name: str, options: dict, x: torch.Tensor, draws: int = INPUT_DRAWS):
    strategy = build_strategy(name, 0.8, **options)
    return torch.stack([strategy.unpack(strategy.pack(x, "conv", key)) for key in range(draws)])


def _weight_grad_draws(
    name: str, options: dict, draws: int = GRAD_DRAWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact weight gradient of a conv on _activation(), ``draws`` DropIT ones, one per
    step); computed once per setting (the contrast test reuses importance's)."""
    return _cached_weight_grad_draws(name, tuple(sorted(options.items())), draws)


@functools.cache
def _cached_weight_grad_draws(name: str, options: tuple, draws: int):
    options = dict(options)
    torch.manual_seed(0)
    plain = nn.Conv2d(6, 5, 3, padding=1)
    holder = nn.Sequential(copy.deepcopy(plain))
    to_dropit(holder, strategy=name, gamma=0.8, **options)
    x = _activation()
    g = _signed((2, 5, 12, 12), seed=9)
    plain(x).backward(g)
    grads = []
    for step in range(draws):
        set_step(holder, step)
        holder.zero_grad(set_to_none=True)
        holder(x).backward(g)
        grads.append(holder[0].weight.grad.clone())
    return plain.weight.grad, torch.stack(grads)


# Tolerance: T <= 1 + 4 sd, four standard deviations of T above its expectation for an unbiased
# estimator (sd is 0.1-0.27 here). Measured: input T 0.87-1.0 (256 draws), weight-gradient T
# 0.77-0.94 (128 draws);
# unscaled random gives about 1000, min-k infinity (no spread, a fixed miss).
# One draw's weight-gradient cosine / norm ratio on this input (reported, not asserted):
# importance 0.98 / 1.03, random-scale 0.42 / 1.98, quant2 0.93 / 1.03, quant4 0.996 / 1.00.
@pytest.mark.parametrize("name,options", UNBIASED, ids=IDS)
def test_mean_rebuilt_input_over_many_draws_is_the_input(name: str, options) -> None:
    x = _activation()
    draws = _input_draws(name, options, x)
    t, sd = _error_in_noise_units(draws, x)
    assert sd > 0 and t <= 1.0 + 4.0 * sd, (t, sd)
    # and the draws really vary: a mean of N draws is closer than one draw
    one = float((draws[0] - x).norm())
    assert float((draws.mean(0) - x).norm()) < one / 4


@pytest.mark.parametrize("name,options", UNBIASED, ids=IDS)
def test_mean_weight_gradient_over_many_steps_is_the_exact_one(name: str, options) -> None:
    exact, grads = _weight_grad_draws(name, options)
    t, sd = _error_in_noise_units(grads, exact)
    assert sd > 0 and t <= 1.0 + 4.0 * sd, (t, sd)


def test_mink_and_unscaled_random_stay_biased() -> None:
    # The contrast: the same criterion fails for them. min-k draws nothing, so its mean is its
    # one rebuild (no spread: T is infinite), and averaging never shrinks its miss: 9% of the
    # input's norm and 8% of the weight gradient's (measured). Measured in the noise of
    # importance's mean at the same gamma and number of draws, that miss is far outside the
    # tolerance (T about 40 and 17 here, against 1 + 4 sd < 2). Unscaled random keeps 1 - gamma
    # of the input on average: a bias of gamma, ten times and more outside its own tolerance.
    x = _activation()
    mink = _input_draws("mink", {}, x, draws=2)
    assert torch.equal(mink[0], mink[1])
    assert _error_in_noise_units(mink, x)[0] == math.inf
    importance = _input_draws("importance", {}, x)
    _, sd = _error_in_noise_units(importance, x)
    assert _in_noise_of(importance, mink[0], x) > 5 * (1.0 + 4.0 * sd)
    exact, grads = _weight_grad_draws("mink", {}, draws=2)
    assert torch.equal(grads[0], grads[1])
    exact_i, importance_grads = _weight_grad_draws("importance", {})
    assert torch.equal(exact_i, exact)
    _, sd = _error_in_noise_units(importance_grads, exact)
    assert _in_noise_of(importance_grads, grads[0], exact) > 5 * (1.0 + 4.0 * sd)
    t, sd = _error_in_noise_units(_input_draws("random", {}, x, draws=32), x)
    assert t > 10 * (1.0 + 4.0 * sd)
    exact, grads = _weight_grad_draws("random", {}, draws=32)
    t, sd = _error_in_noise_units(grads, exact)
    assert t > 10 * (1.0 + 4.0 * sd)


def _in_noise_of(reference: torch.Tensor, estimate: torch.Tensor, exact: torch.Tensor) -> float:
    """||estimate - exact||^2 in units of the reference draws' tr C / N (their T's scale)."""
    n = reference.shape[0]
    noise = float(reference.reshape(n, -1).double().var(0).sum()) / n
    return float(((estimate - exact).double() ** 2).sum()) / noise


# --------------------------------------------------------------------------- bytes and packs


def _value_bytes(values: str, kept: int, elem: int = 4, chunk: int = 16) -> int:
    if values == "same":
        return elem * kept
    if values in ("fp16", "bf16"):
        return 2 * kept
    codes = kept if values == "int8" else math.ceil(kept / 2)
    return codes + 4 * math.ceil(kept / chunk)


@pytest.mark.parametrize("values", ["same", "bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_importance_bytes_are_what_the_registry_states(values: str, dtype) -> None:
    assert REGISTRY.get("importance").cache_bytes == "n/8 + kept v + 4; GPU: n/8 + cap v + 12"
    x = _activation().to(dtype)
    n = x.numel()
    options = {"values": values, "int8_chunk": 16, "int4_chunk": 16}
    packed = build_strategy("importance", 0.8, **options).pack(x, "conv", 3)
    kept = packed.meta.kept
    assert 0 < kept < n
    elem = x.element_size()
    assert packed.nbytes() == math.ceil(n / 8) + _value_bytes(values, kept, elem) + 4
    assert packed.threshold.dtype == torch.float32 and packed.threshold.numel() == 1


def test_unbiased_random_bytes_are_random_bytes() -> None:
    assert REGISTRY.get("random").cache_bytes.startswith("kept v (mask rebuilt from a seed)")
    x = _activation()
    plain = build_strategy("random", 0.8).pack(x, "conv", 4)
    scaled = build_strategy("random", 0.8, scale=True).pack(x, "conv", 4)
    assert torch.equal(plain.values, scaled.values)  # the scale is applied when rebuilding
    assert scaled.nbytes() == 4 * scaled.meta.kept


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [256, 100, 7])
@pytest.mark.parametrize("shape", [(2, 6, 12, 12), (5, 13)])
@pytest.mark.parametrize("slice_len", [1 << 22, 64])
def test_quant_bytes_are_what_the_registry_states(monkeypatch, bits, group, shape, slice_len):
    assert REGISTRY.get("quant").cache_bytes == "n bits/8 + 8 n/group"
    monkeypatch.setattr(base_mod, "SLICE", slice_len)  # 64: many slices, tails included
    x = _signed(shape)
    n = x.numel()
    strategy = build_strategy("quant", 0.8, bits=bits, group=group)
    packed = strategy.pack(x, "linear" if len(shape) == 2 else "conv", 2)
    assert packed.nbytes() == math.ceil(n * bits / 8) + 8 * math.ceil(n / group)
    assert packed.values.dtype == torch.uint8
    out = strategy.unpack(packed)
    _check_quant_grid(x, out, bits, group)


def _check_quant_grid(x: torch.Tensor, out: torch.Tensor, bits: int, group: int) -> None:
    """Each rebuilt value is one of the two grid points of its group around the input value."""
    levels = (1 << bits) - 1
    flat, got = x.reshape(-1).double(), out.reshape(-1).double()
    for start in range(0, flat.numel(), group):
        xs, ys = flat[start : start + group], got[start : start + group]
        lo, step = xs.min(), (xs.max() - xs.min()) / levels
        if step == 0:
            assert torch.equal(ys, xs)
            continue
        codes = (ys - lo) / step
        assert torch.allclose(codes, codes.round(), atol=1e-3)
        assert codes.round().min() >= 0 and codes.round().max() <= levels
        assert bool(((ys - xs).abs() <= step * (1 + 1e-4) + 1e-6).all())


def test_quant_keeps_zeros_and_constant_groups_exact() -> None:
    # A non-negative group's minimum is 0 and its zeros code 0: ReLU zeros rebuild as zeros.
    x = _activation()
    x[0, 0] = 0.75  # a whole plane of one value: constant groups
    strategy = build_strategy("quant", 0.8, bits=2, group=16)
    out = strategy.unpack(strategy.pack(x, "conv", 1))
    assert torch.equal(out[x == 0], x[x == 0])
    assert torch.equal(out[0, 0], x[0, 0])
    _check_quant_grid(x, out, 2, 16)


def test_quant_of_an_empty_input() -> None:
    strategy = build_strategy("quant", 0.8)
    packed = strategy.pack(torch.zeros(0, 3, 4, 4), "conv")
    assert packed.nbytes() == 0 and strategy.unpack(packed).shape == (0, 3, 4, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_importance_pack_keeps_the_large_drops_zeros_and_rebuilds_at_tau(dtype) -> None:
    x = (_signed((2, 6, 12, 12)) * F.relu(_signed((2, 6, 12, 12), seed=2))).to(dtype)
    strategy = build_strategy("importance", 0.8)
    packed = strategy.pack(x, "conv", 11)
    tau = packed.threshold.to(dtype)
    out = strategy.unpack(packed)
    kept = out != 0
    assert not bool(kept[x == 0].any())  # zeros are never kept
    assert bool(kept[x.abs() >= tau].all())  # p = 1 at or above tau
    expected = torch.where(kept, torch.copysign(torch.maximum(x.abs(), tau), x), 0.0)
    assert torch.equal(out, expected.to(dtype))
    # The n elements fit one sample (stride 1): tau solves sum(min(1, |x|/tau)) = (1-gamma) n,
    # up to rounding tau to the input's dtype.
    p = (x.float().abs() / tau.float()).clamp(max=1.0)
    assert abs(float(p.sum()) / x.numel() - 0.2) < (0.01 if dtype == torch.bfloat16 else 1e-5)


def _water_level_by_bisection(a: torch.Tensor, budget: float) -> float:
    lo, hi = 0.0, float(a.max()) * a.numel() + 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if float((a.double() / mid).clamp(max=1.0).sum()) > budget:
            lo = mid
        else:
            hi = mid
    return hi


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5, 0.99])
def test_water_level_solves_the_keep_budget(seed: int, fraction: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(500, generator=gen).abs() ** 3  # heavy-tailed: several saturate
    a[:100] = 0.0
    a[100:120] = a[120]  # ties
    budget = fraction * 400  # at most the non-zeros
    tau = float(water_level(a, budget))
    assert tau == pytest.approx(_water_level_by_bisection(a, budget), rel=1e-5)
    assert float((a.double() / tau).clamp(max=1.0).sum()) == pytest.approx(budget, rel=1e-5)


def test_water_level_edge_cases() -> None:
    assert float(water_level(torch.zeros(10), 2.0)) == 0.0  # nothing to keep: tau 0 (floored)
    a = torch.tensor([3.0, 1.0, 2.0])
    assert float(water_level(a, 3.0)) == 1.0  # keep all: tau is the smallest
    assert float(water_level(a, 1.0)) == 6.0  # one in expectation: tau = the sum


# ------------------------------------------------------------------------- layer contracts


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("name,options", UNBIASED, ids=IDS)
def test_forward_input_and_bias_gradients_exact_weight_gradient_from_the_rebuild(
    name: str, options, index: int
) -> None:
    plain, shape = contract_layers()[index]
    holder = nn.Sequential(copy.deepcopy(plain))
    to_dropit(holder, strategy=name, gamma=0.8, **options)
    drop = holder[0]
    strategy = drop.dropit_cache.strategy
    packs = []
    real = strategy.pack
    strategy.pack = lambda x, layout, key=0: packs.append(real(x, layout, key)) or packs[-1]
    x = _signed(shape, seed=6).requires_grad_(True)
    xd = x.detach().clone().requires_grad_(True)
    set_step(holder, 3)
    out_p, out_d = plain(x), drop(xd)
    assert torch.equal(out_d, out_p)
    g = _signed(out_p.shape, seed=7)
    out_p.backward(g)
    out_d.backward(g)
    torch.testing.assert_close(xd.grad, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(drop.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-6)
    (packed,) = packs
    x_hat = strategy.unpack(packed)
    w = plain.weight.detach().clone().requires_grad_(True)
    if index == 2:
        F.linear(x_hat, w).backward(g)
    else:
        conv = F.conv2d if index == 0 else F.conv_transpose2d
        kwargs = {"padding": 1} if index == 0 else {"stride": 2}
        conv(x_hat, w, None, **kwargs).backward(g)
    torch.testing.assert_close(drop.weight.grad, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,options", UNBIASED, ids=IDS)
def test_no_strategy_code_in_eval_or_no_grad_and_state_dict_unchanged(name, options) -> None:
    plain, shape = contract_layers()[0]
    holder = nn.Sequential(copy.deepcopy(plain))
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    to_dropit(holder, strategy=name, gamma=0.8, **options)
    assert list(holder.state_dict()) == list(before)
    for key, value in holder.state_dict().items():
        assert torch.equal(value, before[key])
    strategy = holder[0].dropit_cache.strategy

    def boom(*args, **kwargs):
        raise AssertionError("strategy code ran")

    strategy.pack = strategy.unpack = boom
    x = _signed(shape, seed=8).requires_grad_(True)
    with torch.no_grad():
        assert torch.equal(holder(x), plain(x))
    holder.eval()
    assert torch.equal(holder(x), plain(x))
    from_dropit(holder)
    assert type(holder[0]) is nn.Conv2d


@pytest.mark.parametrize("values", ["fp16", "int8"])
def test_importance_with_narrow_values(values: str) -> None:
    # The kept values are stored narrow; the rebuild is sign(v) max(|v|, tau) of the decoded v.
    x = _activation()
    exact = build_strategy("importance", 0.8)
    narrow = build_strategy("importance", 0.8, values=values, int8_chunk=64)
    a, b = exact.unpack(exact.pack(x, "conv", 5)), narrow.unpack(narrow.pack(x, "conv", 5))
    assert torch.equal(a != 0, b != 0)  # the same draw: the same kept set
    assert float((a - b).abs().max()) <= float(x.abs().max()) / 127  # a quantisation step


@pytest.mark.parametrize("seed", range(4))
def test_importance_with_int4_values_keeps_every_kept_sign(seed: int) -> None:
    # A kept value below tau rebuilds as +-tau; stored as the raw value, int4 would round a
    # small one to the sign-less code 0 and rebuild it as +tau. Signs of the input, everywhere.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, generator=gen) * torch.rand(4096, generator=gen).pow(4) * 3
    strategy = build_strategy("importance", 0.5, values="int4", int4_chunk=8, seed=seed)
    rebuilt = strategy.unpack(strategy.pack(x, "linear", 5))
    kept = rebuilt != 0
    assert int(kept.sum()) > 1000
    assert torch.equal(torch.sign(rebuilt[kept]), torch.sign(x[kept]))

"""DropIT layers: forward bit-identical to the plain layer, exact input/bias gradients, and weight
gradients equal to the plain backward applied to the explicitly dropped input."""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dropit_core import is_dropit, set_step, to_dropit
from dropit_core.layers import conv as ops
from dropit_core.layers.cache import InputCache
from dropit_core.layers.relu import MaskedReLUFunction
from tests.core.contracts import contract_layers

RTOL, ATOL = 1e-5, 1e-6


def _converted(module: nn.Module, strategy: str = "mink", gamma: float = 0.8, **options):
    """A DropIT copy of ``module`` (converted through the public to_dropit)."""
    holder = nn.Sequential(copy.deepcopy(module))
    to_dropit(holder, strategy=strategy, gamma=gamma, **options)
    return holder[0]


def _keep_topk(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """The published Min-K drop, built here: keep the int((1-gamma)*n) largest |x|.

    Elements tied with the k-th largest are kept too (padded copies of a value tie with it).
    """
    x = x.detach()
    k = int((1.0 - gamma) * x.numel())
    kth = torch.topk(x.abs().reshape(-1), k).values.min()
    return torch.where((x.abs() >= kth) & (x != 0), x, torch.zeros_like(x))


def _input(shape, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).requires_grad_(True)


def _weight_grad(fn, x_hat: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor):
    w = weight.detach().clone().requires_grad_(True)
    fn(x_hat, w).backward(grad_out)
    return w.grad


def _run(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor | None = None, **kw):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x, **kw)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(99))
    out.backward(grad_out)
    return out.detach(), x.grad, grad_out


# Each case: conv kwargs and how the input the convolution sees is formed (pad mode and amounts).
CONV_CASES = {
    "stride2_pad1": dict(kernel_size=3, stride=2, padding=1),
    "dilation2": dict(kernel_size=3, padding=2, dilation=2),
    "groups2": dict(kernel_size=3, padding=1, groups=2),
    "no_bias": dict(kernel_size=3, padding=1, bias=False),
    "reflect": dict(kernel_size=3, padding=1, padding_mode="reflect"),
    "circular": dict(kernel_size=3, stride=2, padding=(1, 2), padding_mode="circular"),
    "same_even_kernel": dict(kernel_size=4, padding="same"),
    "same_dilated": dict(kernel_size=3, padding="same", dilation=2),
}


def _conv_reference_input(conv: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The tensor the convolution multiplies (after any explicit padding) and the F.conv2d args."""
    args = dict(stride=conv.stride, dilation=conv.dilation, groups=conv.groups)
    if conv.padding_mode != "zeros":
        ph, pw = conv.padding
        return F.pad(x, (pw, pw, ph, ph), mode=conv.padding_mode), dict(args, padding=0)
    if conv.padding == "same":
        pads = []
        for k, d in zip(reversed(conv.kernel_size), reversed(conv.dilation), strict=True):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads), dict(args, padding=0)
    return x, dict(args, padding=conv.padding)


# torch warns that an even kernel with padding="same" needs a padded copy of the input.
@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize("gamma", [0.0, 0.8])
def test_conv2d_forward_and_gradients(case: str, gamma: float) -> None:
    torch.manual_seed(0)
    plain = nn.Conv2d(4, 6, **CONV_CASES[case])
    drop = _converted(plain, gamma=gamma)
    x = _input((2, 4, 9, 8), seed=1)
    out_p, gx_p, g = _run(plain, x)
    out_d, gx_d, _ = _run(drop, x, g)
    assert torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=RTOL, atol=ATOL)
    if plain.bias is not None:
        torch.testing.assert_close(drop.bias.grad, plain.bias.grad, rtol=RTOL, atol=ATOL)
    x_eff, args = _conv_reference_input(plain, x.detach())
    x_hat = _keep_topk(x_eff, gamma)
    ref_gw = _weight_grad(lambda i, w: F.conv2d(i, w, None, **args), x_hat, plain.weight, g)
    torch.testing.assert_close(drop.weight.grad, ref_gw, rtol=RTOL, atol=ATOL)
    if gamma == 0.0:
        torch.testing.assert_close(drop.weight.grad, plain.weight.grad, rtol=RTOL, atol=ATOL)
    else:
        # Dropping really changes the weight gradient.
        assert not torch.allclose(drop.weight.grad, plain.weight.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("with_output_size", [False, True])
@pytest.mark.parametrize("gamma", [0.0, 0.8])
def test_conv_transpose2d_forward_and_gradients(with_output_size: bool, gamma: float) -> None:
    torch.manual_seed(1)
    if with_output_size:
        plain = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2)
        kw = {"output_size": [12, 10]}  # needs an output padding of 1 in both dims
    else:
        plain = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1)
        kw = {}
    drop = _converted(plain, gamma=gamma)
    x = _input((2, 4, 6, 5), seed=2)
    out_p, gx_p, g = _run(plain, x, **kw)
    out_d, gx_d, _ = _run(drop, x, g, **kw)
    assert out_p.shape == (2, 6, 12, 10)
    assert torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(drop.bias.grad, plain.bias.grad, rtol=RTOL, atol=ATOL)

    def tconv(i, w):
        return F.conv_transpose2d(
            i, w, None, stride=2, padding=1, output_padding=1, groups=plain.groups
        )

    ref_gw = _weight_grad(tconv, _keep_topk(x, gamma), plain.weight, g)
    torch.testing.assert_close(drop.weight.grad, ref_gw, rtol=RTOL, atol=ATOL)
    if gamma == 0.0:
        torch.testing.assert_close(drop.weight.grad, plain.weight.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("gamma", [0.0, 0.8])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_3d_input(gamma: float, bias: bool) -> None:
    torch.manual_seed(2)
    plain = nn.Linear(8, 6, bias=bias)
    drop = _converted(plain, gamma=gamma)
    x = _input((2, 5, 8), seed=3)
    out_p, gx_p, g = _run(plain, x)
    out_d, gx_d, _ = _run(drop, x, g)
    assert out_d.shape == (2, 5, 6)
    assert torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=RTOL, atol=ATOL)
    if bias:
        torch.testing.assert_close(drop.bias.grad, plain.bias.grad, rtol=RTOL, atol=ATOL)
    ref_gw = _weight_grad(lambda i, w: F.linear(i, w), _keep_topk(x, gamma), plain.weight, g)
    torch.testing.assert_close(drop.weight.grad, ref_gw, rtol=RTOL, atol=ATOL)
    if gamma == 0.0:
        torch.testing.assert_close(drop.weight.grad, plain.weight.grad, rtol=RTOL, atol=ATOL)


def test_weight_grad_with_other_strategy_block_mink() -> None:
    # The Function must use whatever the strategy rebuilds: block_mink keeps whole 2x2 blocks.
    torch.manual_seed(3)
    plain = nn.Conv2d(2, 3, 3, padding=1)
    drop = _converted(plain, strategy="block_mink", gamma=0.5, block=2)
    x = _input((1, 2, 4, 4), seed=4)
    _, _, g = _run(plain, x)
    _run(drop, x, g)
    xd = x.detach()
    blocks = xd.view(1, 2, 2, 2, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(8, 4)
    keep = torch.topk(blocks.norm(dim=1), 4).indices
    kept_blocks = torch.zeros_like(blocks)
    kept_blocks[keep] = blocks[keep]
    x_hat = kept_blocks.view(1, 2, 2, 2, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(1, 2, 4, 4)
    assert int((x_hat != 0).sum()) == 16
    ref = _weight_grad(lambda i, w: F.conv2d(i, w, None, padding=1), x_hat, plain.weight, g)
    torch.testing.assert_close(drop.weight.grad, ref, rtol=RTOL, atol=ATOL)


class Fork(nn.Module):
    """One input feeding two convs, like a ResNet block input feeding conv1 and the downsample."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_shared_input_is_packed_once_and_both_grads_are_right(monkeypatch) -> None:
    # Like a ResNet block input feeding conv1 and the downsample conv.
    torch.manual_seed(4)

    plain = Fork()
    drop = copy.deepcopy(plain)
    to_dropit(drop, gamma=0.8)
    strategy = drop.a.dropit_cache.strategy
    assert drop.b.dropit_cache is drop.a.dropit_cache
    calls = []
    real_pack = strategy.pack
    monkeypatch.setattr(strategy, "pack", lambda x, *a: calls.append(1) or real_pack(x, *a))
    x = _input((2, 3, 6, 6), seed=5)
    out_p, gx_p, g = _run(plain, x)
    out_d, gx_d, _ = _run(drop, x, g)
    assert len(calls) == 1
    assert torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=RTOL, atol=ATOL)
    x_hat = _keep_topk(x, 0.8)
    for name, pad in (("a", 1), ("b", 0)):
        w = getattr(plain, name).weight
        ref = _weight_grad(lambda i, w_: F.conv2d(i, w_, None, padding=pad), x_hat, w, g)  # noqa: B023
        torch.testing.assert_close(getattr(drop, name).weight.grad, ref, rtol=RTOL, atol=ATOL)


def _forbid_packing(monkeypatch, layer: nn.Module) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("strategy code ran")

    strategy = layer.dropit_cache.strategy
    monkeypatch.setattr(strategy, "pack", boom)
    monkeypatch.setattr(strategy, "unpack", boom)


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_no_grad_runs_no_strategy_code(monkeypatch, index: int, mode: str) -> None:
    plain, shape = contract_layers()[index]
    drop = _converted(plain)
    getattr(drop, mode)()
    _forbid_packing(monkeypatch, drop)
    x = _input(shape, seed=6)
    with torch.no_grad():
        assert torch.equal(drop(x), plain(x))
    with torch.inference_mode():
        assert torch.equal(drop(x), plain(x))


@pytest.mark.parametrize("index", [0, 2])
def test_eval_mode_runs_no_strategy_code(monkeypatch, index: int) -> None:
    plain, shape = contract_layers()[index]
    drop = _converted(plain)
    drop.eval()
    _forbid_packing(monkeypatch, drop)
    x = _input(shape, seed=7)
    assert torch.equal(drop(x), plain(x))


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("bias_trainable", [False, True])
def test_frozen_weight_packs_nothing_and_input_grad_is_exact(
    monkeypatch, index: int, bias_trainable: bool
) -> None:
    plain, shape = contract_layers()[index]
    plain.weight.requires_grad_(False)
    plain.bias.requires_grad_(bias_trainable)
    drop = _converted(plain)
    _forbid_packing(monkeypatch, drop)
    x = _input(shape, seed=8)
    out_p, gx_p, g = _run(plain, x)
    out_d, gx_d, _ = _run(drop, x, g)
    assert torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=RTOL, atol=ATOL)
    assert drop.weight.grad is None
    if bias_trainable:
        torch.testing.assert_close(drop.bias.grad, plain.bias.grad, rtol=RTOL, atol=ATOL)
    else:
        assert drop.bias.grad is None


def _saved_bytes(fn) -> tuple[object, int, int]:
    """Run fn under saved_tensors_hooks; (result, bytes of unique storages, number saved)."""
    seen: dict[int, int] = {}
    count = [0]

    def pack(t):
        count[0] += 1
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values()), count[0]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 8), (13,)])
def test_masked_relu_module(inplace: bool, shape) -> None:
    holder = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=inplace))
    to_dropit(holder)
    relu = holder[1]
    leaf = _input(shape, seed=9)
    leaf_p = leaf.detach().clone().requires_grad_(True)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(10))

    out, nbytes, count = _saved_bytes(lambda: relu(leaf * 1.0))
    ref = torch.relu(leaf_p * 1.0)
    assert torch.equal(out, ref)
    assert count == 1
    assert nbytes == math.ceil(math.prod(shape) / 8)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(leaf.grad, leaf_p.grad)


def test_masked_relu_function_saves_one_bit_per_element() -> None:
    x = _input((4, 25), seed=11)
    out, nbytes, _ = _saved_bytes(lambda: MaskedReLUFunction.apply(x, False))
    assert nbytes == math.ceil(100 / 8) == 13
    plain_out, plain_bytes, _ = _saved_bytes(lambda: torch.relu(x))
    assert plain_bytes == 100 * 4
    g = torch.randn(4, 25, generator=torch.Generator().manual_seed(12))
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_plain,) = torch.autograd.grad(plain_out, x, g)
    assert torch.equal(gx, gx_plain)
    assert torch.equal(gx, torch.where(x > 0, g, torch.zeros_like(g)))


@pytest.mark.parametrize("index", [0, 2])
def test_autocast_cpu_bf16(index: int) -> None:
    plain, shape = contract_layers()[index]
    drop = _converted(plain)
    x = _input(shape, seed=13)
    xp = x.detach().clone().requires_grad_(True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out_d = drop(x)
        out_p = plain(xp)
    assert out_d.dtype == torch.bfloat16
    assert torch.equal(out_d, out_p)
    g = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(14))
    out_d.float().backward(g)
    out_p.float().backward(g)
    assert x.grad.dtype == torch.float32
    assert drop.weight.grad.dtype == torch.float32
    assert drop.bias.grad.dtype == torch.float32
    for t in (x.grad, drop.weight.grad, drop.bias.grad):
        assert bool(torch.isfinite(t).all())
    # Input and bias gradients do not depend on the cache: equal to plain autocast backward.
    torch.testing.assert_close(x.grad, xp.grad)
    torch.testing.assert_close(drop.bias.grad, plain.bias.grad)


def test_autocast_cache_holds_bf16_values() -> None:
    torch.manual_seed(6)
    drop = _converted(nn.Linear(16, 4), gamma=0.5)
    x = _input((8, 16), seed=15)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        _, nbytes, _ = _saved_bytes(lambda: drop(x))
    # Saved: the bf16 weight copy (16*4*2), the bit mask (128/8) and 64 kept bf16 values.
    assert nbytes == 16 * 4 * 2 + 128 // 8 + 64 * 2


class _Fork(nn.Module):
    """One activation feeding two convs, like a ResNet block input (conv1 and downsample)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        h = x * 2.0  # a non-leaf activation, as inside a network
        return self.a(h) + self.b(h)


def test_shared_input_is_packed_once_under_autocast(monkeypatch) -> None:
    torch.manual_seed(7)
    plain = _Fork()
    drop = copy.deepcopy(plain)
    to_dropit(drop, gamma=0.8)
    strategy = drop.a.dropit_cache.strategy
    packed = []
    real_pack = strategy.pack
    monkeypatch.setattr(strategy, "pack", lambda x, *a: packed.append(x) or real_pack(x, *a))
    x = _input((2, 3, 6, 6), seed=16)
    xp = x.detach().clone().requires_grad_(True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out_d = drop(x)
        out_p = plain(xp)
    assert len(packed) == 1 and packed[0].dtype == torch.bfloat16
    assert torch.equal(out_d, out_p)
    g = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(17))
    out_d.float().backward(g)
    out_p.float().backward(g)
    torch.testing.assert_close(x.grad, xp.grad)
    # Each weight gradient is the bf16 conv backward on the dropped bf16 input.
    h = (x.detach() * 2.0).to(torch.bfloat16)
    x_hat = _keep_topk(h.float(), 0.8).to(torch.bfloat16)
    for name, pad in (("a", 1), ("b", 0)):
        w = getattr(plain, name).weight.detach().to(torch.bfloat16).requires_grad_(True)
        F.conv2d(x_hat, w, None, padding=pad).float().backward(g)
        torch.testing.assert_close(getattr(drop, name).weight.grad, w.grad.float())


def test_pack_shared_through_the_cast_source_follows_its_version() -> None:
    from dropit_core.strategies.catalog import build_strategy

    cache = InputCache(build_strategy("mink", 0.5))
    h = torch.randn(4, 5)
    first = cache.pack(h.to(torch.bfloat16), "linear", h)

    def same(a, b) -> bool:
        return all(x is y for x, y in zip(a[1:], b[1:], strict=True))

    assert same(cache.pack(h.to(torch.bfloat16), "linear", h), first)
    assert not same(cache.pack(h.to(torch.float16), "linear", h), first)  # another dtype
    h.mul_(2.0)
    second = cache.pack(h.to(torch.bfloat16), "linear", h)
    assert not same(second, first)
    assert torch.equal(
        cache.unpack(second), _keep_topk(h.to(torch.bfloat16).float(), 0.5).bfloat16()
    )


def test_a_layer_called_twice_under_autocast_saves_one_weight_copy() -> None:
    # Like the RPN head, run once per FPN level: autocast's own cache casts the weight once.
    torch.manual_seed(8)
    plain = nn.Conv2d(3, 4, 3, padding=1)
    drop = _converted(plain, gamma=0.5)
    x1, x2 = _input((1, 3, 6, 6), seed=18), _input((1, 3, 6, 6), seed=19)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        (out1, out2), nbytes, _ = _saved_bytes(lambda: (drop(x1 * 1.0), drop(x2 * 1.0)))
        ref1, ref2 = plain(x1 * 1.0), plain(x2 * 1.0)
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)
    # Saved: one bf16 weight copy (4*3*9*2 bytes) and, per input, 14 bytes of mask and 54 kept
    # bf16 values.
    assert nbytes == 4 * 3 * 9 * 2 + 2 * (14 + 54 * 2)
    (out1.float().sum() + out2.float().sum()).backward()
    assert drop.weight.grad.dtype == torch.float32 and drop.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("strategy", ["mink", "threshold", "channel_mink", "pool"])
def test_rescale_norm_scales_the_weight_gradient_by_the_norm_ratio(strategy: str) -> None:
    # rescale="norm": the rebuilt input gets x's L2 norm, so the weight gradient is the plain
    # DropIT one times ||x|| / ||x_hat||; output, input and bias gradients stay exact.
    torch.manual_seed(6)
    plain = nn.Conv2d(4, 5, 3, padding=1)
    drop = _converted(plain, strategy=strategy, gamma=0.8)
    comp = _converted(plain, strategy=strategy, gamma=0.8, rescale="norm")
    assert comp.dropit_cache.strategy.describe().endswith("rescale=norm)")
    x = _input((2, 4, 8, 8), seed=7)
    out_p, gx_p, g = _run(plain, x)
    _run(drop, x, g)
    out_c, gx_c, _ = _run(comp, x, g)
    assert torch.equal(out_c, out_p)
    torch.testing.assert_close(gx_c, gx_p, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(comp.bias.grad, plain.bias.grad, rtol=RTOL, atol=ATOL)
    plain_drop = drop.dropit_cache.strategy  # the same selection, without the rescale
    ratio = x.detach().norm() / plain_drop.unpack(plain_drop.pack(x.detach(), "conv")).norm()
    assert ratio > 1.05  # dropping 80% of the elements really shrinks the norm
    torch.testing.assert_close(comp.weight.grad, drop.weight.grad * ratio, rtol=1e-4, atol=1e-5)


def test_rescale_norm_with_a_shared_pack_and_an_all_zero_input() -> None:
    # Two layers share one pack (and its norm); a zero input rebuilds as zeros, never NaN.
    torch.manual_seed(8)
    plain = Fork()
    comp = copy.deepcopy(plain)
    to_dropit(comp, gamma=0.8, rescale="norm")
    x = _input((2, 3, 6, 6), seed=9)
    _, _, g = _run(plain, x)
    _run(comp, x, g)
    x_hat = _keep_topk(x, 0.8)
    x_hat = x_hat * (x.detach().norm() / x_hat.norm())
    for name, pad in (("a", 1), ("b", 0)):
        w = getattr(plain, name).weight
        ref = _weight_grad(lambda i, w_: F.conv2d(i, w_, None, padding=pad), x_hat, w, g)  # noqa: B023
        torch.testing.assert_close(getattr(comp, name).weight.grad, ref, rtol=1e-4, atol=1e-6)
    _run(comp, torch.zeros(2, 3, 6, 6), g)
    assert torch.isfinite(comp.a.weight.grad).all() and torch.isfinite(comp.b.weight.grad).all()


def test_rescale_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"rescale='l2' is invalid: allowed \('none', 'norm'\)"):
        to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3)), rescale="l2")


CONVS = [  # (in, out, kernel, stride, padding, dilation, groups)
    (4, 6, 3, 1, 1, 1, 1),
    (4, 6, 3, 2, 1, 1, 1),  # odd sizes: the transposed conv's output padding
    (4, 6, 1, 2, 0, 1, 1),
    (4, 6, 3, 1, 2, 2, 2),
]


def _split_at(monkeypatch, nbytes: int) -> None:
    """Inputs of ``nbytes`` or more take the conv's autograd Function and its split backward,
    whose weight gradient takes chunks of at most ``nbytes`` (at least an image)."""
    monkeypatch.setattr(ops, "SPLIT_BYTES", nbytes)
    monkeypatch.setitem(ops.CHUNK_BYTES, "cpu", nbytes)


class _CountCalls(TorchDispatchMode):
    """Counts the aten ops a block runs, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_calls(images: int, image: tuple[int, ...]) -> collections.Counter[str]:
    torch.manual_seed(0)
    conv = to_dropit(nn.Sequential(nn.Conv2d(image[0], 8, 3, padding=1)), "quant", bits=4)
    set_step(conv, 1)
    out = conv(torch.randn(images, *image))  # the weight's gradient alone
    with _CountCalls() as mode:
        out.sum().backward()
    return mode.counts


def test_a_split_layers_backward_makes_as_many_calls_at_2_and_8_images_within_its_budget(
    monkeypatch,
) -> None:
    """The weight gradient's chunks are chosen by bytes, not by image: while the batch's map
    fits CHUNK_BYTES a DropIT conv's backward runs the same ops at 2 images as at 8 (host time
    on every layer of a GPU step that does not grow with the batch); a map past the budget is
    chunked, each chunk as many images as the budget holds."""
    image = (16, 32, 32)  # 64 KiB of fp32 per image
    per_image = 4 * 16 * 32 * 32
    monkeypatch.setattr(ops, "SPLIT_BYTES", 1)  # every input takes the split backward
    monkeypatch.setitem(ops.CHUNK_BYTES, "cpu", 8 * per_image)
    at_2, at_8 = _backward_calls(2, image), _backward_calls(8, image)
    assert at_2 == at_8
    assert at_8["convolution_backward.default"] == 1
    monkeypatch.setitem(ops.CHUNK_BYTES, "cpu", 3 * per_image)  # 8 images: chunks of 3, 3, 2
    assert _backward_calls(2, image)["convolution_backward.default"] == 1
    assert _backward_calls(8, image)["convolution_backward.default"] == 3
    cpu = torch.device("cpu")
    assert ops.images_per_chunk(8, per_image, cpu) == 3
    assert ops.images_per_chunk(2, per_image, cpu) == 2
    assert ops.images_per_chunk(8, 10 * per_image, cpu) == 1  # an image past the budget: alone


def test_the_chunk_budget_is_the_devices() -> None:
    """64 MiB on an accelerator (launches per layer), 8 MiB on the CPU (as before: the
    committed CPU runs keep their sums); an 800 px P2 map in fp16 is 27.9 MB an image."""
    image = 256 * 200 * 272 * 2  # bytes of one image's P2-level map (800 x 1088, fp16)
    assert ops.images_per_chunk(8, image, torch.device("cuda")) == 2
    assert ops.images_per_chunk(8, image, torch.device("cpu")) == 1
    assert ops.images_per_chunk(2, 2 << 20, torch.device("cuda")) == 2  # a small map: one call


@pytest.mark.parametrize("conv_args", CONVS)
@pytest.mark.parametrize("bias", [True, False])
def test_a_large_conv_makes_its_gradients_in_turn_with_the_joint_calls_values(
    monkeypatch, bias: bool, conv_args: tuple
) -> None:
    """Above ops.SPLIT_BYTES the weight gradient is made first, image chunk by image chunk, and
    the rebuilt input freed before the input gradient: the joint call's gradients bit for bit
    when one chunk holds the batch; by single images the input gradient still is, the weight's
    and bias's are its sum over images, equal up to float rounding."""
    x = torch.randn(2, 4, 9, 7)
    grads = []
    # never split; split with the batch in one chunk; one image per chunk
    for split in (1 << 62, x.numel() * 4, 1):
        _split_at(monkeypatch, split)
        torch.manual_seed(0)
        c_in, c_out, k, stride, pad, dil, groups = conv_args
        plain = nn.Conv2d(c_in, c_out, k, stride, pad, dil, groups, bias=bias)
        conv = to_dropit(nn.Sequential(plain), strategy="quant", bits=4)
        xi = x.clone().requires_grad_()
        set_step(conv, 3)
        out = conv(xi)
        out.square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in conv.parameters())])
    joint, whole, by_image = grads
    assert len(joint) == 2 + bias
    assert all(map(torch.equal, joint, whole))
    assert torch.equal(joint[0], by_image[0])
    for a, b in zip(joint[1:], by_image[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, torch.zeros_like(a))


@pytest.mark.parametrize("shape,parts", [((4, 8, 16, 16), 4), ((2, 4, 9, 7), 0)])
def test_a_large_conv_rebuilds_its_input_an_image_chunk_at_a_time(monkeypatch, shape, parts):
    """Split by single images, a quant pack is rebuilt an image at a time where an image is
    whole groups (8 channels of 16x16: 8 groups of 256), else once for the batch from the first
    image that does not start on a group (4 channels of 9x7: the second); the gradients are
    those of one whole rebuild, bit for bit."""
    _split_at(monkeypatch, 1)
    calls = []
    part, whole = InputCache.unpack_part, InputCache.unpack
    monkeypatch.setattr(
        InputCache, "unpack_part", lambda s, p, a, b: calls.append(b - a) or part(s, p, a, b)
    )
    monkeypatch.setattr(InputCache, "unpack", lambda s, p: calls.append("whole") or whole(s, p))
    x = torch.randn(shape)
    grads = []
    for by_part in (True, False):
        if not by_part:  # every strategy as one that cannot rebuild a part
            monkeypatch.setattr(InputCache, "unpack_part", lambda *a: None)
        torch.manual_seed(0)
        conv = to_dropit(nn.Sequential(nn.Conv2d(shape[1], 6, 3, padding=1)), "quant", bits=4)
        xi = x.clone().requires_grad_()
        set_step(conv, 3)
        conv(xi).square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in conv.parameters())])
        if by_part:
            per_image = x[0].numel()
            # unaligned: the first image starts on a group, the second does not
            assert calls == ([per_image] * parts if parts else [per_image, per_image, "whole"])
    assert all(map(torch.equal, *grads))


@pytest.mark.parametrize("conv_args", CONVS)
def test_a_conv_with_a_frozen_weight_gives_the_plain_input_gradient(conv_args: tuple) -> None:
    """Only the input gradient: made without the input (a transposed conv on the CPU), the
    plain layer's bit for bit."""
    c_in, c_out, k, stride, pad, dil, groups = conv_args
    torch.manual_seed(0)
    plain = nn.Conv2d(c_in, c_out, k, stride, pad, dil, groups, bias=False).requires_grad_(False)
    x = torch.randn(2, 4, 9, 7)
    grads = []
    converted = to_dropit(nn.Sequential(copy.deepcopy(plain)), strategy="quant")
    assert is_dropit(converted[0])
    for model in (plain, converted):
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.square().sum().backward()
        grads.append(xi.grad)
    assert type(out.grad_fn).__name__ == "DropITConvFunctionBackward"
    assert torch.equal(*grads)

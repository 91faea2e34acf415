"""Inputs at the edges of what the plain layers take: empty batches, unbatched maps, one value
per channel, a second backward, and a compress_saved block around converted layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropit_core import (
    compress_saved,
    dropit_record,
    lean_frozen_batchnorm,
    register_strategy,
    to_dropit,
)
from dropit_core.formats.packed import DOUBLE_BACKWARD


def _pair(plain: nn.Module, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(plain, converted copy), a bare layer wrapped first: to_dropit converts what is inside."""
    import copy

    if not list(plain.children()):
        plain = nn.Sequential(plain)
    return plain, to_dropit(copy.deepcopy(plain), strict=False, **kwargs)


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("plain", "shape", "kwargs"),
    [
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (0, 3, 6, 6), {}),
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4)), (0, 3, 6, 6), {}),
        (nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)), (0, 5), {}),
    ],
)
@pytest.mark.parametrize("strategy", ["quant", "channel_mink"])
def test_an_empty_batch_trains_as_the_plain_layers_do(plain, shape, kwargs, strategy) -> None:
    # A mask head with no positive RoI gets an empty batch: the plain layers take it.
    torch.manual_seed(0)
    norm = strategy == "quant"  # the DropIT norms need a strategy that keeps every element
    plain, drop = _pair(plain, strategy=strategy, gamma=0.5, norm=norm)
    x = torch.randn(shape, requires_grad=True)
    assert drop(x).shape == plain(x).shape
    for name, grad in _grads(drop, x).items():
        assert grad is not None and not grad.any(), name  # no element: zero gradients


@pytest.mark.parametrize("layer", [nn.Conv2d(3, 4, 3, padding=1), nn.ConvTranspose2d(3, 4, 2)])
def test_an_unbatched_map_trains_as_the_plain_layer_does(layer) -> None:
    plain, drop = _pair(layer, strategy="mink", gamma=0.0)  # gamma 0 keeps all: exact
    x = torch.randn(3, 5, 5, requires_grad=True)
    out = drop(x)
    torch.testing.assert_close(out, plain(x))
    assert out.shape == plain(x).shape and out.dim() == 3
    for name, grad in _grads(drop, x).items():
        torch.testing.assert_close(grad, _grads(plain, x)[name])


@pytest.mark.parametrize("conv", [True, False], ids=["conv", "linear"])
@pytest.mark.parametrize("frozen_bias", [False, True])
def test_a_parametrized_weight_trains_as_the_plain_layer_does(conv, frozen_bias) -> None:
    # A converted layer reads its weight from _parameters (host time); a weight parametrized
    # after the conversion is not there, and a bias set to None is: both must still be what the
    # layer computes with.
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, 3, padding=1) if conv else nn.Linear(5, 4)
    if frozen_bias:
        layer.bias = None
    plain, drop = _pair(layer, strategy="mink", gamma=0.0)  # gamma 0 keeps all: exact
    weight_norm(plain[0]), weight_norm(drop[0])
    x = torch.randn((2, 3, 5, 5) if conv else (2, 5), requires_grad=True)
    torch.testing.assert_close(drop(x), plain(x))
    grads = _grads(drop, x)
    assert {n for n, g in grads.items() if g is not None} == set(dict(plain.named_parameters()))
    for name, grad in _grads(plain, x).items():
        torch.testing.assert_close(grads[name], grad)


def test_batch_norm_with_one_value_per_channel_is_refused_as_the_plain_layer_does() -> None:
    plain, drop = _pair(nn.BatchNorm2d(4), strategy="quant", norm=True)
    x = torch.randn(1, 4, 1, 1, requires_grad=True)
    for model in (plain, drop):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            model(x)
    assert not drop[0].running_var.isnan().any()


@pytest.mark.parametrize("norm", [False, True])
def test_double_backward_is_refused_not_silently_wrong(norm: bool) -> None:
    # A gradient penalty differentiates the backward: through a compressed cache it would lose
    # or bend the second-order terms, so it is an error.
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 1))
    _, drop = _pair(plain, strategy="quant", norm=norm)
    x = torch.randn(2, 2, 6, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(drop(x).square().sum(), x, create_graph=True)
    torch.autograd.grad(drop(x).square().sum(), x)  # a first-order backward is as before
    # the same through compress_saved's hooks
    hooked = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh())
    compress_saved(hooked, min_bytes=0)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(hooked(x).square().sum(), x, create_graph=True)
    assert "from_dropit" in DOUBLE_BACKWARD


def test_to_dropit_names_what_it_cannot_convert() -> None:
    with pytest.raises(ValueError, match="not the model itself: wrap this Conv2d"):
        to_dropit(nn.Conv2d(3, 4, 3))
    for convert in (to_dropit, compress_saved, lean_frozen_batchnorm):
        with pytest.raises(TypeError, match="takes an nn.Module, got str"):
            convert("model")
    with pytest.raises(ValueError, match="strict='no' must be True or False"):
        to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3)), strict="no")
    with pytest.raises(ValueError, match="register_strategy takes a dropit_core.Strategy"):
        register_strategy(int)
    # a numpy float is a number (a gamma read from an array or a sweep)
    np = pytest.importorskip("numpy")
    record = dropit_record(to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3)), gamma=np.float32(0.5)))
    assert record.settings[0].gamma == 0.5


def test_compress_saved_leaves_a_converted_layers_cache_as_it_is() -> None:
    # mink at gamma 0 keeps every value: exact on its own, and exact inside compress_saved too
    # (the block once rounded the kept values to 4 bits a second time)
    torch.manual_seed(2)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1))
    _, drop = _pair(plain, strategy="mink", gamma=0.0, relu=False)
    handle = compress_saved(drop, min_bytes=1024)
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    got, want = _grads(drop, x), _grads(plain, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    assert handle.last is not None and handle.last.packs == 0  # nothing left to compress


class _TwoReaders(nn.Module):
    """``x`` feeds a conv outside a compress_saved block and one inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.Conv2d(3, 4, 3, padding=1)
        self.inner = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(x) + self.inner(x)


def test_a_pack_shared_into_a_compress_saved_block_is_not_compressed_again() -> None:
    # The outer conv packs x through its saved-tensor hooks (no other hooks are active there),
    # which leave the pack untagged; the inner conv, inside the block, runs its Function and
    # saves the same pack, which compress_saved must still see as compressed already.
    torch.manual_seed(3)
    plain, drop = _pair(_TwoReaders(), strategy="mink", gamma=0.0, relu=False)
    handle = compress_saved(drop.inner, min_bytes=16)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    got, want = _grads(drop, x), _grads(plain, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    assert handle.last is not None and handle.last.packs == 0

"""The eager conv through saved-tensor hooks (dropit_core.layers.hooked) against the autograd
Function it stands in for: the same outputs, packs and gradients bit for bit, and the Function
wherever the hooks would not do the same (a frozen weight, a large input, other hooks active)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from dropit_core import compress_saved, configure, reset_settings, set_step, to_dropit
from dropit_core.formats.packed import DOUBLE_BACKWARD
from dropit_core.layers.functions import SPLIT_BYTES


class _Fork(nn.Module):
    """A stem conv, then two convs fed the same tensor (their pack is shared), summed, then a
    transposed conv."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.relu = nn.ReLU()
        self.a = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.b = nn.Conv2d(channels, channels, 1, stride=2)
        self.up = nn.ConvTranspose2d(channels, 3, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 under autocast too: each of a and b casts it, and their pack is still shared
        h = self.relu(self.stem(x)).float()
        return self.up(self.a(h)[..., ::2, ::2] + self.b(h))


def _model(strategy: str, **options) -> nn.Module:
    torch.manual_seed(0)
    return to_dropit(_Fork(), strategy=strategy, gamma=0.7, **options)


def _recorded(model: nn.Module) -> list[tuple]:
    """The bytes of every pack the model's strategy makes, in order."""
    strategy = next(m for m in model.modules() if hasattr(m, "dropit_cache")).dropit_cache.strategy
    real, packs = strategy.pack, []

    def pack(x, *args):
        packed = real(x, *args)
        packs.append(tuple(t.clone() for t in packed.stored()))
        return packed

    strategy.pack = pack
    return packs


def _step(model: nn.Module, x: torch.Tensor, hooks: bool, amp: bool = False) -> tuple:
    """(output, input gradient, parameter gradients, packs) of one training step."""
    packs = _recorded(model)
    previous = configure(hooked=hooks)
    try:
        set_step(model, 3)
        x = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        out.float().square().sum().backward()
    finally:
        configure(hooked=previous.hooked)
    grads = [p.grad.clone() for p in model.parameters()]
    return out.detach(), x.grad, grads, packs


def _same(a: tuple, b: tuple) -> None:
    out_a, gx_a, grads_a, packs_a = a
    out_b, gx_b, grads_b, packs_b = b
    assert torch.equal(out_a, out_b) and torch.equal(gx_a, gx_b)
    assert all(torch.equal(p, q) for p, q in zip(grads_a, grads_b, strict=True))
    # the stem's input, one shared by a and b, the transposed conv's input
    assert len(packs_a) == len(packs_b) == 3
    for pa, pb in zip(packs_a, packs_b, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(pa, pb, strict=True))


@pytest.mark.parametrize(
    ("strategy", "options", "amp"),
    [("quant", {"bits": 4}, False), ("quant", {"bits": 2}, True), ("mink", {}, False)],
    ids=["quant4", "quant2-bf16", "mink"],
)
def test_hooked_convs_make_the_functions_outputs_packs_and_gradients(strategy, options, amp):
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    model = _model(strategy, **options)
    twin = copy.deepcopy(model)
    hooked_step = _step(model, x, hooks=True, amp=amp)
    function_step = _step(twin, x, hooks=False, amp=amp)
    _same(hooked_step, function_step)
    assert any(g.abs().sum() > 0 for g in hooked_step[2])  # the gradients are not all zero


def _grad_fn_name(model: nn.Module, x: torch.Tensor, within: Callable | None = None) -> str:
    conv = model.a
    h = x.clone().requires_grad_(True)
    if within is None:
        return type(conv(h).grad_fn).__name__
    with within():
        return type(conv(h).grad_fn).__name__


def test_which_path_a_conv_takes():
    model = _model("quant", bits=4)
    x = torch.randn(1, 6, 8, 8)
    assert _grad_fn_name(model, x) == "ConvolutionBackward0"  # aten's node: the hooks
    up = model.up(torch.randn(1, 6, 4, 4, requires_grad=True))
    assert type(up.grad_fn).__name__ == "ConvolutionBackward0"  # a transposed conv's too
    previous = configure(hooked=False)
    try:
        assert "DropITConvFunction" in _grad_fn_name(model, x)
    finally:
        configure(hooked=previous.hooked)
    # Another pair of hooks active: the Function, which they see.
    seen = []

    def outer() -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t)

    assert "DropITConvFunction" in _grad_fn_name(model, x, outer)
    assert seen  # the Function's weight and pack went through the outer hook
    # A frozen weight: the Function, which keeps no input.
    model.a.weight.requires_grad_(False)
    assert "DropITConvFunction" in _grad_fn_name(model, x)
    model.a.weight.requires_grad_(True)
    # An input of SPLIT_BYTES or more: the Function, whose backward frees the rebuilt map first.
    big = torch.empty(1, 6, 1, SPLIT_BYTES // 24 + 1)  # 6 channels of 4 bytes
    assert big.numel() * 4 >= SPLIT_BYTES
    assert "DropITConvFunction" in type(model.a(big.requires_grad_(True)).grad_fn).__name__


def test_the_hooks_are_popped_after_the_conv_even_when_it_raises():
    model = _model("quant", bits=4)
    top = torch._C._autograd._top_saved_tensors_default_hooks
    model.a(torch.randn(1, 6, 8, 8, requires_grad=True))
    assert top(False) is None
    with pytest.raises(RuntimeError):
        model.a(torch.randn(1, 5, 8, 8, requires_grad=True))  # wrong channel count
    assert top(False) is None
    hooks = model.a.dropit_cache.saved_hooks
    assert hooks.weight is None and hooks.source is None  # nothing held past the call


def test_a_hooked_conv_refuses_double_backward():
    model = _model("quant", bits=4)
    x = torch.randn(1, 6, 8, 8, requires_grad=True)
    out = model.a(x)
    assert type(out.grad_fn).__name__ == "ConvolutionBackward0"
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
    assert "double backward" in DOUBLE_BACKWARD


def test_compress_saved_on_a_converted_model_sees_the_functions_tensors():
    # compress_saved's block is another pair of hooks: converted convs inside it run the Function,
    # whose packs it leaves alone (tagged), and it packs the rest as before: here the one tensor
    # no converted layer keeps, the sigmoid's output.
    model = nn.Sequential(_model("quant", bits=4), nn.Sigmoid())
    handle = compress_saved(model, bits=4, min_bytes=256)
    x = torch.randn(2, 3, 12, 12, requires_grad=True)
    out = model(x)
    up = out.grad_fn.next_functions[0][0]  # the transposed conv's node, under the sigmoid's
    assert "DropITConvFunction" in type(up).__name__
    out.sum().backward()
    assert handle.last is not None and handle.last.packs == 1
    assert handle.last.dense_bytes == out.numel() * 4


def test_dropit_hooked_0_in_the_environment_makes_convs_run_their_function(monkeypatch):
    model = _model("quant", bits=4)
    x = torch.randn(1, 6, 8, 8)
    try:
        monkeypatch.setenv("DROPIT_HOOKED", "0")
        assert reset_settings().hooked is True  # the previous setting
        assert "DropITConvFunction" in _grad_fn_name(model, x)
        monkeypatch.setenv("DROPIT_HOOKED", "1")
        reset_settings()
        assert _grad_fn_name(model, x) == "ConvolutionBackward0"
    finally:
        monkeypatch.delenv("DROPIT_HOOKED")
        reset_settings()

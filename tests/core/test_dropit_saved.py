"""CompressSaved: every activation autograd saves, compressed, in a model to_dropit cannot convert
(functional ReLU, BatchNorm), with the zeros and signs kept exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dropit_core import set_step, to_dropit
from dropit_core.memory import saved_activations
from dropit_core.saved import CompressSaved, compress_saved


class _Functional(nn.Module):
    """Conv, BatchNorm, functional ReLU, max-pool, two convs reading one tensor, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        y = F.relu(self.conv2(y)) + self.conv3(y)  # y is saved by conv2 and conv3
        return self.fc(y.mean(dim=(2, 3)))


def _grads(model: nn.Module, x: torch.Tensor, **options):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if options:
        with CompressSaved(**options) as saved:
            out = model(x)
    else:
        saved, out = None, model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved


def test_forward_exact_gradients_close_and_far_fewer_bytes() -> None:
    model, x = _Functional(), torch.randn(4, 3, 32, 32)
    out, exact, _ = _grads(model, x)
    out_c, approx, saved = _grads(model, x, bits=4, min_bytes=1024)
    assert torch.equal(out, out_c)  # the forward is untouched
    for name, g in exact.items():
        if name == "conv1.bias":  # BatchNorm removes it: its exact gradient is float noise
            assert g.norm() < 1e-6 and approx[name].norm() < 0.01
            continue
        cos = F.cosine_similarity(g.flatten(), approx[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))
    # 4-bit codes, 8 bytes per group of 256, 2 bits of zeros and signs: about 0.2x of fp32
    assert saved.packs >= 5 and saved.packed_bytes < 0.25 * saved.dense_bytes


def test_a_tensor_saved_by_two_ops_is_packed_once_and_parameters_are_left_alone() -> None:
    conv_a, conv_b = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    with CompressSaved(min_bytes=1024) as saved:
        h = torch.relu(x)
        (conv_a(h) + conv_b(h)).sum().backward()
    # relu's output h is saved three times (relu, conv_a, conv_b): one pack; the weights none
    assert saved.packs == 1 and saved.dense_bytes == h.numel() * 4


captured: dict[str, torch.Tensor] = {}


class _Probe(torch.autograd.Function):
    """Saves its input; its backward puts what autograd hands back in ``captured["t"]``."""

    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        (captured["t"],) = ctx.saved_tensors
        return grad


def test_the_rebuilt_tensor_keeps_the_zeros_and_signs_exactly() -> None:
    x = torch.randn(64, 64)
    x[x.abs() < 0.5] = 0.0  # many zeros, small values beside them
    x[0, :8] = 1e-6  # tiny values that a 4-bit code of a wide group would round to zero
    x[1, :8] = -1e-6
    leaf = x.clone().requires_grad_()
    with CompressSaved(bits=2, min_bytes=0):
        _Probe.apply(leaf * 1.0).sum().backward()
    rebuilt = captured["t"]
    assert torch.equal(rebuilt == 0, x == 0) and torch.equal(rebuilt < 0, x < 0)
    assert not torch.equal(rebuilt, x)  # the values themselves are 2-bit approximations


@pytest.mark.parametrize("layout", ["channels_last", "every_other_column"])
def test_a_strided_saved_tensor_comes_back_with_its_strides(layout: str) -> None:
    """A channels-last map (as Inductor's graphs save them) is packed in its memory order and
    rebuilt in it; other strides are rebuilt into their own: a compiled backward asserts the
    strides of what it saved."""
    leaf = torch.randn(2, 8, 16, 16, requires_grad=True)
    with CompressSaved(bits=8, min_bytes=0) as saved:
        if layout == "channels_last":
            t = (leaf * 1.0).to(memory_format=torch.channels_last)
        else:
            t = (leaf * 1.0)[..., ::2]  # not a permutation of a dense tensor
        _Probe.apply(t).sum().backward()
    assert saved.packs == 1 and not t.is_contiguous()
    rebuilt = captured["t"]
    assert rebuilt.shape == t.shape and rebuilt.stride() == t.stride()
    assert (rebuilt - t).abs().max() < 0.05  # the same values, each rebuilt from 8-bit codes


def test_small_and_integer_tensors_stay_dense() -> None:
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    with CompressSaved(min_bytes=1 << 20) as saved:  # nothing here is that large
        F.max_pool2d(torch.relu(x), 2, return_indices=True)[0].sum().backward()
    assert saved.packs == 0 and x.grad is not None


def test_compress_saved_packs_each_training_forward_of_a_model_it_did_not_build() -> None:
    model, x = _Functional(), torch.randn(4, 3, 32, 32)
    _, exact, _ = _grads(model, x)
    handle = compress_saved(model, bits=4, min_bytes=1024)
    assert model.dropit_saved is handle
    _, approx, _ = _grads(model, x)  # a plain loop: the hooks open and close the block
    first = handle.last
    assert first is not None and first.packs >= 5 and first.step == 0
    assert first.packed_bytes < 0.25 * first.dense_bytes
    for name, g in exact.items():
        if name != "conv1.bias":  # BatchNorm removes it (see above)
            assert F.cosine_similarity(g.flatten(), approx[name].flatten(), dim=0) > 0.99, name
    _, again, _ = _grads(model, x)  # the next forward draws with the next step
    assert handle.last.step == 1 and not torch.equal(again["conv1.weight"], approx["conv1.weight"])
    set_step(model, 0, rank=0)  # set_step seeds it as it seeds the layers: step 0 again
    _, repeat, _ = _grads(model, x)
    assert all(torch.equal(repeat[n], approx[n]) for n in approx)
    set_step(model, 0, rank=1)  # another rank draws otherwise
    _, other_rank, _ = _grads(model, x)
    assert not torch.equal(other_rank["conv1.weight"], approx["conv1.weight"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, "bits=3"),
        ({"min_bytes": -1}, "min_bytes=-1: allowed a whole number >= 0"),
        ({"min_bytes": 1.5}, "min_bytes=1.5"),
        ({"min_bytes": "64k"}, "min_bytes='64k'"),  # once found only at the first forward
    ],
)
def test_compress_saved_checks_its_options_when_called(kwargs: dict, message: str) -> None:
    model = _Functional()
    with pytest.raises(ValueError, match=message):
        compress_saved(model, **kwargs)
    with pytest.raises(ValueError, match=message):
        CompressSaved(**kwargs)
    with pytest.raises(ValueError, match="step=-1: allowed a whole number >= 0"):
        CompressSaved(step=-1)


def test_compress_saved_leaves_eval_and_a_raising_forward_alone_and_detaches() -> None:
    model, x = _Functional(), torch.randn(2, 3, 16, 16)
    handle = compress_saved(model, min_bytes=1024)
    with pytest.raises(ValueError, match="compressed already"):
        compress_saved(model)
    model.eval()
    model(x).sum().backward()
    assert handle.last is None  # nothing packed in eval
    model.train()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 16, 16))  # a wrong channel count: conv1 raises mid-forward
    # the block was left all the same: a tensor saved after it stays as it is (a block left
    # open would hand back a rebuilt 4-bit copy, another tensor)
    h = torch.randn(64, 64, requires_grad=True) * 1.0
    assert h.sin().grad_fn._saved_self.data_ptr() == h.data_ptr()
    before = handle.last
    handle.remove()
    assert "dropit_saved" not in model.__dict__
    model(x).sum().backward()
    assert handle.last is before  # detached: no forward went through the block


def test_the_memory_count_reads_what_compress_saved_keeps() -> None:
    model, x = _Functional(), torch.randn(4, 3, 32, 32)
    _, dense = saved_activations(model, lambda: model(x))
    handle = compress_saved(model, min_bytes=1024)
    loss, packed = saved_activations(model, lambda: model(x))
    block = handle.last
    # Without the block's own count the outer hooks would see nothing it packed (total near 0).
    # Each pack is charged its bytes, each tensor it leaves dense its storage's: the max-pool's
    # int64 indices (4 x 16 x 16 x 16) and BatchNorm's statistics, under 1 KiB.
    left_dense = dense.total_bytes - block.dense_bytes
    assert packed.total_bytes == block.packed_bytes + left_dense
    assert 0 <= left_dense - 4 * 16 * 16 * 16 * 8 < 1024
    assert packed.total_bytes < 0.35 * dense.total_bytes  # the indices are 0.16x of it, dense
    assert packed.by_type["BatchNorm2d"] < 0.25 * dense.by_type["BatchNorm2d"]
    assert handle.observer is None  # the count lets go of the block
    loss.sum().backward()


def test_a_linear_layers_transposed_weight_stays_dense_so_its_input_gradient_is_exact() -> None:
    fc = nn.Linear(256, 256)  # a 2-D input goes to addmm, which saves weight.t(): a view
    x = torch.randn(64, 256, requires_grad=True)
    fc(x * 1.0).sum().backward()
    exact, x.grad = x.grad, None
    with CompressSaved(min_bytes=1024) as saved:
        fc(x * 1.0).sum().backward()
    # x * 1.0 (64 KiB) is packed; the weight's view is left whole, not rounded to 4 bits
    assert saved.packs == 1 and saved.dense_bytes == 64 * 256 * 4
    assert torch.equal(x.grad, exact)  # the input gradient reads only the weight


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
        h = self.relu(self.stem(x)).float()
        return self.up(self.a(h)[..., ::2, ::2] + self.b(h))


def test_compress_saved_on_a_converted_model_sees_the_functions_tensors():
    # compress_saved's block is another pair of hooks: converted convs inside it run the Function,
    # whose packs it leaves alone (tagged), and it packs the rest as before: here the one tensor
    # no converted layer keeps, the sigmoid's output.
    torch.manual_seed(0)
    model = nn.Sequential(to_dropit(_Fork(), strategy="quant", gamma=0.7, bits=4), nn.Sigmoid())
    handle = compress_saved(model, bits=4, min_bytes=256)
    x = torch.randn(2, 3, 12, 12, requires_grad=True)
    out = model(x)
    up = out.grad_fn.next_functions[0][0]  # the transposed conv's node, under the sigmoid's
    assert "DropITConvFunction" in type(up).__name__
    out.sum().backward()
    assert handle.last is not None and handle.last.packs == 1
    assert handle.last.dense_bytes == out.numel() * 4

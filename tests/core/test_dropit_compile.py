"""A converted model under ``torch.compile``: one graph, and training equal to eager.

The DropIT layers call ``torch.library`` operators while compiling (dropit_core.layers.library): the
packs are the eager code's, drawn with the same keys, so the packs of a step are byte-equal to
eager ones; the compiler reorders float sums of its own (the linear bias gradient, a sum over
rows), so gradients agree to a few ulps (TOLERANCE), not bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dropit_core import (
    FrozenBatchNorm2d,
    compress_saved,
    configure,
    reset_settings,
    set_step,
    to_dropit,
)
from dropit_core.backends import dispatch
from dropit_core.layers import library as traced

# Relative tolerance of compiled gradients and losses against eager ones: fp32 sums in another
# order differ by a few ulps (2**-23 ~ 1.2e-7 each); 1e-5 leaves room for two steps.
TOLERANCE = 1e-5
# The norms' backward (aten's batch/group norm backward) is decomposed by Inductor into sums of
# its own: a conv bias feeding a BatchNorm has a gradient that cancels to ~0, where that order
# shows most (measured 3.3e-5 of the largest element; the other parameters 5e-7).
NORM_TOLERANCE = 1e-4


class _Net(nn.Module):
    """Conv, frozen norm, ReLU (in place), max-pool, conv, ReLU, then two linear heads fed the
    same features (one pack for both, eagerly and compiled): maps of ~1e3-1e4 values."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            FrozenBatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.head_a = nn.Linear(8 * 8 * 8, 10)
        self.head_b = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body(x)
        return self.head_a(features) + self.head_b(features)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    norm = model.body[1]
    with torch.no_grad():  # a norm that is not the identity
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
        norm.running_mean.uniform_(-0.2, 0.2)
        norm.running_var.uniform_(0.5, 2.0)
    return to_dropit(model, strategy="quant", bits=4, pool=True)


def _record_packs(model: nn.Module) -> tuple[list[int], list[bytes]]:
    """From now on: the keys the model's packs draw, in order, and the bytes of every pack its
    backward reads (both paths draw through ``InputCache.next_key`` and rebuild through
    ``Strategy.unpack``; a compiled pack may be made in the graph, not by ``Strategy.pack``)."""
    keys: list[int] = []
    read: list[bytes] = []
    cache = model.body[0].dropit_cache
    next_key, strategy = cache.next_key, cache.strategy
    plain_unpack = strategy.unpack

    def recording_next_key() -> int:
        keys.append(next_key())
        return keys[-1]

    def unpack(packed):
        read.append(b"".join(t.numpy().tobytes() for t in packed.stored()))
        return plain_unpack(packed)

    cache.next_key = recording_next_key  # instance attributes: both paths call these
    strategy.unpack = unpack
    return keys, read


def _train(model: nn.Module, run, x: torch.Tensor, y: torch.Tensor, steps: int = 2):
    """(losses, gradients of each step) of SGD steps; the loss is eager, outside ``run``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        set_step(model, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(run(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def test_a_converted_model_compiles_in_one_graph():
    model = _model()
    explained = torch._dynamo.explain(model)(torch.randn(2, 3, 16, 16))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _assert_trains_alike(losses, grads, eager_losses, eager_grads, tolerance: float) -> None:
    """Losses within TOLERANCE of eager ones; each gradient within ``tolerance`` relative, and
    of its largest element absolute."""
    for got, want in zip(losses, eager_losses, strict=True):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=0)
    for step_got, step_want in zip(grads, eager_grads, strict=True):
        for got, want in zip(step_got, step_want, strict=True):
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.slow  # Inductor's C++ compile: ~20 s on one core, per fuse setting
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "opaque"])
def test_compiled_training_matches_eager_and_packs_the_same_bytes(fuse: bool, monkeypatch):
    configure(fuse=fuse)
    x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 10, (4,))
    eager = _model()
    compiled_model = copy.deepcopy(eager)
    eager_keys, eager_read = _record_packs(eager)
    keys, read = _record_packs(compiled_model)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True)

    eager_losses, eager_grads = _train(eager, eager, x, y)
    losses, grads = _train(compiled_model, compiled, x, y)

    # three packs a step (two convs, the heads' shared input): the same draws, in order
    assert len(eager_keys) == 6 and keys == eager_keys
    # and the same bytes read back (eagerly the two heads rebuild their shared pack each;
    # compiled, the identical rebuilds may be merged, and backward's order is the compiler's)
    assert len(set(eager_read)) == 6 and set(read) == set(eager_read)
    _assert_trains_alike(losses, grads, eager_losses, eager_grads, TOLERANCE)


@pytest.mark.slow  # Inductor's C++ compile
def test_packs_and_relu_masks_are_fused_into_the_graphs_kernels(monkeypatch):
    """Fused (the default), the compiled forward calls no opaque pack or mask: one draw per
    pack, and the ReLU's mask made in the kernel that makes its output (the frozen norm, ReLU
    and max-pool of the first block are one kernel). Opaque, the pack and the mask are calls."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4, 3, 16, 16)

    def forward_code(fuse: bool) -> str:
        configure(fuse=fuse)
        torch._dynamo.reset()
        model = _model()
        compiled = torch.compile(model, fullgraph=True)
        set_step(model, 0)
        return run_and_get_code(compiled, x)[1][0]

    fused = forward_code(True)
    assert "dropit.pack" not in fused and "dropit.relu_mask" not in fused
    assert fused.count("torch.ops.dropit.draw.default(") == 3
    assert any("relu" in k and "max_pool2d" in k for k in _kernel_names(fused))
    opaque = forward_code(False)
    assert opaque.count("torch.ops.dropit.pack.default(") == 3
    assert opaque.count("torch.ops.dropit.relu_mask.default(") == 2


def _kernel_names(code: str) -> list[str]:
    """The names of the kernels Inductor generated in ``code`` (the C++ ones here)."""
    return [line.split(" = ")[0] for line in code.splitlines() if line.startswith("cpp_fused")]


class _NormNet(nn.Module):
    """Trainable norms that keep a quant pack of their input (``norm=True``), and a transposed
    convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.gn = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 2, 2, stride=2)
        self.head = nn.Linear(2 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(self.gn(self.relu(self.bn(self.conv(x))))).flatten(1))


@pytest.mark.slow  # Inductor's C++ compile
def test_compiled_dropit_norms_train_as_eager():
    torch.manual_seed(0)
    eager = to_dropit(_NormNet(), strategy="quant", bits=4, norm=True)
    compiled_model = copy.deepcopy(eager)
    explained = torch._dynamo.explain(copy.deepcopy(eager))(torch.randn(2, 3, 16, 16))
    assert explained.graph_break_count == 0, explained.break_reasons
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    torch._dynamo.reset()
    eager_losses, eager_grads = _train(eager, eager, x, y)
    losses, grads = _train(compiled_model, torch.compile(compiled_model, fullgraph=True), x, y)
    _assert_trains_alike(losses, grads, eager_losses, eager_grads, NORM_TOLERANCE)
    for name, buffer in eager.bn.named_buffers():  # the running statistics, updated alike
        got = getattr(compiled_model.bn, name)
        torch.testing.assert_close(got, buffer, rtol=TOLERANCE, atol=1e-7)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_fused_pack_is_the_eager_pack_byte_for_byte(bits: int, monkeypatch):
    """The traced pack's torch ops (what Inductor fuses), run eagerly: the eager pack's bytes
    for the same draw, and the draw is the cache's next key (a pack of another shape, dtype or
    group is left to the opaque operator)."""
    from dropit_core.layers.cache import InputCache
    from dropit_core.strategies.catalog import build_strategy

    configure(fuse=True)
    strategy = build_strategy("quant", 0.0, bits=bits)
    cache, twin = InputCache(strategy), InputCache(strategy)
    x = torch.randn(2, 8, 16, 16) * 3
    fused = traced._fused_pack(cache, x, x.dtype)
    eager = strategy.pack(x, "conv", twin.next_key())
    assert cache.position == twin.position == 1
    assert [t.dtype for t in fused] == [t.dtype for t in eager.stored()]
    for got, want in zip(fused, eager.stored(), strict=True):
        assert torch.equal(got, want)
    assert traced._fused_pack(cache, x[:, :, :3, :3], x.dtype) is None  # 144: not whole groups
    assert traced._fused_pack(cache, x, torch.bfloat16) is None  # read through a cast


def test_the_fused_relu_keeps_the_eager_mask_and_gradient():
    from dropit_core.formats.bits import pack_blocked
    from dropit_core.layers.relu import MaskedReLUFunction, _MaskedReLU

    x = torch.randn(3, 5, 7)  # 105 values: a last byte of flags only partly used
    x[0, 0, :3] = torch.tensor([0.0, float("nan"), -0.0])
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = _MaskedReLU.apply(a)
    want = MaskedReLUFunction.apply(b, False)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # bits, NaN included
    assert torch.equal(out.grad_fn.saved_tensors[0], pack_blocked(want.detach()))
    grad = torch.randn_like(x)
    grad[0, 0, 0] = float("nan")
    out.backward(grad)
    want.backward(grad)
    assert torch.equal(a.grad.view(torch.int32), b.grad.view(torch.int32))


def test_fusing_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv("DROPIT_FUSE", raising=False)
    reset_settings()
    assert not dispatch.fused()
    monkeypatch.setenv("DROPIT_FUSE", "1")
    reset_settings()
    try:
        assert dispatch.fused()
        configure(fuse=False)
        assert not dispatch.fused()
    finally:
        monkeypatch.delenv("DROPIT_FUSE")
        reset_settings()


def test_a_data_sized_strategy_packs_eagerly_behind_a_graph_break():
    """mink's CPU packs are sized by their data: each such layer runs its autograd Function
    behind ``torch.compiler.disable`` (torch 2.14's Dynamo keeps such a call in the graph as an
    opaque call, so ``explain`` counts no break), and the compiled model trains as eager."""
    torch.manual_seed(0)
    eager = to_dropit(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 14 * 14, 3)),
        strategy="mink",
        gamma=0.8,
    )
    compiled_model = copy.deepcopy(eager)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 3, (2,))
    torch._dynamo.reset()
    eager_losses, eager_grads = _train(eager, eager, x, y)
    run = torch.compile(compiled_model, backend="eager")  # the breaks, without Inductor's time
    losses, grads = _train(compiled_model, run, x, y)
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    for step_got, step_want in zip(grads, eager_grads, strict=True):
        for got, want in zip(step_got, step_want, strict=True):
            assert torch.equal(got, want)


@pytest.mark.slow  # traces a whole R50 body and FPN (tens of seconds on 2 cores)
def test_the_r50_fpn_backbone_with_4_bit_dropit_traces_in_one_graph():
    """Issue 40's target: torchvision's R50-FPN body and FPN, lean (dropit_core.lean_detector),
    every conv and ReLU at 4 bits: ``torch._dynamo.explain`` finds one graph, no break."""
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    from dropit_core import lean_detector

    torch.manual_seed(0)
    backbone = lean_detector(resnet_fpn_backbone(backbone_name="resnet50", weights=None))
    to_dropit(backbone, strategy="quant", bits=4)
    explained = torch._dynamo.explain(backbone)(torch.randn(1, 3, 64, 64))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.slow  # Inductor compiles the FPN alone, forward and backward
def test_the_lean_fpn_compiles_with_dynamic_shapes_and_trains_as_eager():
    """The lean FPN under Inductor with dynamic shapes (two sets of map sizes): its in-place add
    into a strided view of the lateral map had broken Inductor's layout code ("cannot determine
    truth value of Relational"); compiling, it adds the upsampled map out of place. The
    compiler's convolutions and fused pointwise code round otherwise than eager's: outputs and
    gradients (parameters and the body's maps) within 1e-4 of each tensor's largest element."""
    from collections import OrderedDict

    from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

    from dropit_core.detection.forward import LeanFeaturePyramidNetwork

    torch.manual_seed(0)
    widths = (8, 16, 32, 64)
    eager = LeanFeaturePyramidNetwork(list(widths), 16, extra_blocks=LastLevelMaxPool())
    compiled = copy.deepcopy(eager)
    compiled.forward = torch.compile(compiled.forward, dynamic=True)
    for size in (32, 48):
        body = [torch.randn(2, c, size >> i, size >> i) for i, c in enumerate(widths)]
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            feats = [f.clone().requires_grad_() for f in body]
            maps = model(OrderedDict((str(i), f) for i, f in enumerate(feats)))
            sum(m.square().mean() for m in maps.values()).backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            grads.update((f"feat{i}", f.grad) for i, f in enumerate(feats))
            outs.append((maps, grads))
        (want, want_grads), (got, got_grads) = outs
        assert list(got) == list(want)
        for name, b in want.items():
            _assert_near(got[name], b)
        for name, b in want_grads.items():
            _assert_near(got_grads[name], b)


@pytest.mark.slow  # Inductor compiles a ResNet-18 body and FPN, forward and backward (~1 min)
def test_a_lean_fpn_backbone_with_dropit_compiles_with_dynamic_shapes_and_trains_as_eager():
    """``train.compile: backbone`` on the toolkit's lean backbone with 4-bit DropIT: Inductor
    with dynamic shapes (two image sizes). Outputs within 1e-4 of each tensor's largest element
    (the compiler's convolutions and fused pointwise code round otherwise than eager's); a value
    that moved by a rounding can take the next code (a step of its group's range), so the
    gradients are compared by direction. The plain backbone differs from this one only in its
    convs and ReLUs (stock torch layers); its FPN, the same module, is checked in fp32 by the
    test above."""
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    from dropit_core import lean_detector

    torch.manual_seed(0)
    eager = lean_detector(resnet_fpn_backbone(backbone_name="resnet18", weights=None))
    to_dropit(eager, strategy="quant", bits=4)
    compiled = copy.deepcopy(eager)
    compiled.forward = torch.compile(compiled.forward, dynamic=True)
    for step, size in enumerate((64, 96)):
        x = torch.randn(2, 3, size, size)
        outs = []
        for model in (eager, compiled):
            set_step(model, step)
            model.zero_grad()
            maps = model(x)
            sum(m.square().mean() for m in maps.values()).backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            outs.append((maps, grads))
        (want, want_grads), (got, got_grads) = outs
        for name, b in want.items():
            _assert_near(got[name], b)
        for name, b in want_grads.items():
            cosine = torch.cosine_similarity(got_grads[name].flatten(), b.flatten(), dim=0)
            assert cosine > 0.999, name


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within NORM_TOLERANCE of ``want``'s largest element."""
    torch.testing.assert_close(got, want, rtol=0, atol=NORM_TOLERANCE * want.abs().max().item())


@pytest.mark.slow  # Inductor's C++ compile
def test_compress_saved_compresses_a_compiled_models_saved_tensors() -> None:
    """``compress_saved`` on a model then compiled: its block is entered outside the graph, the
    graph's saved tensors are packed at run time and rebuilt in the layout the graph saved them
    in. What the graph saves is the compiler's choice, not eager's, so gradients are compared with
    the exact ones, not with eager's compressed ones."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    x = torch.randn(2, 3, 16, 16)

    def grads(m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad()
        m(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    exact = grads(model)
    handle = compress_saved(model, bits=4, min_bytes=1024)
    compiled = grads(torch.compile(model))
    assert handle.last.packs >= 4 and handle.last.packed_bytes < 0.25 * handle.last.dense_bytes
    for i, (g, c) in enumerate(zip(exact, compiled, strict=True)):
        if i == 1:  # the conv bias before BatchNorm: its exact gradient is float noise
            continue
        cos = torch.nn.functional.cosine_similarity(g.flatten(), c.flatten(), dim=0)
        assert cos > 0.98, (i, float(cos))


def _bucket_net() -> nn.Module:
    """Convs, ReLUs and a global pool before the linear layer: any input size trains it."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip
    return to_dropit(model, strategy="quant", bits=4)


@pytest.mark.slow  # Dynamo and AOTAutograd trace the model once per bucket: about 5 s
def test_two_bucket_sizes_compile_once_each_and_every_step_draws_anew():
    """Issue 58: a compiled DropIT model trained 20 steps, ``set_step`` changing every step and
    the batches alternating between two padded sizes, is traced once per size (the step's seed
    reaches the graph at run time, through the opaque draw, not as a constant it guards on), and
    trains as eager does: the same draws, step by step, and the same gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager, compiled_model = _bucket_net(), _bucket_net()
    eager_keys, _ = _record_packs_of(eager[0])
    keys, _ = _record_packs_of(compiled_model[0])
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(compiled_model, backend=counter, dynamic=False)
    gen = torch.Generator().manual_seed(1)
    buckets = [(16, 24), (24, 16)]
    batches = [
        (torch.randn(2, 3, *buckets[step % 2], generator=gen), torch.randint(0, 10, (2,)))
        for step in range(20)
    ]
    grads: dict[str, list[list[torch.Tensor]]] = {"eager": [], "compiled": []}
    for name, model, forward in (("eager", eager, eager), ("compiled", compiled_model, run)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(batches):
            set_step(model, step)
            opt.zero_grad()
            nn.functional.cross_entropy(forward(x), y).backward()
            grads[name].append([p.grad.clone() for p in model.parameters()])
            opt.step()
    assert counter.frame_count == len(buckets)  # one graph per bucket, none per step
    # the same draws as eager, in order, a whole step's apart (each step the layers' packs),
    # and none twice: a new draw every step
    assert keys == eager_keys and len(keys) % 20 == 0 and len(set(keys)) == len(keys) >= 20
    for got, want in zip(grads["compiled"], grads["eager"], strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=0)


def _record_packs_of(layer: nn.Module) -> tuple[list[int], list[bytes]]:
    """``_record_packs`` for any converted layer: the keys its packs draw, in order."""
    keys: list[int] = []
    cache = layer.dropit_cache
    next_key = cache.next_key

    def recording_next_key() -> int:
        keys.append(next_key())
        return keys[-1]

    cache.next_key = recording_next_key
    return keys, []

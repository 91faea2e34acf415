"""The lean forward (dropit_core.detection.forward): torchvision's detector bit for bit in fp32,
losses, gradients and detections, with and without DropIT and checkpointing, while the maps it
hands over are released after their last use."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections import OrderedDict
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.rpn import RPNHead
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

from dropit_core import CompressSaved, lean_detector, set_step, to_dropit
from dropit_core.detection.forward import (
    ConsumableMaps,
    LeanFeaturePyramidNetwork,
    LeanMaskRCNN,
    LeanMultiScaleRoIAlign,
    LeanRPNHead,
    _one_input_grad,
    _ReadersInputGrad,
    add_top_down,
)
from dropit_core.layers import conv as ops
from rcnn_dropit.config import config_from_dict
from rcnn_dropit.models import build_model
from tests.core.allocations import allocations

SIZE = 96  # a multiple of 32: every top-down step is an exact 2x
MODEL = {
    "backbone": "resnet18",
    "trainable_layers": 3,
    "num_classes": 4,
    "min_size": SIZE,
    "max_size": SIZE,
    "fpn_channels": 32,
    "box_head_width": 64,
    "mask_head_channels": 16,
    "mask_head_convs": 2,
    "box_batch_size_per_image": 32,
    "rpn_batch_size_per_image": 32,
    "box_detections_per_img": 10,
}
TORCHVISION = {"forward": "torchvision", "fpn": "torchvision"}
QUANT = {"enabled": True, "strategy": "quant", "options": {"bits": 4}}


def _models(arch: str = "maskrcnn", dropit: dict | None = None, **model) -> tuple:
    """(lean, torchvision's) detectors of the same random weights."""
    pair = []
    for forward in ({}, TORCHVISION):
        cfg = config_from_dict(
            {"model": {**MODEL, "arch": arch, **model, **forward}, "dropit": dropit or {}}
        )
        torch.manual_seed(0)
        pair.append(build_model(cfg)[0].train())
    return tuple(pair)


def _batch(n: int = 2) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(3)
    images, targets = [], []
    for i in range(n):
        images.append(torch.rand(3, SIZE, SIZE - 8 * i, generator=gen))
        boxes = torch.tensor([[8.0, 10.0, 60.0, 50.0], [40.0, 30.0, 85.0, 80.0]])
        masks = torch.zeros(2, SIZE, SIZE - 8 * i, dtype=torch.uint8)
        masks[0, 10:50, 8:60] = 1
        masks[1, 30:80, 40:85] = 1
        targets.append({"boxes": boxes, "labels": torch.tensor([1, 3]), "masks": masks})
    return images, targets


def _step(model, step: int = 0) -> tuple[dict, dict]:
    """(losses, weight gradients) of one training step, proposals sampled alike."""
    set_step(model, step)
    torch.manual_seed(1)
    losses = model(*_batch())
    model.zero_grad(set_to_none=True)
    sum(losses.values()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads


def _assert_same_step(lean, plain, steps: int = 1) -> None:
    for step in range(steps):
        (la, ga), (lb, gb) = _step(lean, step), _step(plain, step)
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la), (la, lb)
        assert ga.keys() == gb.keys() and len(ga) > 10
        assert all(torch.equal(ga[k], gb[k]) for k in ga), [
            k for k in ga if not torch.equal(ga[k], gb[k])
        ]


@pytest.mark.parametrize("arch", ["maskrcnn", "fasterrcnn"])
def test_losses_and_gradients_are_torchvisions_bit_for_bit(arch: str) -> None:
    lean, plain = _models(arch)
    assert type(lean).__name__ == {"maskrcnn": "LeanMaskRCNN", "fasterrcnn": "LeanFasterRCNN"}[arch]
    assert type(plain).__name__ == {"maskrcnn": "MaskRCNN", "fasterrcnn": "FasterRCNN"}[arch]
    assert type(lean.backbone.fpn) is LeanFeaturePyramidNetwork
    assert lean.state_dict().keys() == plain.state_dict().keys()
    _assert_same_step(lean, plain)


@pytest.mark.slow
def test_with_dropit_the_draws_and_gradients_are_the_same() -> None:
    """quant 4-bit draws by the order of its packs: the lean forward packs in the same order."""
    lean, plain = _models(dropit=QUANT)
    _assert_same_step(lean, plain, steps=2)


def test_with_checkpointed_stages_the_gradients_are_the_same() -> None:
    stages = ["backbone.body.layer3", "backbone.body.layer4"]
    lean, plain = _models(activation_checkpointing=stages, dropit=QUANT)
    _assert_same_step(lean, plain)


def test_from_scratch_with_batchnorm_and_v2_heads_the_gradients_are_the_same() -> None:
    lean, plain = _models(norm="bn", trainable_layers=5, heads="v2")
    _assert_same_step(lean, plain)


def test_under_cpu_autocast_the_losses_and_gradients_are_torchvisions(monkeypatch) -> None:
    """bf16 autocast: the poolers take their image-by-image path and the step is still exact."""
    pooled = []
    by_image = LeanMultiScaleRoIAlign._pool_by_image
    monkeypatch.setattr(
        LeanMultiScaleRoIAlign,
        "_pool_by_image",
        lambda self, *a, cast: pooled.append((self, cast)) or by_image(self, *a, cast=cast),
    )
    lean, plain = _models()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_step(lean, plain)
    heads = lean.roi_heads
    assert pooled == [(heads.box_roi_pool, True), (heads.mask_roi_pool, True)]
    for model in (lean, plain):
        model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = lean(_batch()[0]), plain(_batch()[0])
    assert len(pooled) == 4 and pooled[2][1] and all(d["masks"].numel() for d in a)
    assert all(torch.equal(da[k], db[k]) for da, db in zip(a, b, strict=True) for k in da)


def _pyramid_and_boxes(sides: list[list[float]]) -> tuple[OrderedDict, list]:
    """P2-P5 of a 512-px batch (one image per entry of ``sides``) and square boxes of those
    sides: 20 px pools from P2, 150 from P3, 300 from P4, 480 from P5."""
    gen = torch.Generator().manual_seed(0)
    maps = OrderedDict(
        (str(i), torch.randn(len(sides), 4, 128 >> i, 128 >> i, generator=gen)) for i in range(4)
    )
    boxes = []
    for image_sides in sides:
        side = torch.tensor(image_sides).reshape(-1, 1)
        corner = torch.rand(len(image_sides), 2, generator=gen) * (512 - side)
        boxes.append(torch.cat([corner, corner + side], 1))
    return maps, boxes


@pytest.mark.parametrize(
    "sides",
    [
        [[20, 150, 300, 480, 25], [], [480, 20, 20, 150]],  # every level, an image without RoIs
        [[20, 30], [150, 40]],  # P4 and P5 read by no RoI
        [[], []],  # no RoI at all
    ],
)
def test_under_autocast_the_pooler_copies_one_image_at_a_time_bit_for_bit(sides) -> None:
    """roi_align pools in fp32 under autocast: torchvision casts each whole level first, the lean
    pooler one image of the finest level at a time (or as many of a coarser level as make that
    size); the pooled maps and the levels' gradients are the same bits."""
    maps, boxes = _pyramid_and_boxes(sides)
    images = len(sides)
    runs = []
    for cls in (LeanMultiScaleRoIAlign, MultiScaleRoIAlign):
        pooler = cls(["0", "1", "2", "3"], 7, 2)
        pyramid = OrderedDict((k, v.bfloat16().requires_grad_()) for k, v in maps.items())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, seen = allocations(partial(pooler, pyramid, boxes, [(512, 512)] * images))
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * grad.to(out.dtype)).sum().backward()
        runs.append((out, [v.grad for v in pyramid.values()], seen.largest))
    (out, grads, largest), (ref_out, ref_grads, ref_largest) = runs
    assert out.dtype == torch.bfloat16 and out.shape == (sum(map(len, sides)), 4, 7, 7)
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))
    for g, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(g.view(torch.int16), ref.view(torch.int16))
    one_image = 4 * 128 * 128 * 4  # P2 of one image in fp32
    if any(sides):
        assert largest == one_image and ref_largest == images * one_image


def test_in_fp32_the_pooler_holds_no_more_than_torchvisions() -> None:
    """Without autocast each level is pooled whole; its gradient is the kernel's own tensor
    (a copy into a second whole-level map raised the R50 step's peak by 57 MB at 800 px)."""
    maps, boxes = _pyramid_and_boxes([[20, 150, 300, 480, 25], [480, 20, 20, 150]])
    runs = []
    for cls in (LeanMultiScaleRoIAlign, MultiScaleRoIAlign):
        pyramid = OrderedDict((k, v.clone().requires_grad_()) for k, v in maps.items())
        pooler = cls(["0", "1", "2", "3"], 7, 2)
        out, forward = allocations(partial(pooler, pyramid, boxes, [(512, 512)] * 2))
        _, backward = allocations(partial(out.sum().backward))
        runs.append((forward.peak, backward.peak, [v.grad for v in pyramid.values()]))
    (fwd, bwd, grads), (ref_fwd, ref_bwd, ref_grads) = runs
    assert all(map(torch.equal, grads, ref_grads))
    assert fwd <= ref_fwd and bwd <= ref_bwd


def test_under_autocast_levels_of_mixed_dtypes_pool_as_torchvisions() -> None:
    """A level autocast left in fp32 beside bf16 ones: every level pools in fp32, as in
    torchvision's, and the result takes the first level's dtype."""
    maps, boxes = _pyramid_and_boxes([[20, 150, 300, 480], [25, 160]])
    runs = []
    for cls in (LeanMultiScaleRoIAlign, MultiScaleRoIAlign):
        pyramid = OrderedDict(
            (k, v.to(torch.float32 if k == "0" else torch.bfloat16).requires_grad_())
            for k, v in maps.items()
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cls(["0", "1", "2", "3"], 7, 2)(pyramid, boxes, [(512, 512)] * 2)
        out.sum().backward()
        runs.append((out, [v.grad for v in pyramid.values()]))
    (out, grads), (ref, ref_grads) = runs
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert all(
        g.dtype == r.dtype and torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_under_compress_saved_the_pooler_keeps_its_rois_exact(dtype) -> None:
    """Saved-tensor hooks pack every float tensor saved for backward; the lean pooler saves its
    RoIs (coordinates, where a 4-bit code would move the bilinear weights) as integers, which
    they leave alone, under autocast and in fp32."""
    maps, boxes = _pyramid_and_boxes([[20, 150, 300, 480], [25, 160]])
    grads = []
    for packing in (False, True):
        pooler = LeanMultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
        pyramid = OrderedDict((k, v.to(dtype).requires_grad_()) for k, v in maps.items())
        block = CompressSaved(bits=4, min_bytes=0) if packing else contextlib.nullcontext()
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32)
        with block, amp:
            pooler(pyramid, boxes, [(512, 512)] * 2).float().sum().backward()
        if packing:
            assert block.packs == 0
        grads.append([v.grad for v in pyramid.values()])
    assert all(map(torch.equal, *grads))


def test_eval_detections_are_torchvisions() -> None:
    lean, plain = _models()
    for model in (lean, plain):
        _step(model)  # some training first: detections come from trained-a-little weights
        model.eval()
    with torch.no_grad():
        a, b = lean(_batch()[0]), plain(_batch()[0])
    assert len(a) == len(b) == 2
    for da, db in zip(a, b, strict=True):
        assert da.keys() == db.keys() == {"boxes", "labels", "scores", "masks"}
        assert all(torch.equal(da[k], db[k]) for k in da)


def test_lean_detector_makes_a_torchvision_model_lean_in_place() -> None:
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    torch.manual_seed(0)
    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3)
    keys = model.state_dict().keys()
    assert lean_detector(model) is model
    assert type(model) is LeanMaskRCNN and isinstance(model, MaskRCNN)
    assert isinstance(model.roi_heads.mask_roi_pool, LeanMultiScaleRoIAlign)
    assert type(model.backbone).__name__ == "LeanBackboneWithFPN"
    assert type(model.rpn.head).__name__ == "LeanRPNHead"
    assert model.state_dict().keys() == keys
    assert copy.deepcopy(model).__class__ is LeanMaskRCNN  # and it pickles by name
    with pytest.raises(TypeError, match="nn.Module"):
        lean_detector("model")


def test_the_pyramid_is_released_before_the_mask_head_runs() -> None:
    """At the mask head's call nothing holds P2-P6 but what backward keeps: the lean forward's
    pyramid is gone but for P5, which the max pool making P6 saves; torchvision's is alive."""
    alive = {}
    for name, model in zip(("lean", "torchvision"), _models(dropit=QUANT), strict=True):
        refs: dict = {}
        model.backbone.fpn.register_forward_hook(
            lambda m, a, out, refs=refs: refs.update((k, weakref.ref(v)) for k, v in out.items())
        )
        model.roi_heads.mask_head.register_forward_pre_hook(
            lambda m, a, refs=refs, name=name: alive.__setitem__(
                name, [k for k, r in refs.items() if r() is not None]
            )
        )
        _step(model)
    assert alive == {"lean": ["3"], "torchvision": ["0", "1", "2", "3", "pool"]}


@pytest.mark.parametrize("dropit", [False, True], ids=["plain", "quant4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_rpn_heads_map_gradient_is_made_once_bit_for_bit(monkeypatch, dropit, dtype) -> None:
    """The predictors' input gradients: torchvision makes one whole map per predictor and adds
    them; the lean head makes one map, an image at a time (SPLIT_BYTES of one byte: every chunk
    one image of 8). The same bits, and at the backward's peak (the head's conv left out, so
    that the peak is the predictors') one map fewer, less the predictors' output gradients and
    a few images' scratch (the CPU kernels' own, which depends on their threads)."""
    monkeypatch.setattr(ops, "SPLIT_BYTES", 1)
    monkeypatch.setitem(ops.CHUNK_BYTES, "cpu", 1)  # the DropIT predictors' rebuilds by image too
    torch.manual_seed(0)
    plain = RPNHead(128, 3)  # 128 channels: the predictors' 15 output ones small beside, as at 256
    plain.conv = torch.nn.Identity()
    lean = copy.deepcopy(plain)
    lean.__class__ = LeanRPNHead
    made = []
    monkeypatch.setattr(_ReadersInputGrad, "backward", _recording(_ReadersInputGrad.backward, made))
    runs = []
    for head in (lean, plain):
        if dropit:
            to_dropit(head, strategy="quant", bits=4)
            set_step(head, 0)
        gen = torch.Generator().manual_seed(1)
        maps = [torch.randn(8, 128, 16 >> i, 16 >> i, generator=gen) for i in range(2)]
        maps = [m.to(dtype).requires_grad_() for m in maps]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
            logits, boxes = head(maps)
        outs = logits + boxes
        weights = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        loss = sum((o * w).float().sum() for o, w in zip(outs, weights, strict=True))
        _, seen = allocations(partial(loss.backward))
        grads = [m.grad for m in maps] + [p.grad for p in head.parameters()]
        runs.append((grads, seen.peak))
    (grads, peak), (ref_grads, ref_peak) = runs
    assert len(made) == 2  # a level each, in the lean head only
    assert len(grads) == 6 and all(
        g.dtype == r.dtype for g, r in zip(grads, ref_grads, strict=True)
    )
    assert all(map(torch.equal, grads, ref_grads))
    one_map = 8 * 128 * 16 * 16 * dtype.itemsize  # P2's gradient
    assert ref_peak - peak >= one_map // 2, (peak, ref_peak)


def test_the_rpn_heads_map_gradient_is_made_once_only_for_1x1_predictors() -> None:
    """An image's input gradient is the batch's bit for bit for a 1x1 conv; a strided 3x3
    conv's is not always (the CPU picks another kernel), so other predictors keep autograd's."""
    t = torch.randn(2, 8, 6, 6, requires_grad=True)
    assert _one_input_grad(t, (torch.nn.Conv2d(8, 3, 1), torch.nn.Conv2d(8, 12, 1)))
    for odd in (torch.nn.Conv2d(8, 3, 3, padding=1), torch.nn.Conv2d(8, 3, 1, stride=2)):
        assert not _one_input_grad(t, (odd, torch.nn.Conv2d(8, 12, 1)))
    assert not _one_input_grad(t.detach(), (torch.nn.Conv2d(8, 3, 1),) * 2)
    with torch.no_grad():
        assert not _one_input_grad(t, (torch.nn.Conv2d(8, 3, 1),) * 2)


def _recording(backward, calls: list):
    def recorded(ctx, *grads):
        calls.append(len(grads))
        return backward(ctx, *grads)

    return recorded


def test_the_rpn_head_makes_torchvisions_step_with_its_map_gradient_by_image(monkeypatch) -> None:
    """The whole detector, with every conv's backward and the RPN head's map gradient by
    image: torchvision's losses and gradients bit for bit."""
    monkeypatch.setattr(ops, "SPLIT_BYTES", 1)
    monkeypatch.setitem(ops.CHUNK_BYTES, "cpu", 1)
    _assert_same_step(*_models())


def test_the_rpn_head_drops_each_levels_map_before_the_next_levels_conv() -> None:
    """With DropIT the predictors keep packs, so only Python could hold a level's conv map: the
    lean head lets it go, torchvision's keeps it while the next level's is made."""
    alive = {}
    for name, model in zip(("lean", "torchvision"), _models(dropit=QUANT), strict=True):
        head = model.rpn.head
        assert type(head).__name__ == {"lean": "LeanRPNHead", "torchvision": "RPNHead"}[name]
        maps: list = []
        seen: list = []
        head.conv.register_forward_pre_hook(
            lambda m, a, maps=maps, seen=seen: seen.append(sum(r() is not None for r in maps))
        )
        head.conv.register_forward_hook(lambda m, a, out, maps=maps: maps.append(weakref.ref(out)))
        _step(model)
        alive[name] = seen
    assert alive["lean"] == [0] * 5 and alive["torchvision"] == [0] + [1] * 4


def test_the_fpn_drops_each_input_after_its_lateral_conv() -> None:
    torch.manual_seed(0)
    fpn = LeanFeaturePyramidNetwork([8, 16, 32], 8, extra_blocks=LastLevelMaxPool())
    maps = OrderedDict(
        (str(i), torch.randn(1, c, 32 >> i, 32 >> i)) for i, c in enumerate([8, 16, 32])
    )
    refs = [weakref.ref(v) for v in maps.values()]
    seen = []
    for block in fpn.layer_blocks:  # each output conv runs after its level's lateral conv
        block.register_forward_pre_hook(
            lambda m, a: seen.append(sum(r() is not None for r in refs))
        )
    handed = ConsumableMaps(maps)
    del maps
    with torch.no_grad():  # no conv saves its input: only Python could hold them
        out = fpn(handed)
    assert seen == [2, 1, 0] and len(handed) == 0 and list(out) == ["0", "1", "2", "pool"]
    # a plain dict is the caller's: left whole
    plain = OrderedDict(
        (str(i), torch.randn(1, c, 32 >> i, 32 >> i)) for i, c in enumerate([8, 16, 32])
    )
    fpn(plain)
    assert len(plain) == 3


@pytest.mark.parametrize("shape", [(2, 3, 8, 6), (1, 2, 7, 5)])
def test_the_top_down_sum_is_the_upsample_and_add_bit_for_bit(shape) -> None:
    """Exact 2x: broadcast in place; odd sizes: torchvision's upsample, added in place."""
    gen = torch.Generator().manual_seed(0)
    n, c, h, w = shape
    top = torch.randn(n, c, (h + 1) // 2, (w + 1) // 2, generator=gen, requires_grad=True)
    lateral_in = torch.randn(n, c, h, w, generator=gen, requires_grad=True)
    grad = torch.randn(n, c, h, w, generator=gen)
    ref = lateral_in * 1.0 + F.interpolate(top, size=(h, w), mode="nearest")
    ga = torch.autograd.grad(ref, [lateral_in, top], grad)
    ours = add_top_down(lateral_in * 1.0, top)
    gb = torch.autograd.grad(ours, [lateral_in, top], grad)
    assert torch.equal(ours, ref) and all(map(torch.equal, ga, gb))


def test_a_torchvision_fpn_made_lean_keeps_its_class_for_other_extra_blocks() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(FeaturePyramidNetwork([8, 16], 8))
    lean_detector(model)
    assert type(model[0]) is LeanFeaturePyramidNetwork
    gc.collect()

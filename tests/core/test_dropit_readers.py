"""A ReLU keeps a 1-bit mask only where that frees its output: where no plain layer reading the
output keeps it whole (dropit_core.readers), on torchvision's detectors and ResNets."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torchvision.models import resnet18
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from dropit_core import PAPER_EXCLUDE, checkpoint_modules, dropit_record, lean_detector, to_dropit
from dropit_core.layers.relu import DropITReLU
from dropit_core.readers import FLOWS, forward_class, relu_readers


def _mask_rcnn(lean: bool, cls: type = MaskRCNN) -> nn.Module:
    torch.manual_seed(0)
    # trainable_layers=5: the stem trains too, so its ReLU's output is kept for backward
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
    model = cls(backbone, num_classes=3, min_size=64, max_size=64)
    return (lean_detector(model) if lean else model).train()


def _batch():
    gen = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 64, 64, generator=gen) for _ in range(2)]
    boxes = torch.tensor([[4.0, 6.0, 40.0, 44.0], [30.0, 10.0, 60.0, 50.0]])
    masks = torch.zeros(2, 64, 64, dtype=torch.uint8)
    for j, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
        masks[j, y0:y1, x0:x1] = 1
    target = {"boxes": boxes, "labels": torch.tensor([1, 2]), "masks": masks}
    return images, [target, dict(target)]


def _relu_outputs_kept_whole(model: nn.Module, forward) -> tuple[list[str], int]:
    """(the converted ReLUs whose output storage another node of the graph saves, how many
    converted ReLUs ran): every storage autograd is handed over the forward, counted once."""
    outputs: dict[int, str] = {}
    held = []  # the outputs alive to the end, so that no later tensor reuses their memory

    def record(module, args, output):
        held.append(output)
        outputs.setdefault(output.untyped_storage().data_ptr(), names[module])

    names = {m: n for n, m in model.named_modules()}
    handles = [
        m.register_forward_hook(record) for m in model.modules() if isinstance(m, DropITReLU)
    ]
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = forward()
    finally:
        for h in handles:
            h.remove()
    result.backward()
    return sorted({outputs[p] for p in outputs.keys() & saved}), len(held)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "torchvision"])
def test_no_converted_relu_of_a_mask_rcnn_is_kept_whole_with_the_papers_exclusions(lean) -> None:
    model = to_dropit(_mask_rcnn(lean), strategy="quant", exclude=PAPER_EXCLUDE)
    torch.manual_seed(1)
    kept, ran = _relu_outputs_kept_whole(model, lambda: sum(model(*_batch()).values()))
    assert kept == [] and ran > 0
    converted = {layer.path for layer in dropit_record(model) if layer.kind == "ReLU"}
    # the ReLUs a plain layer reads: the stem's (the max-pool) and the mask predictor's
    assert "backbone.body.relu" not in converted
    assert "roi_heads.mask_predictor.relu" not in converted
    assert {"backbone.body.layer4.1.relu", "rpn.head.conv.0.1"} <= converted
    assert "roi_heads.mask_head.3.1" in converted  # read by the converted conv5_mask


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_no_converted_relu_of_a_resnet_is_kept_whole(block) -> None:
    # torchvision's blocks call one ReLU module two or three times; the stem's ReLU feeds a
    # max-pool, which keeps its input unless it is converted too (pool=True)
    torch.manual_seed(0)
    # a narrow ResNet of Bottlenecks: every stage's first block with a downsample
    model = resnet18() if block == "basic" else ResNet(Bottleneck, [1, 2, 1, 1], width_per_group=16)
    to_dropit(model.train(), strategy="quant", exclude=("conv1", "fc"))
    x = torch.rand(2, 3, 64, 64)
    kept, ran = _relu_outputs_kept_whole(model, lambda: model(x).sum())
    assert kept == [] and ran > 0
    assert type(model.relu) is nn.ReLU
    assert type(model.layer1[0].relu) is DropITReLU
    pooled = to_dropit(resnet18().train(), strategy="quant", exclude=("conv1", "fc"), pool=True)
    assert type(pooled.relu) is DropITReLU  # the converted max-pool keeps one byte a window


def test_the_mask_predictors_relu_stays_plain_where_its_logits_conv_is_excluded() -> None:
    model = to_dropit(_mask_rcnn(lean=True), strategy="quant", exclude=PAPER_EXCLUDE)
    assert type(model.roi_heads.mask_predictor.relu) is nn.ReLU
    assert type(model.roi_heads.mask_predictor.conv5_mask) is not nn.ConvTranspose2d
    # not excluded: both convert; relu="all" keeps a mask on every ReLU selected, as before
    assert type(to_dropit(_mask_rcnn(lean=True)).roi_heads.mask_predictor.relu) is DropITReLU
    forced = to_dropit(_mask_rcnn(lean=True), exclude=PAPER_EXCLUDE, relu="all")
    assert type(forced.roi_heads.mask_predictor.relu) is DropITReLU
    assert type(forced.backbone.body.relu) is DropITReLU


def test_a_faster_rcnn_leaves_only_the_stem_relu_plain() -> None:
    model = _mask_rcnn(lean=True, cls=FasterRCNN)
    to_dropit(model, strategy="quant", exclude=PAPER_EXCLUDE, strict=False)
    plain = [p for p, m in model.named_modules() if type(m) is nn.ReLU]
    assert plain == ["backbone.body.relu"]  # torchvision's box head calls F.relu: no module


def test_a_block_relu_keeps_its_mask_where_another_call_frees_its_output() -> None:
    # The block's last call feeds a plain conv, which keeps that output whole; its first call
    # feeds conv2, whose input only the mask frees: one module, so the mask is kept on both.
    torch.manual_seed(0)
    model = nn.Sequential(BasicBlock(4, 4), nn.Conv2d(4, 2, 1))
    (calls,) = relu_readers(model).values()
    assert calls == (frozenset({"0.conv2"}), frozenset({"1"}))
    to_dropit(model, strategy="quant", exclude=("1",))
    assert type(model[0].relu) is DropITReLU


def test_a_relu_feeding_a_checkpointed_module_stays_plain() -> None:
    # autograd keeps a checkpointed module's input, whatever is inside it
    inner = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU())
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), inner, nn.Conv2d(4, 2, 1))
    checkpoint_modules(model, ["2"])
    assert relu_readers(model, units=["2"])["1"] == (frozenset({"2"}),)
    to_dropit(model, strategy="quant")
    assert type(model[1]) is nn.ReLU


def test_a_relu_whose_readers_are_unknown_is_converted() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.relu, self.head = nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return self.head(self.relu(self.conv(x)))

    model = nn.Sequential(Custom())
    assert relu_readers(model) == {"0.relu": None}
    to_dropit(model, exclude=("0.head",))
    assert type(model[0].relu) is DropITReLU  # a needless mask costs 1 bit an element


def test_every_flow_names_a_class_whose_forward_it_describes() -> None:
    import dropit_core.detection.forward  # noqa: F401  (the lean classes' module)

    for name in FLOWS:
        module, _, qualname = name.rpartition(".")
        cls = getattr(importlib.import_module(module), qualname)
        assert "forward" in cls.__dict__, name
    assert forward_class(nn.Conv2d(1, 1, 1)) is nn.Conv2d


def test_relu_takes_true_false_or_all() -> None:
    with pytest.raises(ValueError, match=r"relu='some' must be true or false, or 'all'"):
        to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), relu="some")
    with pytest.raises(ValueError, match=r"rules\[0\]: option relu=1 must be true or false"):
        to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), rules=[{"relu": 1}])

"""A torchvision R-CNN forward that holds only what it needs: each map goes after its last use
(most of a DropIT step's forward peak is what the detector's Python still holds:
docs/results/archive/untrained_workload.md). The classes are torchvision's own, same modules and
``state_dict`` keys; only ``forward`` changes, the same ops in the same order: bit for bit in
fp32. Only these forwards consume a dict (:class:`ConsumableMaps`); TorchScript is unsupported.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FasterRCNN
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.keypoint_rcnn import KeypointRCNN
from torchvision.models.detection.mask_rcnn import MaskRCNN
from torchvision.models.detection.rpn import RPNHead
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool
from torchvision.ops.poolers import MultiScaleRoIAlign

from dropit_core.detection.pooler import ConsumableMaps, LeanMultiScaleRoIAlign, last_pooler
from dropit_core.layers import conv as ops
from dropit_core.layers.conv import ConvArgs


class _AddUpsampled2x(torch.autograd.Function):
    """``lateral += nearest_upsample(top, 2x)`` in place, without the upsampled map (the top
    map's gradient by the upsample's own backward kernel)."""

    @staticmethod
    def forward(ctx, lateral: Tensor, top: Tensor) -> Tensor:
        n, c, h, w = top.shape
        ctx.sizes = (list(lateral.shape[-2:]), [n, c, h, w])
        grid = lateral.unflatten(3, (w, 2)).unflatten(2, (h, 2))  # n, c, h, 2, w, 2: a view
        grid.add_(top[:, :, :, None, :, None])
        ctx.mark_dirty(lateral)
        return lateral

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ops.aten.upsample_nearest2d_backward(grad, *ctx.sizes, None, None)


def add_top_down(lateral: Tensor, top: Tensor) -> Tensor:
    """``lateral + F.interpolate(top, size=lateral's, mode="nearest")``, in place into
    ``lateral`` (a fresh map nothing else reads), in ``top``'s dtype outside autocast."""
    h, w = lateral.shape[-2:]
    if torch.compiler.is_compiling():
        # Fused by the compiler (no map is made); the in-place add into a strided view broke
        # Inductor's layout code under dynamic shapes (torch 2.14)
        with torch.autocast(lateral.device.type, enabled=False):
            return lateral + F.interpolate(top, size=(h, w), mode="nearest")
    exact_2x = top.dim() == 4 and (h, w) == (2 * top.shape[-2], 2 * top.shape[-1])
    if exact_2x and lateral.dtype == top.dtype and lateral.shape[:2] == top.shape[:2]:
        return _AddUpsampled2x.apply(lateral, top)
    with torch.autocast(lateral.device.type, enabled=False):
        up = F.interpolate(top, size=(h, w), mode="nearest")
    # In place unless the sum promotes (torchvision's out-of-place sum would)
    return lateral + up if up.dtype != lateral.dtype else lateral.add_(up)


class LeanFeaturePyramidNetwork(FeaturePyramidNetwork):
    """torchvision's FPN; each input map goes once its lateral conv has read it, and the top-down
    map is added into the lateral in place (bit for bit torchvision's but under CUDA autocast,
    where each sum stays fp16/bf16)."""

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        names = list(x)
        feats = list(x.values())
        if isinstance(x, ConsumableMaps):
            x.clear()  # ``feats`` is now the maps' only holder here (a plain dict stays as it is)
        # Extra blocks other than torchvision's max pool may read the body's maps (P6/P7 read C5)
        release = self.extra_blocks is None or type(self.extra_blocks) is LastLevelMaxPool
        read = feats.pop if release else feats.__getitem__  # popped: a map goes once read
        last = len(feats) - 1
        inner = self.get_result_from_inner_blocks(read(last), -1)
        results = [self.get_result_from_layer_blocks(inner, -1)]
        for idx in range(last - 1, -1, -1):
            lateral = self.get_result_from_inner_blocks(read(idx), idx)
            inner = add_top_down(lateral, inner)
            del lateral
            results.insert(0, self.get_result_from_layer_blocks(inner, idx))
        del inner  # backward keeps what it needs of it (the layer conv's saved input or pack)
        if self.extra_blocks is not None:
            results, names = self.extra_blocks(results, feats, names)
        return OrderedDict(zip(names, results, strict=True))


class LeanBackboneWithFPN(BackboneWithFPN):
    """torchvision's ResNet + FPN backbone; the body's C2-C5 are handed to the FPN to consume."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return self.fpn(ConsumableMaps(self.body(x)))


class LeanRPNHead(RPNHead):
    """torchvision's RPN head; each level's conv map goes once its two predictors have read it,
    and its gradient is made once (:class:`_ReadersInputGrad`), not once per predictor."""

    def forward(self, x: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        logits, bbox_reg = [], []
        for feature in x:
            t = self.conv(feature)
            readers = (self.cls_logits, self.bbox_pred)
            if _one_input_grad(t, readers):
                # The predictors read a detached alias: their nodes make only their weights'
                # gradients, the map's comes from the Function (one pack still: both read it).
                seen = t.detach()
                outs = [reader(seen) for reader in readers]
                args = tuple(
                    ConvArgs(r.stride, r.padding, r.dilation, False, (0, 0), r.groups)
                    for r in readers
                )
                weights = tuple(reader.weight for reader in readers)
                cls, box = _ReadersInputGrad.apply(t, weights, args, *outs)
                del seen, outs
            else:
                cls, box = self.cls_logits(t), self.bbox_pred(t)
            logits.append(cls)
            bbox_reg.append(box)
            del t  # backward keeps what it needs of it (the predictors' saved input or pack)
        return logits, bbox_reg


def _one_input_grad(t: Tensor, readers: tuple[nn.Module, ...]) -> bool:
    """Whether :class:`_ReadersInputGrad` makes the readers' input gradient: eagerly, for 1x1
    stride-1 convs (bit for bit an image at a time), on a map autocast does not cast."""
    if not (t.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return False
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.dtype != torch.get_autocast_dtype(device):
        return False
    return t.dim() == 4 and all(
        isinstance(m, nn.Conv2d)
        and (tuple(m.kernel_size), tuple(m.stride), tuple(m.padding)) == ((1, 1), (1, 1), (0, 0))
        and m.padding_mode == "zeros"
        for m in readers
    )


class _ReadersInputGrad(torch.autograd.Function):
    """The identity on the outputs of two convs that read one map ``t`` (through a detached
    alias); its backward makes ``t``'s gradient into one map a chunk (``ops.SPLIT_BYTES``) at a
    time, where autograd would make each conv's and add them (at P2, the step's peak): the first
    reader's term, then the second's added into it, autograd's sum bit for bit."""

    @staticmethod
    def forward(ctx, t: Tensor, weights: tuple[Tensor, ...], args: tuple, *outs: Tensor):
        ctx.weights, ctx.args, ctx.t_shape, ctx.t_dtype = weights, args, t.shape, t.dtype
        return tuple(out.view_as(out) for out in outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):
        terms = [
            (g.contiguous(), w.to(g.dtype), a)
            for g, w, a in zip(grads, ctx.weights, ctx.args, strict=True)
            if g is not None
        ]
        if not terms or not ctx.needs_input_grad[0]:
            return None, None, None, *grads
        shape, dtype = ctx.t_shape, ctx.t_dtype
        batch, image = shape[0], shape[1:]
        chunk = max(1, ops.SPLIT_BYTES // max(math.prod(image) * terms[0][0].element_size(), 1))

        def term(k: int, i: int, j: int) -> Tensor:
            g, w, a = terms[k]
            return ops.conv_input_grad(g[i:j], w, (j - i, *image), a).to(dtype)

        if chunk >= batch:  # one chunk: the first term is the gradient
            gt = term(0, 0, batch)
            for k in range(1, len(terms)):
                gt.add_(term(k, 0, batch))
        else:
            gt = terms[0][0].new_empty(shape, dtype=dtype)
            for i in range(0, batch, chunk):
                j = min(i + chunk, batch)
                gt[i:j].copy_(term(0, i, j))
                for k in range(1, len(terms)):
                    gt[i:j].add_(term(k, i, j))
        return gt, None, None, *grads


class LeanGeneralizedRCNN(GeneralizedRCNN):
    """torchvision's R-CNN wrapper; it hands the pyramid to the heads (the last pooler drops it)."""

    def forward(self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None):
        if self.training:
            _check_target_boxes(targets)
        original_sizes = []
        for image in images:
            if image.dim() < 2:
                raise ValueError(
                    f"an image must have at least 2 dimensions (H, W last), got {image.shape}"
                )
            original_sizes.append((image.shape[-2], image.shape[-1]))
        batch, targets = self.transform(images, targets)
        _check_degenerate_boxes(targets)
        features = self.backbone(batch.tensors)
        if isinstance(features, Tensor):
            features = OrderedDict([("0", features)])
        features = ConsumableMaps(features, last_pooler(self.roi_heads))
        # The heads read the padded batch's shape alone (the anchors' image size): a stand-in of
        # that shape (one element) lets the pixels go (unless the stem conv trains and keeps them).
        stand_in = batch.tensors.new_empty(()).expand(batch.tensors.shape)
        batch = ImageList(stand_in, batch.image_sizes)
        proposals, proposal_losses = self.rpn(batch, features, targets)
        detections, detector_losses = self.roi_heads(
            features, proposals, batch.image_sizes, targets
        )
        del features
        detections = self.transform.postprocess(detections, batch.image_sizes, original_sizes)
        return self.eager_outputs({**detector_losses, **proposal_losses}, detections)


def _check_target_boxes(targets: list[dict[str, Tensor]] | None) -> None:
    """Training needs targets whose ``boxes`` are [N, 4] tensors."""
    if targets is None:
        raise ValueError("targets should not be None in training mode")
    for target in targets:
        boxes = target["boxes"]
        if not isinstance(boxes, Tensor):
            raise TypeError(f"target boxes must be a Tensor, got {type(boxes).__name__}")
        if boxes.dim() != 2 or boxes.shape[-1] != 4:
            raise ValueError(f"target boxes must have shape [N, 4], got {list(boxes.shape)}")


def _check_degenerate_boxes(targets: list[dict[str, Tensor]] | None) -> None:
    """Refuse a box of zero or negative width or height (after the transform's resize)."""
    for index, target in enumerate(targets or []):
        boxes = target["boxes"]
        bad = boxes[:, 2:] <= boxes[:, :2]
        if bad.any():
            first = boxes[bad.any(dim=1)][0].tolist()
            raise ValueError(
                f"every box needs a positive width and height: target {index} has {first}"
            )


class LeanFasterRCNN(LeanGeneralizedRCNN, FasterRCNN):
    """torchvision's Faster R-CNN with the lean forward."""


class LeanMaskRCNN(LeanGeneralizedRCNN, MaskRCNN):
    """torchvision's Mask R-CNN with the lean forward."""


class LeanKeypointRCNN(LeanGeneralizedRCNN, KeypointRCNN):
    """torchvision's Keypoint R-CNN with the lean forward."""


# torchvision's class -> its lean form (a subclass: isinstance checks keep working)
_LEAN: dict[type, type] = {
    FeaturePyramidNetwork: LeanFeaturePyramidNetwork,
    BackboneWithFPN: LeanBackboneWithFPN,
    MultiScaleRoIAlign: LeanMultiScaleRoIAlign,
    RPNHead: LeanRPNHead,
    FasterRCNN: LeanFasterRCNN,
    MaskRCNN: LeanMaskRCNN,
    KeypointRCNN: LeanKeypointRCNN,
    GeneralizedRCNN: LeanGeneralizedRCNN,
}


def lean_fpn(model: nn.Module) -> nn.Module:
    """Make every torchvision ``FeaturePyramidNetwork`` of ``model`` lean, in place; returns it."""
    for module in model.modules():
        if type(module) is FeaturePyramidNetwork:
            module.__class__ = LeanFeaturePyramidNetwork
    return model


def lean_forward(model: nn.Module, fpn: bool = True) -> nn.Module:
    """Give every torchvision detector, ResNet-FPN backbone, FPN, RPN head and RoI pooler of
    ``model`` its lean forward, in place (its class to a subclass); returns ``model``.
    ``fpn=False`` leaves the FPNs torchvision's."""
    for module in model.modules():
        cls = type(module)
        if cls in _LEAN and (fpn or cls is not FeaturePyramidNetwork):
            module.__class__ = _LEAN[cls]
    return model

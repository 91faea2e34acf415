"""ResNet-FPN backbones: ImageNet weights from torchvision or a local file, norm, frozen stages."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torchvision.models import WeightsEnum, resnet
from torchvision.models.detection.backbone_utils import BackboneWithFPN, _resnet_fpn_extractor
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool
from torchvision.ops.misc import FrozenBatchNorm2d

from dropit_core.detection import FrozenBatchNorm2d as LeanFrozenBatchNorm2d
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.fpn import lean_fpn
from rcnn_dropit.models.weights import load_state_dict_file, load_strict

_RESNETS = {
    "resnet18": (resnet.resnet18, resnet.ResNet18_Weights.IMAGENET1K_V1),
    "resnet34": (resnet.resnet34, resnet.ResNet34_Weights.IMAGENET1K_V1),
    "resnet50": (resnet.resnet50, resnet.ResNet50_Weights.IMAGENET1K_V1),
    "resnet101": (resnet.resnet101, resnet.ResNet101_Weights.IMAGENET1K_V1),
}
GN_GROUPS = 32  # detectron2's and the GroupNorm paper's


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm of 32 groups, the ``norm_layer`` of ``model.norm: gn`` (and of the v2 heads
    under ``model.head_norm: gn``)."""
    if channels % GN_GROUPS:
        raise UsageError(
            f"GroupNorm: {channels} channels do not split into {GN_GROUPS} groups; a width "
            f"set in model (fpn_channels, mask_head_channels, the backbone's) must be a "
            f"multiple of {GN_GROUPS}"
        )
    return nn.GroupNorm(GN_GROUPS, channels)


_NORMS = {"frozen_bn": LeanFrozenBatchNorm2d, "bn": nn.BatchNorm2d, "gn": group_norm}
HEAD_NORMS = {"bn": nn.BatchNorm2d, "gn": group_norm}  # model.head_norm: FPN and v2 heads
# model.frozen_bn: which FrozenBatchNorm2d a frozen_bn backbone gets
_FROZEN = {"lean": LeanFrozenBatchNorm2d, "torchvision": FrozenBatchNorm2d}
FPNS = ("lean", "torchvision")  # model.fpn


def build_backbone(
    name: str,
    norm: str = "frozen_bn",
    trainable_layers: int = 3,
    pretrained: bool = False,
    weights_path: str | Path | None = None,
    fpn_channels: int = 256,
    frozen_bn: str = "lean",
    fpn: str = "lean",
    fpn_norm: str | None = None,
) -> BackboneWithFPN:
    """ResNet body + FPN with the first stages frozen as torchvision does (trainable 0..5).

    ``norm``: the body's norm, ``frozen_bn`` (the pretrained recipe), ``bn`` or ``gn`` (32
    groups). ``fpn_norm``: None (torchvision's v1 FPN, convs with a bias) or a norm of
    :data:`HEAD_NORMS` after each FPN conv (torchvision's ``*_fpn_v2``: ``bn``).

    ``frozen_bn`` picks the frozen norm's form: "lean" keeps the input's dtype under autocast
    (dropit_core.FrozenBatchNorm2d), "torchvision" promotes to fp32 (only to measure against).
    ``fpn`` likewise: "lean" keeps the FPN's top-down path in the features' dtype under CUDA
    autocast (rcnn_dropit.models.fpn), "torchvision" runs it in fp32.
    """
    if name not in _RESNETS:
        raise UsageError(f"model.backbone: '{name}' is not one of {', '.join(_RESNETS)}")
    if norm not in _NORMS:
        raise UsageError(f"model.norm: '{norm}' is not one of {', '.join(_NORMS)}")
    if not 0 <= trainable_layers <= 5:
        raise UsageError(f"model.trainable_layers: {trainable_layers} is not in 0..5")
    if frozen_bn not in _FROZEN:
        raise UsageError(f"model.frozen_bn: '{frozen_bn}' is not one of {', '.join(_FROZEN)}")
    if fpn not in FPNS:
        raise UsageError(f"model.fpn: '{fpn}' is not one of {', '.join(FPNS)}")
    if fpn_norm is not None and fpn_norm not in HEAD_NORMS:
        raise UsageError(f"model.head_norm: '{fpn_norm}' is not one of {', '.join(HEAD_NORMS)}")
    fpn_norm_layer = HEAD_NORMS[fpn_norm] if fpn_norm is not None else None
    if norm == "gn" and pretrained and weights_path is None:
        raise UsageError(
            "model.pretrained_backbone: torchvision's ImageNet weights are a BatchNorm ResNet's; "
            "model.norm gn has no BatchNorm to load them into (train from scratch, or give a "
            "GroupNorm ResNet's weights as model.backbone_weights)"
        )
    factory, enum = _RESNETS[name]
    norm_layer = _FROZEN[frozen_bn] if norm == "frozen_bn" else _NORMS[norm]
    body = factory(weights=None, norm_layer=norm_layer)
    if weights_path is not None:
        state = load_state_dict_file(weights_path, "model.backbone_weights")
        # the classifier is dropped by the FPN extractor, so a body-only file is fine too
        load_strict(body, state, "model.backbone_weights", str(weights_path), ignore_prefix="fc.")
    elif pretrained:
        body.load_state_dict(_download(enum, name))
    # torchvision's extractor freezes the stages; its FPN width is fixed at 256
    backbone = _resnet_fpn_extractor(body, trainable_layers, norm_layer=fpn_norm_layer)
    if fpn_channels != backbone.out_channels:
        backbone = BackboneWithFPN(
            body,
            {f"layer{k}": str(k - 1) for k in range(1, 5)},
            [body.inplanes // 8 * 2**i for i in range(4)],  # channels of layer1..layer4
            fpn_channels,
            extra_blocks=LastLevelMaxPool(),
            norm_layer=fpn_norm_layer,
        )
    return lean_fpn(backbone) if fpn == "lean" else backbone


def _download(enum: WeightsEnum, name: str) -> dict[str, torch.Tensor]:
    """torchvision's ImageNet weights (cached in TORCH_HOME), with an offline hint on failure."""
    try:
        return enum.get_state_dict(progress=False, check_hash=True)
    except Exception as err:  # urllib/SSL/OS/hash errors all mean the same to the user
        raise UsageError(
            f"model.pretrained_backbone: the ImageNet weights of {name} ({enum.url}) could not be "
            f"downloaded ({type(err).__name__}: {err}); download the file elsewhere and set "
            "model.backbone_weights to the local file"
        ) from err

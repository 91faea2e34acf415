"""ResNet-FPN backbones: ImageNet weights from torchvision or a local file, norm, frozen stages."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torchvision.models import WeightsEnum, resnet
from torchvision.models.detection.backbone_utils import BackboneWithFPN, _resnet_fpn_extractor
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool
from torchvision.ops.misc import FrozenBatchNorm2d

from dropit_core.frozen_norm import FrozenBatchNorm2d as LeanFrozenBatchNorm2d
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.fpn import lean_fpn
from rcnn_dropit.models.weights import load_state_dict_file, load_strict

_RESNETS = {
    "resnet18": (resnet.resnet18, resnet.ResNet18_Weights.IMAGENET1K_V1),
    "resnet34": (resnet.resnet34, resnet.ResNet34_Weights.IMAGENET1K_V1),
    "resnet50": (resnet.resnet50, resnet.ResNet50_Weights.IMAGENET1K_V1),
    "resnet101": (resnet.resnet101, resnet.ResNet101_Weights.IMAGENET1K_V1),
}
_NORMS = {"frozen_bn": LeanFrozenBatchNorm2d, "bn": nn.BatchNorm2d}
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
) -> BackboneWithFPN:
    """ResNet body + FPN with the first stages frozen as torchvision does (trainable 0..5).

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
    backbone = _resnet_fpn_extractor(body, trainable_layers)
    if fpn_channels != backbone.out_channels:
        backbone = BackboneWithFPN(
            body,
            {f"layer{k}": str(k - 1) for k in range(1, 5)},
            [body.inplanes // 8 * 2**i for i in range(4)],  # channels of layer1..layer4
            fpn_channels,
            extra_blocks=LastLevelMaxPool(),
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

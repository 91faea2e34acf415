"""Torchvision Faster/Mask R-CNN builders with ResNet-FPN backbones and DropIT per config."""

from rcnn_dropit.models.backbone import build_backbone
from rcnn_dropit.models.build import apply_dropit, build_model, fitting_exclude, paper_exclude
from rcnn_dropit.models.fpn import LeanFeaturePyramidNetwork, lean_fpn
from rcnn_dropit.models.heads import MLPHead

__all__ = [
    "LeanFeaturePyramidNetwork",
    "MLPHead",
    "apply_dropit",
    "build_backbone",
    "build_model",
    "fitting_exclude",
    "lean_fpn",
    "paper_exclude",
]

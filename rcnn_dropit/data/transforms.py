"""Training-time transforms of (uint8 image, target) pairs; resizing is left to the model."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from rcnn_dropit.errors import UsageError


class Compose:
    """Apply transforms in order, passing the same per-item random generator."""

    def __init__(self, transforms: Sequence) -> None:
        self.transforms = list(transforms)

    def __call__(
        self, image: torch.Tensor, target: dict, rng: random.Random
    ) -> tuple[torch.Tensor, dict]:
        for t in self.transforms:
            image, target = t(image, target, rng)
        return image, target


class RandomHorizontalFlip:
    """Mirror image, boxes and masks left-right with probability ``prob``."""

    def __init__(self, prob: float) -> None:
        if not 0.0 <= prob <= 1.0:
            raise UsageError(f"data.hflip_prob: {prob} is not in [0, 1]")
        self.prob = prob

    def __call__(
        self, image: torch.Tensor, target: dict, rng: random.Random
    ) -> tuple[torch.Tensor, dict]:
        # draw even when prob is 0 or 1 so later random transforms see the same stream
        if rng.random() >= self.prob:
            return image, target
        return hflip(image, target)


def hflip(image: torch.Tensor, target: dict) -> tuple[torch.Tensor, dict]:
    """Mirror left-right; a box [x1, x2) over pixel columns maps to [W - x2, W - x1)."""
    width = image.shape[-1]
    target = dict(target)
    boxes = target["boxes"].clone()
    boxes[:, [0, 2]] = width - target["boxes"][:, [2, 0]]
    target["boxes"] = boxes
    if "masks" in target:
        target["masks"] = target["masks"].flip(-1)
    return image.flip(-1), target


def to_float(image: torch.Tensor) -> torch.Tensor:
    """uint8 CHW image to float32 in [0, 1] (float images pass through unchanged)."""
    if image.dtype != torch.uint8:
        return image
    return image.to(torch.float32).div_(255.0)


class ToFloat:
    """uint8 CHW image to float32 in [0, 1]."""

    def __call__(
        self, image: torch.Tensor, target: dict, rng: random.Random
    ) -> tuple[torch.Tensor, dict]:
        return to_float(image), target


def build_transforms(train: bool, hflip_prob: float, as_float: bool = True) -> Compose:
    """Random flip for training, then conversion to float; nothing random for evaluation.

    ``as_float=False`` keeps images uint8: the loaders send them to the device that way
    (4x fewer bytes to copy) and ``images_to_device`` converts them there.
    """
    steps: list = [RandomHorizontalFlip(hflip_prob)] if train else []
    return Compose([*steps, ToFloat()] if as_float else steps)


def images_to_device(images: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Model inputs on `device`: copied as they come (uint8 from the loaders), made float there."""
    return [to_float(img.to(device, non_blocking=True)) for img in images]

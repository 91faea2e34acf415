"""Training-time transforms of (uint8 image, target) pairs; resizing is left to the model."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


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
            raise ValueError(f"data.hflip_prob: {prob} is not in [0, 1]")
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


class ToFloat:
    """uint8 CHW image to float32 in [0, 1]."""

    def __call__(
        self, image: torch.Tensor, target: dict, rng: random.Random
    ) -> tuple[torch.Tensor, dict]:
        return image.to(torch.float32).div_(255.0), target


def build_transforms(train: bool, hflip_prob: float) -> Compose:
    """Random flip for training, then conversion to float; nothing random for evaluation."""
    steps: list = [RandomHorizontalFlip(hflip_prob)] if train else []
    return Compose([*steps, ToFloat()])

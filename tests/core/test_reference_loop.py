"""The README's recipe in the loop torchvision's reference scripts train with (references/
detection's ``train_one_epoch``, 0.25 era): its structure re-written here, the recipe's lines
marked, everything imported from ``dropit_core`` and torchvision alone.

What a user who follows the README meets: the first iteration's losses are the plain run's bit
for bit (the lean forward and DropIT change no forward value in fp32), training and evaluation
run, the step each epoch's iteration hands ``set_step`` counts on across epochs, and the first
step's weight gradients are close to the exact ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.models.detection import maskrcnn_resnet50_fpn

from dropit_core import PAPER_EXCLUDE, dropit_record, lean_detector, set_step, to_dropit

pytestmark = pytest.mark.slow  # trains an R50 Mask R-CNN four steps, twice

SIZE = 64  # px: small enough for two CPU runs of four steps in a few seconds each


def _sample(i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An image with one bright rectangle of class 1 + i % 3 on a noisy background."""
    g = torch.Generator().manual_seed(i)
    image = torch.rand(3, SIZE, SIZE, generator=g) * 0.2
    x0, y0 = 8 + 4 * (i % 3), 10 + 3 * (i % 4)
    x1, y1 = x0 + 24 + 2 * i, y0 + 20 + i
    image[:, y0:y1, x0:x1] += 0.7
    mask = torch.zeros(1, SIZE, SIZE, dtype=torch.uint8)
    mask[:, y0:y1, x0:x1] = 1
    target = {
        "boxes": torch.tensor([[x0, y0, x1, y1]], dtype=torch.float32),
        "labels": torch.tensor([1 + i % 3]),
        "masks": mask,
    }
    return image, target


def _loader() -> list[tuple[list[torch.Tensor], list[dict]]]:
    """Two batches of two images, as the reference's DataLoader hands them (lists)."""
    samples = [_sample(i) for i in range(4)]
    return [tuple(map(list, zip(*samples[i : i + 2], strict=True))) for i in (0, 2)]


def _model(recipe: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=SIZE, max_size=SIZE
    )
    if recipe:  # the README's recipe, as a user pastes it
        model = lean_detector(model)
        model = to_dropit(model, strategy="quant", exclude=PAPER_EXCLUDE, strict=False)
    return model


def _train_one_epoch(model, optimizer, data_loader, epoch: int, recipe: bool, seen: list) -> list:
    """The reference engine's epoch: warm-up in epoch 0, the summed loss, a finite check,
    zero_grad / backward / step; with the recipe, ``set_step`` before each forward."""
    model.train()
    lr_scheduler = None
    if epoch == 0:
        warmup_iters = min(1000, len(data_loader) - 1)
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0 / 1000, total_iters=warmup_iters
        )
    losses_seen = []
    for i, (images, targets) in enumerate(data_loader):
        if recipe:  # the recipe's line: a global step the reference loop does not count itself
            step = epoch * len(data_loader) + i
            set_step(model, step, 0)
            seen.append(step)
        loss_dict = model(images, targets)
        losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()
        assert math.isfinite(loss_value), loss_dict
        losses_seen.append({k: v.detach().clone() for k, v in loss_dict.items()})
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
    return losses_seen


def _run(recipe: bool) -> tuple[torch.nn.Module, list, list]:
    """Two epochs of two iterations with the reference's optimizer settings."""
    model = _model(recipe)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-4)
    loader, seen, losses = _loader(), [], []
    for epoch in range(2):
        losses += _train_one_epoch(model, optimizer, loader, epoch, recipe, seen)
    return model, losses, seen


def _first_gradient(recipe: bool) -> torch.Tensor:
    """Every trainable weight's gradient of the first batch, flattened into one vector."""
    model = _model(recipe).train()
    set_step(model, 0)
    images, targets = _loader()[0]
    sum(model(images, targets).values()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_the_readme_recipe_in_torchvisions_reference_loop() -> None:
    _, plain_losses, _ = _run(recipe=False)
    model, losses, seen = _run(recipe=True)
    summary = dropit_record(model).summary()
    assert "quant" in summary
    # the first forward is the plain one, loss for loss and bit for bit
    assert plain_losses[0].keys() == losses[0].keys()
    for key, value in plain_losses[0].items():
        assert torch.equal(value, losses[0][key]), key
    # 4-bit inputs make the weight gradients approximate: close to the exact ones, not equal
    exact, approx = _first_gradient(False), _first_gradient(True)
    assert not torch.equal(exact, approx)
    assert float(torch.nn.functional.cosine_similarity(exact, approx, dim=0)) > 0.99
    assert all(math.isfinite(float(v)) for step in losses for v in step.values())
    # the step set_step saw counts on across epochs (the draws of a resumed run repeat)
    assert seen == [0, 1, 2, 3]
    cache = model.backbone.body.layer2[0].conv1.dropit_cache
    assert cache.step == 3
    # evaluation: the converted, lean model detects as a torchvision model does
    model.eval()
    with torch.no_grad():
        out = model([_sample(0)[0]])
    assert set(out[0]) == {"boxes", "labels", "scores", "masks"}

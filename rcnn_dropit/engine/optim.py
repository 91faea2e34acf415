"""Optimizer and per-iteration learning-rate schedule, built once, in one place."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rcnn_dropit.errors import UsageError


def scaled_lr(solver, world_size: int) -> float:
    """Base learning rate, linearly scaled to the global batch when solver.auto_scale_lr is set."""
    lr = float(solver.lr)
    if solver.auto_scale_lr:
        lr *= solver.batch_size * world_size / solver.reference_batch
    return lr


def build_optimizer(solver, model: nn.Module, world_size: int = 1) -> torch.optim.Optimizer:
    """SGD (momentum) or AdamW over the trainable parameters of `model`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UsageError("model has no trainable parameters (check model.trainable_layers)")
    lr = scaled_lr(solver, world_size)
    if solver.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=solver.momentum, weight_decay=solver.weight_decay
        )
    if solver.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=solver.weight_decay)
    raise UsageError(f"solver.optimizer: '{solver.optimizer}' is not one of sgd, adamw")


def lr_factor_fn(
    scheduler: str,
    total_iters: int,
    milestones: Sequence[int] = (),
    decay: float = 0.1,
    warmup_iters: int = 0,
    warmup_factor: float = 1.0,
) -> Callable[[int], float]:
    """Multiplier of the base lr after `it` finished iterations: warmup times multistep/cosine."""
    if scheduler not in ("multistep", "cosine"):
        raise UsageError(f"solver.scheduler: '{scheduler}' is not one of multistep, cosine")
    steps = sorted(int(m) for m in milestones)

    def factor(it: int) -> float:
        if scheduler == "multistep":
            value = decay ** bisect.bisect_right(steps, it)
        else:
            value = 0.5 * (1.0 + math.cos(math.pi * min(it, total_iters) / max(total_iters, 1)))
        if it < warmup_iters:
            alpha = it / warmup_iters
            value *= warmup_factor * (1.0 - alpha) + alpha
        return value

    return factor


def build_scheduler(
    solver, optimizer: torch.optim.Optimizer, iters_per_epoch: int, total_iters: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR stepped once per iteration; lr_steps are epochs, converted to iterations here."""
    fn = lr_factor_fn(
        solver.scheduler,
        total_iters=total_iters,
        milestones=[int(e) * iters_per_epoch for e in solver.lr_steps],
        decay=solver.lr_decay,
        warmup_iters=solver.warmup_iters,
        warmup_factor=solver.warmup_factor,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def build_optimizer_and_scheduler(
    solver, model: nn.Module, iters_per_epoch: int, total_iters: int, world_size: int = 1
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The single place where optimizer and scheduler are made (no hidden warmup elsewhere)."""
    optimizer = build_optimizer(solver, model, world_size)
    return optimizer, build_scheduler(solver, optimizer, iters_per_epoch, total_iters)


def total_iterations(epochs: int, iters_per_epoch: int, max_iters: int | None) -> int:
    """epochs * iters_per_epoch, capped by max_iters when given."""
    total = epochs * iters_per_epoch
    if max_iters is not None:
        total = min(total, int(max_iters))
    return total


def short_of_max_iters(epochs: int, iters_per_epoch: int, max_iters: int | None) -> str | None:
    """Why a run stops before its max_iters (the epochs run out first), or None when it does not:
    max_iters only caps, so a config that asks for more than its epochs hold trains fewer."""
    total = epochs * iters_per_epoch
    if max_iters is None or max_iters <= total:
        return None
    need = -(-int(max_iters) // iters_per_epoch)
    return (
        f"solver.max_iters {max_iters} is more than solver.epochs {epochs} x {iters_per_epoch} "
        f"iterations per epoch: training stops at {total}; solver.epochs={need} or more trains "
        f"{max_iters}"
    )

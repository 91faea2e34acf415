"""One training step: forward and backward of each micro-batch, then clipping and the optimizer
step. The trainer adds what a run needs around it (the losses reduced across ranks, the
non-finite guard, the schedule, logging); the memory budget's probe calls it bare. One function,
so that what the budget measures is what trains (detectron2's ``SimpleTrainer.run_step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dropit_core import set_step
from rcnn_dropit.engine.amp import autocast


@dataclass(frozen=True)
class StepOptions:
    """What one training step needs to know of the solver config."""

    batch_size: int  # images per rank and optimizer step
    amp: str = "none"  # none | fp16 | bf16
    nonfinite: str = "stop"  # stop | skip
    clip_grad_norm: float | None = None
    accumulate: int = 1  # micro-batches per optimizer step (gradient accumulation)

    @classmethod
    def from_solver(cls, solver) -> StepOptions:
        """The options of a SolverConfig."""
        return cls(
            solver.batch_size, solver.amp, solver.nonfinite, solver.clip_grad_norm,
            solver.accumulate,
        )  # fmt: skip


def micro_batches(images: list, targets: list, k: int) -> list[tuple[list, list]]:
    """``images`` and ``targets`` in ``k`` consecutive parts as equal as possible (fewer when the
    batch has fewer than ``k`` images, as an epoch's last batch may)."""
    n = len(images)
    parts = max(1, min(k, n))
    bounds = [n * j // parts for j in range(parts + 1)]
    return [(images[a:b], targets[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (gradients kept local until the next synced backward); nothing for a
    plain model."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    images: list[torch.Tensor],
    targets: list[dict],
    options: StepOptions,
    iteration: int,
    rank: int,
    device: torch.device,
    proceed: Callable[[dict[str, torch.Tensor]], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """One optimizer step from ``options.accumulate`` micro-batches, each forward and backward in
    turn, so that only one micro-batch's activations are alive at a time; returns each loss term
    summed over the micro-batches, weighted by their share of the images (detached, fp32).

    ``proceed(losses)``, after the last backward, says whether to clip and step the optimizer
    (the trainer's non-finite guard); when it says no, the gradients are freed. Each loss is
    weighted by its micro-batch's share of the images: the gradients add up to those of the
    whole batch when the losses are means over images (exact for a frozen-norm model up to float
    summation; trainable BatchNorm sees smaller batches). DDP all-reduces gradients only in the
    last micro-batch's backward. DropIT strategies that draw are seeded from (micro-batch,
    rank, layer): a resumed run draws exactly what the uninterrupted one did.
    """
    optimizer.zero_grad(set_to_none=True)
    parts = micro_batches(images, targets, options.accumulate)
    sums: dict[str, torch.Tensor] = {}
    for j, (imgs, tgts) in enumerate(parts):
        set_step(model, (iteration - 1) * options.accumulate + j + 1, rank)
        last = j == len(parts) - 1
        share = len(imgs) / len(images) if len(parts) > 1 else 1.0
        with contextlib.nullcontext() if last else _no_sync(model):
            with autocast(options.amp, device):
                loss_dict = model(imgs, tgts)
            for key, value in loss_dict.items():
                weighted = value.detach().float() * share
                sums[key] = sums[key] + weighted if key in sums else weighted
            loss = sum(loss_dict.values())
            loss = loss * share if len(parts) > 1 else loss  # one part: the bits of no weighting
            (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss_dict, loss
    if proceed is not None and not proceed(sums):
        optimizer.zero_grad(set_to_none=True)
        return sums
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if scaler is not None:
        if options.clip_grad_norm:
            scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
            torch.nn.utils.clip_grad_norm_(params, options.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
    else:
        if options.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, options.clip_grad_norm)
        optimizer.step()
    return sums

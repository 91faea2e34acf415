"""Gradient fidelity: how close the weight gradients of a DropIT model stay to the exact ones.

The forward pass of a DropIT model is bit-identical to the plain one and the step re-seeds the
proposal sampling (workload.step_loss), so the exact and the DropIT step see the same graph and
only the weight gradients of the converted layers differ. Cosine says whether the direction
holds; the norm ratio catches a gradient that keeps its direction but shrinks (random dropping).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from rcnn_dropit.measure.workload import train_step


def weight_grads(model: nn.Module, batch, amp: str = "none") -> dict[str, torch.Tensor]:
    """Weight gradients of the conv/linear layers that received one, by module path."""
    train_step(model, batch, amp)
    return {
        name: m.weight.grad.detach().clone()
        for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.grad is not None
    }


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two gradients (flattened, in float64)."""
    return torch.nn.functional.cosine_similarity(
        a.flatten().double(), b.flatten().double(), dim=0
    ).item()


def norm_ratio(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx|| / ||exact|| (in float64)."""
    return (approx.double().norm() / exact.double().norm().clamp_min(1e-30)).item()


def mean_fidelity(
    grads: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], layers: Iterable[str]
) -> dict[str, Any]:
    """Mean cosine and mean norm ratio (DropIT / exact) over ``layers`` that have a gradient,
    in ``grads``' order, rounded to 4 places as the bench's rows show them."""
    wanted = set(layers)
    names = [name for name in grads if name in wanted]
    cos = [cosine(grads[n], exact[n]) for n in names]
    norm = [norm_ratio(grads[n], exact[n]) for n in names]
    return {
        "grad_cosine": round(sum(cos) / len(cos), 4) if cos else None,
        "grad_norm_ratio": round(sum(norm) / len(norm), 4) if norm else None,
        "converted_layers": len(cos),
    }

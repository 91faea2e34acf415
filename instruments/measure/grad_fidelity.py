"""Gradient fidelity: how close the weight gradients of a setting stay to the exact ones.

The forward of a DropIT model is bit-identical to the plain one and the step re-seeds the
proposal sampling (workload.step_loss), so only the weight gradients of the converted layers
differ (and, under activation checkpointing, those of the recomputed layers, which should not).
Cosine says whether the direction holds, the norm ratio whether it shrinks; the bias over K draws
(:func:`estimator_error`) tells a biased estimator from noise, as docs/benchmark.md says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dropit_core import is_checkpointed, is_dropit, saved_compression, set_step
from instruments.measure.workload import train_step


def layer_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the weight gradients that ``model``'s layers hold now, by module path."""
    return {
        name: m.weight.grad.detach().clone()
        for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.grad is not None
    }


def weight_grads(model: nn.Module, batch, amp: str = "none") -> dict[str, torch.Tensor]:
    """Weight gradients of the conv/linear layers that received one, by module path."""
    train_step(model, batch, amp)
    return layer_grads(model)


def grad_draws(
    model: nn.Module, step: Callable[[], None], draws: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The weight gradients of ``draws`` training steps (``step()`` runs one), each seeded as
    training step k (``dropit_core.set_step``), so every draw is another, reproducible one."""
    for k in range(draws):
        set_step(model, k)
        step()
        yield layer_grads(model)


def approximated_layers(model: nn.Module) -> set[str]:
    """Layers whose weight gradient a setting computes otherwise than the plain step: DropIT
    layers (from a compressed input), every layer inside a checkpointed module (recomputed) and
    every layer inside a module whose forwards compress what they save (``compress_saved``)."""
    named = list(model.named_modules())
    regions = [path for path, m in named if is_checkpointed(m) or saved_compression(m) is not None]

    def inside(path: str) -> bool:
        return any(r == "" or path == r or path.startswith(r + ".") for r in regions)

    return {path for path, m in named if path and (is_dropit(m) or inside(path))}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two gradients (flattened, in float64)."""
    return torch.nn.functional.cosine_similarity(
        a.flatten().double(), b.flatten().double(), dim=0
    ).item()


def norm_ratio(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx|| / ||exact|| (in float64)."""
    return (approx.double().norm() / exact.double().norm().clamp_min(1e-30)).item()


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (in float64)."""
    diff = approx.double() - exact.double()
    return (diff.norm() / exact.double().norm().clamp_min(1e-30)).item()


def _compared(grads: Mapping[str, torch.Tensor], layers: Iterable[str]) -> list[str]:
    wanted = set(layers)
    return [name for name in grads if name in wanted]


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def mean_fidelity(
    grads: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], layers: Iterable[str]
) -> dict[str, Any]:
    """Mean cosine and mean norm ratio (setting / exact) over ``layers`` that have a gradient,
    in ``grads``' order, rounded to 4 places as the bench's rows show them."""
    names = _compared(grads, layers)
    return {
        "grad_cosine": _mean([cosine(grads[n], exact[n]) for n in names]),
        "grad_norm_ratio": _mean([norm_ratio(grads[n], exact[n]) for n in names]),
        "compared_layers": len(names),
    }


def estimator_error(
    draws: Iterable[Mapping[str, torch.Tensor]],
    exact: Mapping[str, torch.Tensor],
    layers: Iterable[str],
) -> dict[str, Any]:
    """Bias and single-draw error of a gradient estimator, each a mean over ``layers``:

    - ``grad_bias``: ``||mean_k g_k - g|| / ||g||`` over the K draws ``g_k`` (one dict each);
    - ``grad_bias_single``: ``||g_k - g|| / ||g||``, averaged over the draws;
    - ``grad_bias_draws``: K.

    For an unbiased estimator ``grad_bias`` is about ``grad_bias_single / sqrt(K)`` (noise that
    averages out); for a deterministic one the two are equal; anything well above
    ``grad_bias_single / sqrt(K)`` is bias. The draws are summed as they come (float64), so only
    one is held at a time.
    """
    sums: dict[str, torch.Tensor] = {}
    single: list[float] = []
    count = 0
    names: list[str] = []
    for grads in draws:
        if count == 0:
            names = _compared(grads, layers)
        single += [relative_error(grads[n], exact[n]) for n in names]
        for n in names:
            if n in sums:
                sums[n].add_(grads[n].double())
            else:  # a copy: the caller's gradient stays as it was
                sums[n] = grads[n].to(torch.float64, copy=True)
        count += 1
    bias = [relative_error(sums[n] / count, exact[n]) for n in names] if count else []
    return {
        "grad_bias": _mean(bias),
        "grad_bias_single": _mean(single),
        "grad_bias_draws": count,
    }

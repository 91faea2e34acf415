"""Gradient fidelity figure (like the DropIT paper's Figure 4): how close DropIT weight gradients
stay to the exact ones, per layer and against gamma, on Mask R-CNN."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dropit_core import to_dropit
from rcnn_dropit.benchmark import EXCLUDE, _weight_grads, build_detector, make_batch

DEFAULT_LAYERS = (
    "backbone.body.layer2.0.conv2",
    "backbone.body.layer4.0.conv2",
    "backbone.fpn.layer_blocks.0.0",
    "roi_heads.box_head.fc6",
    "roi_heads.mask_head.0.0",
)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(
        a.flatten().double(), b.flatten().double(), dim=0
    ).item()


def gradient_study(
    gammas: Sequence[float],
    strategies: Sequence[str],
    layers: Sequence[str] = DEFAULT_LAYERS,
    image_size: int = 512,
    backbone: str = "resnet50",
) -> dict[str, Any]:
    """Cosine similarity to the exact weight gradient for each (strategy, gamma), and the
    gradients of ``layers`` at each setting for the histograms."""
    batch = make_batch(image_size, torch.device("cpu"))
    base = build_detector(False, image_size, backbone=backbone).train()
    exact = _weight_grads(base, batch)
    missing = [name for name in layers if name not in exact]
    if missing:
        raise ValueError(f"layers {missing} have no weight gradient; pick trainable conv/linear")
    result: dict[str, Any] = {"gammas": list(gammas), "layers": list(layers), "cosine": {}}
    grads: dict[str, dict[str, torch.Tensor]] = {"exact": {n: exact[n] for n in layers}}
    for strategy in strategies:
        per_gamma = []
        for gamma in gammas:
            model, record = to_dropit(copy.deepcopy(base), strategy, gamma, exclude=EXCLUDE)
            approx = _weight_grads(model, batch)
            converted = [r.path for r in record if r.kind != "ReLU" and r.path in approx]
            per_layer = {n: _cosine(approx[n], exact[n]) for n in converted}
            per_gamma.append(
                {
                    "gamma": gamma,
                    "mean": sum(per_layer.values()) / len(per_layer),
                    "layers": {n: per_layer[n] for n in layers if n in per_layer},
                }
            )
            grads[f"{strategy} {gamma:g}"] = {n: approx[n] for n in layers}
        result["cosine"][strategy] = per_gamma
    result["_grads"] = grads
    return result


def plot(result: dict[str, Any], out_dir: Path, hist_gamma: float) -> list[Path]:
    """Cosine-vs-gamma curves and per-layer gradient histograms (exact vs DropIT)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for strategy, rows in result["cosine"].items():
        ax.plot([r["gamma"] for r in rows], [r["mean"] for r in rows], marker="o", label=strategy)
    ax.set_xlabel("gamma (fraction dropped)")
    ax.set_ylabel("cosine similarity to exact weight gradient\n(mean over converted layers)")
    ax.grid(alpha=0.3)
    ax.legend()
    curves = out_dir / "grad_cosine_vs_gamma.png"
    fig.tight_layout()
    fig.savefig(curves, dpi=110)

    layers = result["layers"]
    grads = result["_grads"]
    keys = ["exact"] + [k for k in grads if k != "exact" and k.endswith(f" {hist_gamma:g}")]
    fig = Figure(figsize=(3.2 * len(layers), 3))
    FigureCanvasAgg(fig)
    for i, name in enumerate(layers):
        ax = fig.add_subplot(1, len(layers), i + 1)
        for key in keys:
            g = grads[key][name].flatten().float()
            ax.hist(g.numpy(), bins=80, histtype="step", label=key, density=True, log=True)
        ax.set_title(name, fontsize=7)
    fig.axes[0].legend(fontsize=7)
    fig.tight_layout()
    hist = out_dir / "grad_histograms.png"
    fig.savefig(hist, dpi=110)
    return [curves, hist]


def save_json(result: dict[str, Any], path: Path) -> None:
    """The cosine figures as JSON (gradients left out)."""
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "_grads"}, indent=2))

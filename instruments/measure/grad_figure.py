"""Gradient fidelity figure (like the DropIT paper's Figure 4): how close DropIT weight gradients
stay to the exact ones, per layer and against gamma, on Mask R-CNN."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dropit_core import dropit_record, to_dropit
from instruments.measure.grad_fidelity import cosine, norm_ratio, weight_grads
from instruments.measure.workload import Variant, build_detector, check_variants, make_batch
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models import paper_exclude

DEFAULT_LAYERS = (
    "backbone.body.layer2.0.conv2",
    "backbone.body.layer4.0.conv2",
    "backbone.fpn.layer_blocks.0.0",
    "roi_heads.box_head.fc6",
    "roi_heads.mask_head.0.0",
)


def gradient_study(
    gammas: Sequence[float],
    strategies: Sequence[str],
    layers: Sequence[str] = DEFAULT_LAYERS,
    image_size: int = 512,
    backbone: str = "resnet50",
) -> dict[str, Any]:
    """Cosine similarity and norm ratio to the exact weight gradient for each (strategy, gamma),
    and the gradients of ``layers`` at each setting for the histograms."""
    check_variants([Variant(s, g) for s in strategies for g in gammas])  # before the model
    batch = make_batch(image_size, torch.device("cpu"))
    base = build_detector(False, image_size, backbone=backbone).train()
    exact = weight_grads(base, batch)
    missing = [name for name in layers if name not in exact]
    if missing:
        raise UsageError(f"layers {missing} have no weight gradient; pick trainable conv/linear")
    exclude = paper_exclude(base)
    result: dict[str, Any] = {"gammas": list(gammas), "layers": list(layers), "cosine": {}}
    grads: dict[str, dict[str, torch.Tensor]] = {"exact": {n: exact[n] for n in layers}}
    for strategy in strategies:
        per_gamma = []
        for gamma in gammas:
            model = to_dropit(copy.deepcopy(base), strategy, gamma, exclude=exclude)
            approx = weight_grads(model, batch)
            record = dropit_record(model)
            converted = [r.path for r in record if r.kind != "ReLU" and r.path in approx]
            per_layer = {n: cosine(approx[n], exact[n]) for n in converted}
            norms = {n: norm_ratio(approx[n], exact[n]) for n in converted}
            per_gamma.append(
                {
                    "gamma": gamma,
                    "mean": sum(per_layer.values()) / len(per_layer),
                    "norm_ratio": sum(norms.values()) / len(norms),
                    "layers": {n: per_layer[n] for n in layers if n in per_layer},
                    "layers_norm_ratio": {n: norms[n] for n in layers if n in norms},
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
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    cos_ax, norm_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for strategy, rows in result["cosine"].items():
        gammas = [r["gamma"] for r in rows]
        cos_ax.plot(gammas, [r["mean"] for r in rows], marker="o", label=strategy)
        norm_ax.plot(gammas, [r["norm_ratio"] for r in rows], marker="o", label=strategy)
    cos_ax.set_ylabel("cosine similarity to exact weight gradient\n(mean over converted layers)")
    norm_ax.set_ylabel("norm of DropIT / exact weight gradient\n(mean over converted layers)")
    for ax in (cos_ax, norm_ax):
        ax.set_xlabel("gamma (fraction dropped)")
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
    """The cosine and norm-ratio figures as JSON (gradients left out)."""
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "_grads"}, indent=2))

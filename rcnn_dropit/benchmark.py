"""DropIT benchmark on Mask R-CNN R50-FPN: saved-activation bytes, real memory, time, gradients.

Each variant is compared with the baseline side by side in one process: timings alternate
baseline and variant steps and report the ratio of medians, so a noisy shared machine cancels out.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dropit_core import build_strategy, from_dropit, is_dropit, to_dropit
from dropit_core.memory import (
    cuda_peak_mb,
    peak_rss_mb,
    reset_cuda_peak,
    reset_peak_rss,
    rss_mb,
    saved_activations,
    timed,
)
from rcnn_dropit.config import load_config
from rcnn_dropit.models import build_model

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "maskrcnn_baseline.yaml"
EXCLUDE = (
    "backbone.body.conv1",
    "roi_heads.box_predictor",
    "roi_heads.mask_predictor.mask_fcn_logits",
)


@dataclass
class Variant:
    """One DropIT setting to compare with the baseline."""

    strategy: str
    gamma: float
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``mink 0.9 values=int8``."""
        opts = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.strategy} {self.gamma:g}" + (f" {opts}" if opts else "")


def parse_variant(text: str) -> Variant:
    """Parse ``strategy:gamma[:key=value,...]``, e.g. ``mink:0.9:values=int8``."""
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError(f"variant {text!r}: expected strategy:gamma[:key=value,...]")
    try:
        gamma = float(parts[1])
    except ValueError:
        raise ValueError(f"variant {text!r}: gamma {parts[1]!r} is not a number") from None
    options: dict[str, Any] = {}
    for item in ":".join(parts[2:]).split(",") if len(parts) > 2 else []:
        key, _, value = item.partition("=")
        options[key] = _option_value(value)
    return Variant(parts[0], gamma, options)


def _option_value(text: str) -> Any:
    """``4096`` -> int, ``true``/``false`` -> bool, anything else stays text."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def build_detector(
    scratch: bool, image_size: int, rois_per_image: int = 512, backbone: str = "resnet50"
) -> nn.Module:
    """Mask R-CNN R50-FPN with random weights: COCO recipe, or BatchNorm from scratch."""
    overrides = [
        f"model.backbone={backbone}",
        "model.pretrained_backbone=false",
        f"model.min_size={image_size}",
        f"model.max_size={image_size}",
        f"model.box_batch_size_per_image={rois_per_image}",
    ]
    if scratch:
        overrides += ["model.norm=bn", "model.trainable_layers=5"]
    torch.manual_seed(0)
    model, _ = build_model(load_config(_CONFIG, overrides))
    return model


def make_batch(image_size: int, device: torch.device, n_images: int = 2):
    """Images with a few boxes and box-shaped masks, deterministic."""
    gen = torch.Generator().manual_seed(0)
    images, targets = [], []
    s = image_size
    boxes = torch.tensor([[0.1, 0.12, 0.4, 0.43], [0.5, 0.2, 0.8, 0.75], [0.06, 0.6, 0.35, 0.94]])
    for _ in range(n_images):
        images.append(torch.rand(3, s, s, generator=gen).to(device))
        b = (boxes * s).round()
        masks = torch.zeros(len(b), s, s, dtype=torch.uint8)
        for j, (x0, y0, x1, y1) in enumerate(b.int().tolist()):
            masks[j, y0:y1, x0:x1] = 1
        targets.append(
            {"boxes": b.to(device), "labels": torch.tensor([1, 2, 3], device=device),
             "masks": masks.to(device)}
        )  # fmt: skip
    return images, targets


def _loss(model: nn.Module, batch) -> torch.Tensor:
    # Proposal sampling draws from the global RNG: the same seed gives every variant the same graph.
    torch.manual_seed(1)
    return sum(model(*batch).values())


def _step(model: nn.Module, batch) -> None:
    model.zero_grad(set_to_none=True)
    _loss(model, batch).backward()


def _eval(model: nn.Module, batch) -> None:
    model.eval()
    with torch.no_grad():
        model(batch[0])
    model.train()


def _weight_grads(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """Weight gradients of the conv/linear layers that received one, by module path."""
    _step(model, batch)
    return {
        name: m.weight.grad.detach().clone()
        for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.grad is not None
    }


def _memory(model: nn.Module, batch, device: torch.device) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    reset_cuda_peak(device)
    reset_peak_rss()
    before = rss_mb()
    loss, report = saved_activations(model, lambda: _loss(model, batch))
    live = rss_mb()
    loss.backward()
    out = report.as_dict()
    out["rss_live_mb"] = None if before is None else live - before
    peak = peak_rss_mb()
    out["rss_peak_mb"] = None if before is None or peak is None else peak - before
    out["cuda_peak_mb"] = cuda_peak_mb(device)
    del loss
    return out


def _alternate(fn, base, model, batch, dev, repeats: int) -> tuple[list[float], list[float]]:
    """Time ``fn`` on baseline and variant alternately, so drifts in machine load hit both."""
    t_base, t_var = [], []
    for _ in range(repeats):
        t_base.append(timed(lambda: fn(base, batch), dev)[1])
        t_var.append(timed(lambda: fn(model, batch), dev)[1])
    return t_base, t_var


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def run_benchmark(
    variants: Sequence[Variant],
    scratch: bool = False,
    image_size: int = 512,
    repeats: int = 5,
    device: str = "cpu",
    rois_per_image: int = 512,
    backbone: str = "resnet50",
) -> Iterator[dict[str, Any]]:
    """Measure the baseline, then each variant; yields one result dict per row as it is done."""
    for v in variants:  # fail on a bad variant before minutes of model building
        build_strategy(v.strategy, v.gamma, **v.options)
    dev = torch.device(device)
    batch = make_batch(image_size, dev)
    base = build_detector(scratch, image_size, rois_per_image, backbone).to(dev).train()
    for _ in range(2):  # warm up: allocator, gradient buffers, lazy inits
        _step(base, batch)
    base_mem = _memory(base, batch, dev)
    exact = _weight_grads(base, batch)
    yield {"variant": "baseline", "strategy": None, "gamma": None, "options": {}, **base_mem}
    for v in variants:
        model = to_dropit(copy.deepcopy(base), v.strategy, v.gamma, exclude=EXCLUDE, **v.options)[0]
        for _ in range(2):
            _step(model, batch)
        mem = _memory(model, batch, dev)
        grads = _weight_grads(model, batch)
        converted = {n for n, m in model.named_modules() if is_dropit(m)}
        cos = [
            torch.nn.functional.cosine_similarity(
                grads[n].flatten().double(), exact[n].flatten().double(), dim=0
            ).item()
            for n in grads
            if n in converted
        ]
        step_b, step_v = _alternate(_step, base, model, batch, dev, repeats)
        eval_b, eval_v = _alternate(_eval, base, model, batch, dev, repeats)
        med = statistics.median
        yield (
            {
                "variant": v.label,
                "strategy": v.strategy,
                "gamma": v.gamma,
                "options": v.options,
                **mem,
                "saved_ratio": _ratio(mem["saved_mb"], base_mem["saved_mb"]),
                "rss_live_ratio": _ratio(mem["rss_live_mb"], base_mem["rss_live_mb"]),
                "rss_peak_ratio": _ratio(mem["rss_peak_mb"], base_mem["rss_peak_mb"]),
                "step_time_ratio": round(med(step_v) / med(step_b), 4),
                "eval_time_ratio": round(med(eval_v) / med(eval_b), 4),
                "step_s": round(med(step_v), 4),
                "baseline_step_s": round(med(step_b), 4),
                "grad_cosine": round(sum(cos) / len(cos), 4) if cos else None,
                "converted_layers": len(cos),
            }
        )
        from_dropit(model)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    cols = [
        ("variant", "variant"),
        ("saved_mb", "saved MB"),
        ("saved_ratio", "saved ratio"),
        ("rss_live_ratio", "live RSS ratio"),
        ("rss_peak_ratio", "peak RSS ratio"),
        ("step_time_ratio", "step time ratio"),
        ("eval_time_ratio", "eval time ratio"),
        ("grad_cosine", "grad cosine"),
        ("cuda_peak_mb", "CUDA peak MB"),
    ]

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) and v < 10 else (
            f"{v:.1f}" if isinstance(v, float) else str(v))  # fmt: skip

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)

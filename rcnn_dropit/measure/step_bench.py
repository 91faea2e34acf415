"""DropIT benchmark on Mask R-CNN R50-FPN: saved-activation bytes, real memory, time, gradients.

Each variant is compared with the baseline in one process. Memory comes first, measured above
each model's own starting allocation (RSS on the CPU, the CUDA caching allocator's counters on a
GPU), and the row says whether the step's peak falls in the forward or the backward pass. Timings
come last, in rounds of one step per model (baseline and every variant in turn), with the ratio
of medians reported, so a noisy shared machine cancels out. :func:`largest_batches` finds the
largest batch each setting trains within a memory budget, which is what a GPU user wants to know.
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dropit_core import build_strategy, from_dropit, is_dropit, to_dropit
from dropit_core.memory import PeakMeter, saved_activations
from dropit_core.timing import timed_rounds
from rcnn_dropit.config import load_config
from rcnn_dropit.engine.amp import autocast, check_amp
from rcnn_dropit.errors import UsageError
from rcnn_dropit.measure.allocator import training_allocator
from rcnn_dropit.models import build_model

_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "maskrcnn_baseline.yaml"
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
    include: tuple[str, ...] = ("*",)  # which layers are converted (to_dropit patterns)

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``mink 0.9 values=int8``."""
        opts = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        if self.include != ("*",):
            opts = " ".join(filter(None, [opts, "include=" + "+".join(self.include)]))
        return f"{self.strategy} {self.gamma:g}" + (f" {opts}" if opts else "")


def parse_variant(text: str) -> Variant:
    """Parse ``strategy:gamma[:key=value,...]``, e.g. ``mink:0.9:values=int8``;
    ``include=backbone.*+rpn.*`` converts only the layers those patterns name."""
    parts = text.split(":")
    if len(parts) < 2:
        raise UsageError(f"variant {text!r}: expected strategy:gamma[:key=value,...]")
    try:
        gamma = float(parts[1])
    except ValueError:
        raise UsageError(f"variant {text!r}: gamma {parts[1]!r} is not a number") from None
    options: dict[str, Any] = {}
    for item in ":".join(parts[2:]).split(",") if len(parts) > 2 else []:
        key, _, value = item.partition("=")
        options[key] = _option_value(value)
    include = options.pop("include", "*")
    return Variant(parts[0], gamma, options, tuple(str(include).split("+")))


def _option_value(text: str) -> Any:
    """``4096`` -> int, ``true``/``false`` -> bool, anything else stays text."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def check_variants(variants: Sequence[Variant]) -> None:
    """Raise a UsageError for a variant whose strategy, gamma or options dropit_core refuses."""
    for v in variants:
        try:
            build_strategy(v.strategy, v.gamma, **v.options)
        except ValueError as err:  # dropit_core's own type: the variant is the user's
            raise UsageError(str(err)) from err


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


def _loss(model: nn.Module, batch, amp: str = "none") -> torch.Tensor:
    # Proposal sampling draws from the global RNG: the same seed gives every variant the same graph.
    torch.manual_seed(1)
    device = batch[0][0].device
    with autocast(amp, device):
        return sum(model(*batch).values())


def train_step(model: nn.Module, batch, amp: str = "none") -> None:
    """One forward and backward (gradients set to None first)."""
    model.zero_grad(set_to_none=True)
    # Under fp16 a real run scales the loss (GradScaler); the scale changes neither memory nor
    # time of the backward, so the bench leaves it out.
    _loss(model, batch, amp).backward()


def _eval(model: nn.Module, batch, amp: str = "none") -> None:
    model.eval()
    with torch.no_grad(), autocast(amp, batch[0][0].device):
        model(batch[0])
    model.train()


def _weight_grads(model: nn.Module, batch, amp: str = "none") -> dict[str, torch.Tensor]:
    """Weight gradients of the conv/linear layers that received one, by module path."""
    train_step(model, batch, amp)
    return {
        name: m.weight.grad.detach().clone()
        for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.grad is not None
    }


def _memory(model: nn.Module, batch, device: torch.device, amp: str = "none") -> dict:
    """Saved bytes, live memory after the forward, and the peak of the step and where it falls.

    Every figure is taken above this model's own starting allocation (its gradients freed), so
    whatever else the process holds (the baseline, earlier variants) does not count.
    """
    model.zero_grad(set_to_none=True)
    gc.collect()
    meter = PeakMeter(device)
    meter.begin()
    loss, report = saved_activations(model, lambda: _loss(model, batch, amp))
    live, peak_forward = meter.now(), meter.peak()
    loss.backward()
    peak = meter.peak()
    del loss
    out = report.as_dict()
    out["memory_source"] = "cuda" if meter.cuda else "rss"
    out["live_mb"], out["peak_mb"], out["peak_forward_mb"] = live, peak, peak_forward
    out["peak_phase"] = None
    if peak is not None and peak_forward is not None:
        out["peak_phase"] = "forward" if peak_forward >= peak else "backward"
        # What the forward's peak holds beyond the live state after it: transients (the dense
        # working set and the packing temporaries), not the caches.
        out["forward_transient_mb"] = peak_forward - live
    cpu = not meter.cuda
    out["rss_live_mb"] = live if cpu else None
    out["rss_peak_mb"] = peak if cpu else None
    out["cuda_peak_mb"] = peak if meter.cuda else None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _fidelity(grads: dict, exact: dict, converted: set[str]) -> dict[str, Any]:
    """Mean cosine and mean norm ratio (DropIT / exact) of the converted layers' weight grads."""
    cos, norm = [], []
    for name in grads:
        if name not in converted:
            continue
        g, e = grads[name].flatten().double(), exact[name].flatten().double()
        cos.append(torch.nn.functional.cosine_similarity(g, e, dim=0).item())
        norm.append((g.norm() / e.norm().clamp_min(1e-30)).item())
    return {
        "grad_cosine": round(sum(cos) / len(cos), 4) if cos else None,
        # Cosine misses a gradient that keeps its direction but shrinks (random dropping).
        "grad_norm_ratio": round(sum(norm) / len(norm), 4) if norm else None,
        "converted_layers": len(cos),
    }


def convert(base: nn.Module, v: Variant) -> nn.Module:
    """A DropIT copy of ``base`` for variant ``v`` (the paper's exclusions)."""
    return to_dropit(
        copy.deepcopy(base), v.strategy, v.gamma, include=v.include, exclude=EXCLUDE, **v.options
    )[0]


def run_benchmark(
    variants: Sequence[Variant],
    scratch: bool = False,
    image_size: int = 512,
    repeats: int = 5,
    device: str = "cpu",
    rois_per_image: int = 512,
    backbone: str = "resnet50",
    amp: str = "none",
    images: int = 2,
) -> Iterator[dict[str, Any]]:
    """Measure the baseline, then each variant; yields one result dict per row as it is done."""
    check_variants(variants)  # fail on a bad variant before minutes of model building
    dev = torch.device(device)
    check_amp(amp)  # fail on a bad amp value early too
    batch = make_batch(image_size, dev, images)
    base = build_detector(scratch, image_size, rois_per_image, backbone).to(dev).train()

    def step(m: nn.Module, b) -> None:
        train_step(m, b, amp)

    def evaluate(m: nn.Module, b) -> None:
        _eval(m, b, amp)

    for _ in range(2):  # warm up: allocator, gradient buffers, lazy inits
        step(base, batch)
    base_mem = _memory(base, batch, dev, amp)
    exact = _weight_grads(base, batch, amp)
    setting = {"amp": amp, "device": dev.type, "images": images, "image_size": image_size}
    yield {"variant": "baseline", "strategy": None, "gamma": None, "options": {}, **setting,
           **base_mem}  # fmt: skip
    rows, models = [], []
    for v in variants:
        model = convert(base, v)
        for _ in range(2):
            step(model, batch)
        mem = _memory(model, batch, dev, amp)
        grads = _weight_grads(model, batch, amp)
        converted = {n for n, m in model.named_modules() if is_dropit(m)}
        fidelity = _fidelity(grads, exact, converted)
        del grads
        model.zero_grad(set_to_none=True)
        row = {
            "variant": v.label,
            "strategy": v.strategy,
            "gamma": v.gamma,
            "options": v.options,
            **setting,
            **mem,
            "saved_ratio": _ratio(mem["saved_mb"], base_mem["saved_mb"]),
            "live_ratio": _ratio(mem["live_mb"], base_mem["live_mb"]),
            "peak_ratio": _ratio(mem["peak_mb"], base_mem["peak_mb"]),
            "rss_live_ratio": _ratio(mem["rss_live_mb"], base_mem["rss_live_mb"]),
            "rss_peak_ratio": _ratio(mem["rss_peak_mb"], base_mem["rss_peak_mb"]),
            "cuda_peak_ratio": _ratio(mem["cuda_peak_mb"], base_mem["cuda_peak_mb"]),
            "include": list(v.include),
            **fidelity,
        }
        if repeats > 0:  # timed below, once every variant's memory is measured
            rows.append(row)
            models.append(model)
            continue
        yield row  # repeats 0: memory and gradient fidelity only (exact on a busy machine)
        _release(model, dev)
    if not models:
        return
    # Timing last: the allocator is switched for it (see rcnn_dropit.measure.allocator), which would
    # disturb memory figures taken after it.
    with training_allocator(dev) as allocator:
        every = [base, *models]
        steps = timed_rounds([lambda m=m: step(m, batch) for m in every], repeats, dev)
        evals = timed_rounds([lambda m=m: evaluate(m, batch) for m in every], repeats, dev)
    med = statistics.median
    for i, (row, model) in enumerate(zip(rows, models, strict=True), start=1):
        row.update(
            step_time_ratio=round(med(steps[i]) / med(steps[0]), 4),
            eval_time_ratio=round(med(evals[i]) / med(evals[0]), 4),
            step_s=round(med(steps[i]), 4),
            baseline_step_s=round(med(steps[0]), 4),
            timing_allocator=allocator,
        )
        yield row
        _release(model, dev)


def _release(model: nn.Module, dev: torch.device) -> None:
    """Undo a variant's conversion and return cached device memory once it is measured."""
    from_dropit(model)
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (memory ratios are RSS on the CPU, allocator on CUDA)."""
    if rows and "max_batch" in rows[0]:
        cols = [
            ("variant", "variant"),
            ("budget_mb", "budget MB"),
            ("max_batch", "largest batch"),
            ("peak_mb_at_max", "peak MB at it"),
        ]
    else:
        cols = [
            ("variant", "variant"),
            ("saved_mb", "saved MB"),
            ("saved_ratio", "saved ratio"),
            ("live_ratio", "live ratio"),
            ("peak_ratio", "peak ratio"),
            ("peak_phase", "peak in"),
            ("step_time_ratio", "step time ratio"),
            ("eval_time_ratio", "eval time ratio"),
            ("grad_cosine", "grad cosine"),
            ("grad_norm_ratio", "grad norm ratio"),
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

"""DropIT benchmark on Mask R-CNN R50-FPN: saved-activation bytes, real memory, time, gradients.

Each variant is compared with the baseline in one process. Memory comes first, measured above
each model's own starting allocation (RSS on the CPU, the CUDA caching allocator's counters on a
GPU), and the row says whether the step's peak falls in the forward or the backward pass. Timings
come last, in rounds of one step per model (baseline and every variant in turn), with the ratio
of medians reported, so a noisy shared machine cancels out. ``max_batch.largest_batches`` finds the
largest batch each setting trains within a memory budget, which is what a GPU user wants to know.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dropit_core import from_dropit, is_dropit
from dropit_core.memory import PeakMeter, saved_activations
from dropit_core.timing import timed_rounds
from rcnn_dropit.engine.amp import check_amp
from rcnn_dropit.measure.allocator import training_allocator
from rcnn_dropit.measure.grad_fidelity import mean_fidelity, weight_grads
from rcnn_dropit.measure.workload import (
    Variant,
    build_detector,
    check_variants,
    convert,
    eval_step,
    make_batch,
    step_loss,
    train_step,
)


def _memory(model: nn.Module, batch, device: torch.device, amp: str = "none") -> dict:
    """Saved bytes, live memory after the forward, and the peak of the step and where it falls.

    Every figure is taken above this model's own starting allocation (its gradients freed), so
    whatever else the process holds (the baseline, earlier variants) does not count.
    """
    model.zero_grad(set_to_none=True)
    gc.collect()
    meter = PeakMeter(device)
    meter.begin()
    loss, report = saved_activations(model, lambda: step_loss(model, batch, amp))
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
        eval_step(m, b, amp)

    for _ in range(2):  # warm up: allocator, gradient buffers, lazy inits
        step(base, batch)
    base_mem = _memory(base, batch, dev, amp)
    exact = weight_grads(base, batch, amp)
    setting = {"amp": amp, "device": dev.type, "images": images, "image_size": image_size}
    yield {"variant": "baseline", "strategy": None, "gamma": None, "options": {}, **setting,
           **base_mem}  # fmt: skip
    rows, models = [], []
    for v in variants:
        model = convert(base, v)
        for _ in range(2):
            step(model, batch)
        mem = _memory(model, batch, dev, amp)
        grads = weight_grads(model, batch, amp)
        converted = {n for n, m in model.named_modules() if is_dropit(m)}
        fidelity = mean_fidelity(grads, exact, converted)
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

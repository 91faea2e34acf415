"""The RoI poolers under autocast, torchvision's and the lean one, side by side
(``tools/bench.py pooler``; docs/benchmark.md says what it measures).

The pyramid is the COCO recipe's (P2-P5, 256 channels, ``image_size`` x 4/3 px) with the box
head's 512 RoIs per image (7x7) and the mask head's 128 (14x14); both poolers are timed in
alternating rounds, on the CPU with glibc's heap as in training (instruments.measure.allocator).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import OrderedDict
from functools import partial
from typing import Any

import torch
from torchvision.ops import MultiScaleRoIAlign

from dropit_core.detection import LeanMultiScaleRoIAlign
from dropit_core.memory import PeakMeter
from instruments.measure.allocator import training_allocator
from instruments.measure.timing import timed_rounds
from rcnn_dropit.errors import UsageError

CHANNELS = 256
POOLERS = {"box": (7, 512), "mask": (14, 128)}  # output size, RoIs per image
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def pyramid(images: int, image_size: int, dtype: torch.dtype, device: torch.device) -> dict:
    """P2-P5 (keys "0"-"3") of a padded batch ``image_size`` x ``image_size`` * 4/3 px."""
    gen = torch.Generator().manual_seed(0)
    h, w = image_size, 32 * math.ceil(image_size * 4 / 3 / 32)
    return OrderedDict(
        (
            str(i),
            torch.randn(images, CHANNELS, h >> (i + 2), w >> (i + 2), generator=gen).to(
                device, dtype
            ),
        )
        for i in range(4)
    )


def rois(images: int, per_image: int, image_size: int, device: torch.device) -> list:
    """``per_image`` boxes per image, sides log-uniform from 16 px to the image's height."""
    gen = torch.Generator().manual_seed(1)
    h, w = image_size, image_size * 4 / 3
    out = []
    for _ in range(images):
        side = torch.exp(torch.empty(per_image).uniform_(math.log(16), math.log(h), generator=gen))
        aspect = torch.exp(torch.empty(per_image).uniform_(-0.7, 0.7, generator=gen))
        bw, bh = (side * aspect).clamp(max=w - 1), (side / aspect).clamp(max=h - 1)
        x0 = torch.rand(per_image, generator=gen) * (w - bw)
        y0 = torch.rand(per_image, generator=gen) * (h - bh)
        out.append(torch.stack([x0, y0, x0 + bw, y0 + bh], 1).to(device))
    return out


def _peak_mb(fn, device: torch.device) -> tuple[Any, float]:
    """``fn()`` and the most MB it had allocated at once above what was alive before it
    (dropit_core.memory.PeakMeter, nothing held counted)."""
    meter = PeakMeter(device)
    result = meter.measure(fn)
    return result, (meter.peak_bytes - meter.start_bytes) / 2**20


def _run(pooler, maps: dict, boxes: list, shapes: list, amp: torch.dtype, device, measure: bool):
    """One forward and backward: (pooled, the levels' gradients, forward and backward peaks)."""
    leaves = OrderedDict((k, v.detach().requires_grad_()) for k, v in maps.items())

    def forward():
        with torch.autocast(device.type, dtype=amp):
            return pooler(leaves, boxes, shapes)

    if not measure:
        out = forward()
        out.backward(torch.ones_like(out))
        return None
    out, fwd = _peak_mb(forward, device)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device, out.dtype)
    _, bwd = _peak_mb(lambda: out.backward(grad), device)
    return out.detach(), [v.grad for v in leaves.values()], fwd, bwd


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def pooler_costs(
    images: tuple[int, ...] = (2, 8),
    image_size: int = 800,
    device: str = "cpu",
    amp: str | None = None,
    repeats: int = 5,
) -> list[dict[str, Any]]:
    """One row per pooler (box, mask), batch and forward (torchvision, lean)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    amp = amp or ("fp16" if dev.type == "cuda" else "bf16")
    if amp not in _DTYPES:
        raise UsageError(f"--amp {amp}: the pooler bench runs under autocast, fp16 or bf16")
    dtype = _DTYPES[amp]
    rows = []
    for n, (name, (size, per_image)) in itertools.product(images, POOLERS.items()):
        rows += _compare(name, size, n, per_image, image_size, dtype, dev, repeats)
    return rows


def _compare(name, size, n, per_image, image_size, dtype, dev, repeats) -> list[dict[str, Any]]:
    """The two rows of one pooler at one batch: torchvision's, then the lean one's."""
    maps = pyramid(n, image_size, dtype, dev)
    boxes = rois(n, per_image, image_size, dev)
    shapes = [(image_size, round(image_size * 4 / 3))] * n
    poolers = [
        cls(["0", "1", "2", "3"], size, 2) for cls in (MultiScaleRoIAlign, LeanMultiScaleRoIAlign)
    ]
    (ref_out, ref_grads, ref_fwd, ref_bwd), (out, grads, fwd, bwd) = (
        _run(p, maps, boxes, shapes, dtype, dev, True) for p in poolers
    )
    steps = [partial(_run, p, maps, boxes, shapes, dtype, dev, False) for p in poolers]
    with training_allocator(dev) as allocator:  # temporaries reused, as in training
        ms = [statistics.median(t) * 1e3 for t in timed_rounds(steps, repeats, dev)]
    same = _same_bits(out, ref_out) and all(map(_same_bits, grads, ref_grads))
    amp = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    base = {"pooler": name, "images": n, "image_size": image_size, "amp": amp}
    base.update(rois=n * per_image, timed_under=allocator)
    return [
        {
            **base,
            "forward": "torchvision",
            "forward_peak_mb": ref_fwd,
            "backward_peak_mb": ref_bwd,
            "ms": ms[0],
        },
        {
            **base,
            "forward": "lean",
            "forward_peak_mb": fwd,
            "backward_peak_mb": bwd,
            "ms": ms[1],
            "forward_peak_ratio": fwd / ref_fwd,
            "backward_peak_ratio": bwd / ref_bwd,
            "time_ratio": ms[1] / ms[0],
            "same_bits": same,
        },
    ]


def is_pooler_rows(data: Any) -> bool:
    """Whether JSON data read from a file is ``pooler`` rows."""
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(r, dict) and {"pooler", "forward_peak_mb"} <= r.keys() for r in data)
    )


def pooler_markdown(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``pooler`` rows: one line per pooler and batch, torchvision's
    figures against the lean pooler's."""
    lines = [
        "| pooler | images | RoIs | forward peak MB, torchvision → lean | backward peak MB, "
        "torchvision → lean | ms, torchvision → lean | same bits |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    ref = {}
    for r in rows:
        key = (r["pooler"], r["images"], r["image_size"], r["amp"])
        if r["forward"] == "torchvision":
            ref[key] = r
            continue
        t = ref[key]
        lines.append(
            f"| {r['pooler']} | {r['images']} | {r['rois']} "
            f"| {t['forward_peak_mb']:.1f} → {r['forward_peak_mb']:.1f} "
            f"({r['forward_peak_ratio']:.2f}x) "
            f"| {t['backward_peak_mb']:.1f} → {r['backward_peak_mb']:.1f} "
            f"({r['backward_peak_ratio']:.2f}x) "
            f"| {t['ms']:.1f} → {r['ms']:.1f} ({r['time_ratio']:.2f}x) "
            f"| {'yes' if r['same_bits'] else 'no'} |"
        )
    return "\n".join(lines)

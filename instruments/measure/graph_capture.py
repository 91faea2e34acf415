"""What a graphed setting's first steps cost, per size bucket (``tools/gpu_checks.py capture``).

A graphed setting (``train.compile=backbone`` with ``train.compile_mode=reduce-overhead``)
compiles the graphable part (the ResNet body and FPN) once, then records one CUDA graph per
input shape and replays it; ``model.size_buckets`` pads every batch to one of a few sizes, so a
run records one graph per bucket and batch size. Here: the bench's recipe (workload) with the
COCO recipe's two orientations as its buckets (``image_size`` by the long side, and turned),
the bench's batch stretched to each. One model per setting takes each batch size and bucket in
turn: its first steps timed one by one (the first pays the compile, the next the recording),
then its steady steps. Per bucket: those seconds, what the first steps cost beyond steady ones
(``capture_s``), the seconds torch spent recording CUDA graphs (``record_s``), the graphs Dynamo
compiled and the times Inductor skipped CUDA graphs (``TORCH_LOGS=perf_hints`` prints why).
Steps are the bench's (forward and backward, workload.train_step), synchronised.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from dropit_core.timing import timed
from instruments.measure import workload
from rcnn_dropit.config import with_overrides
from rcnn_dropit.engine.probe import largest_batch
from rcnn_dropit.errors import UsageError

# The COCO recipe's long side over its short one (1333 / 800): its buckets' shape
LONG_OVER_SHORT = 1333 / 800
RECORD = "CUDAGraphNode.record"  # torch's timer key for a CUDA graph's capture


def buckets_for(image_size: int) -> list[tuple[int, int]]:
    """The recipe's two orientations at ``image_size``: (short, long) and (long, short), the
    long side ``image_size`` x 1333 / 800 rounded up to 32 (800 -> [800, 1344], [1344, 800])."""
    long = math.ceil(image_size * LONG_OVER_SHORT / 32) * 32
    return [(image_size, long), (long, image_size)]


def bucket_config(image_size: int):
    """The bench's recipe with the two buckets: the resize keeps a (short, long) image."""
    buckets = buckets_for(image_size)
    long = buckets[0][1]
    sizes = ", ".join(f"[{h}, {w}]" for h, w in buckets)
    return with_overrides(
        workload.recipe_config(False, image_size),
        [f"model.max_size={long}", f"model.size_buckets=[{sizes}]"],
        source="graph capture",
    )


def _turned(images: list[torch.Tensor], targets: list[dict]) -> tuple[list, list]:
    """The batch with height and width swapped: images and masks transposed, and every
    (x, y, x, y)-ordered tensor of a target (its boxes, a workload's proposal jitter: its last
    dimension 4) as (y, x, y, x)."""
    out = []
    for target in targets:
        turned = {}
        for key, value in target.items():
            if key == "masks":
                value = value.transpose(-1, -2).contiguous()
            elif value.dim() >= 2 and value.shape[-1] == 4:
                value = value[..., [1, 0, 3, 2]]
            turned[key] = value
        out.append(turned)
    return [img.transpose(-1, -2).contiguous() for img in images], out


def bucket_batch(image_size: int, images: int, bucket: tuple[int, int], device: torch.device):
    """The bench's batch of ``images`` stretched to ``bucket`` (height, width), on ``device``."""
    pictures, targets = workload.make_batch(image_size, torch.device("cpu"), images)
    short, long = min(bucket), max(bucket)
    pictures, targets = largest_batch(pictures, targets, short, long)  # landscape
    if bucket[0] > bucket[1]:
        pictures, targets = _turned(pictures, targets)
    moved = [{k: v.to(device) for k, v in t.items()} for t in targets]
    return [p.to(device) for p in pictures], moved


def _compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


def _recorded() -> list[float]:
    return list(compilation_time_metrics.get(RECORD, []))


def capture_rows(
    settings: Sequence[workload.Setting],
    images: Sequence[int] = (2, 8),
    image_size: int = 800,
    device: str = "cuda",
    amp: str = "fp16",
    first_steps: int = 3,
    repeats: int = 5,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per setting, batch size and bucket, in the order a run meets them."""
    if first_steps < 1 or repeats < 1:
        raise UsageError(f"first steps {first_steps}, repeats {repeats}: allowed integers >= 1")
    base = bucket_config(image_size)
    dev = torch.device(device)
    resolved = [(s, workload.setting_config(base, s)) for s in settings]
    for setting, cfg in resolved:
        model = workload.detector(cfg).to(dev).train()

        def step(batch, model=model, accumulate=cfg.solver.accumulate) -> None:
            workload.train_step(model, batch, amp, accumulate)
            model.zero_grad(set_to_none=True)

        for n in images:
            for bucket in buckets_for(image_size):
                batch = bucket_batch(image_size, n, bucket, dev)
                graphs, skips, recorded = _compiled_graphs(), _skips(), len(_recorded())
                first = [timed(lambda b=batch: step(b), dev)[1] for _ in range(first_steps)]
                steady = statistics.median(
                    timed(lambda b=batch: step(b), dev)[1] for _ in range(repeats)
                )
                row = {
                    "setting": setting.name,
                    "overrides": list(setting.overrides),
                    "compile_mode": cfg.train.compile_mode,
                    "images": n,
                    "bucket": list(bucket),
                    "first_steps_s": [round(t, 3) for t in first],
                    "steady_step_s": round(steady, 4),
                    "capture_s": round(sum(first) - first_steps * steady, 3),
                    "record_s": round(sum(_recorded()[recorded:]), 3),
                    "graphs_compiled": _compiled_graphs() - graphs,
                    "cudagraph_skips": _skips() - skips,
                    "device": dev.type,
                    "amp": amp,
                }
                if progress:
                    progress(row)
                yield row
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def is_capture_table(data: Any) -> bool:
    """Whether parsed JSON is what ``tools/gpu_checks.py capture --json`` writes."""
    return isinstance(data, dict) and isinstance(data.get("captures"), list)

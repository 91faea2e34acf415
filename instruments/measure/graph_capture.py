"""What a graphed setting's first steps cost, per size bucket (``tools/gpu_checks.py capture``),
and the size buckets of the GPU table's graphed rows (``tools/bench.py gpu-table --size-buckets``).

A graphed setting (``train.compile=backbone`` with ``train.compile_mode=reduce-overhead``)
compiles the graphable part (the ResNet body and FPN) once, then records one CUDA graph per
input shape and replays it; ``model.size_buckets`` pads every batch to one of a few sizes, so a
run records one graph per bucket and batch size. Here: the bench's recipe (workload) with the
COCO recipe's two orientations as its buckets (``image_size`` by the long side, and turned),
the bench's batch stretched to each. One model per setting takes each batch size and bucket in
turn: its first steps timed one by one (the first pays the compile, the next the recording),
then its steady steps (``TORCH_LOGS=perf_hints`` prints why Inductor skipped a CUDA graph).
The GPU table's ``--size-buckets`` rows take the same buckets (step_bench.run_benchmark).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from instruments.measure import workload
from instruments.measure.timing import timed
from rcnn_dropit.config import Config, with_overrides
from rcnn_dropit.engine.probe import largest_batch
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.sampling import roi_sample_counter

# The COCO recipe's long side over its short one (1333 / 800): its buckets' shape
LONG_OVER_SHORT = 1333 / 800
RECORD = "CUDAGraphNode.record"  # torch's timer key for a CUDA graph's capture


def buckets_for(image_size: int) -> list[tuple[int, int]]:
    """The recipe's two orientations at ``image_size``: (short, long) and (long, short), the
    long side ``image_size`` x 1333 / 800 rounded up to 32 (800 -> [800, 1344], [1344, 800])."""
    long = math.ceil(image_size * LONG_OVER_SHORT / 32) * 32
    return [(image_size, long), (long, image_size)]


def with_buckets(cfg: Config, image_size: int) -> Config:
    """``cfg`` (a bench recipe at ``image_size``) with the two buckets as ``model.size_buckets``
    and their long side as ``model.max_size``: the resize keeps a (short, long) image whole."""
    buckets = buckets_for(image_size)
    long = buckets[0][1]
    sizes = ", ".join(f"[{h}, {w}]" for h, w in buckets)
    return with_overrides(
        cfg, [f"model.max_size={long}", f"model.size_buckets=[{sizes}]"], source="size buckets"
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


def bucket_batch(
    image_size: int,
    images: int,
    bucket: tuple[int, int],
    device: torch.device,
    workload_name: str = workload.DEFAULT_WORKLOAD,
):
    """The bench's batch of ``images`` (``workload_name``'s objects) stretched to ``bucket``
    (height, width), on ``device``."""
    pictures, targets = workload.make_batch(image_size, torch.device("cpu"), images, workload_name)
    short, long = min(bucket), max(bucket)
    pictures, targets = largest_batch(pictures, targets, short, long)  # landscape
    if bucket[0] > bucket[1]:
        pictures, targets = _turned(pictures, targets)
    moved = [{k: v.to(device) for k, v in t.items()} for t in targets]
    return [p.to(device) for p in pictures], moved


def bucket_batches(
    image_size: int,
    images: int,
    device: torch.device,
    workload_name: str = workload.DEFAULT_WORKLOAD,
) -> list[tuple[list, list]]:
    """The bench's batch in each bucket of :func:`buckets_for` (landscape, then portrait)."""
    return [
        bucket_batch(image_size, images, b, device, workload_name) for b in buckets_for(image_size)
    ]


def _compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


def _recorded() -> list[float]:
    return list(compilation_time_metrics.get(RECORD, []))


def first_steps(
    step: Callable[[Any], None], batch, device: torch.device, count: int = 3
) -> dict[str, Any]:
    """``count`` steps of ``batch`` timed one by one (the first pays the compile, the next the
    CUDA graph's recording), with the seconds torch spent recording CUDA graphs in them, the
    graphs Dynamo compiled and the times Inductor skipped CUDA graphs."""
    graphs, skips, recorded = _compiled_graphs(), _skips(), len(_recorded())
    first = [timed(lambda: step(batch), device)[1] for _ in range(count)]
    return {
        "first_steps_s": [round(t, 3) for t in first],
        "record_s": round(sum(_recorded()[recorded:]), 3),
        "graphs_compiled": _compiled_graphs() - graphs,
        "cudagraph_skips": _skips() - skips,
    }


def beyond_steady(first: dict[str, Any], steady_s: float | None) -> float | None:
    """What a bucket's first steps cost beyond as many steady steps (None without a step)."""
    if steady_s is None:
        return None
    return round(sum(first["first_steps_s"]) - len(first["first_steps_s"]) * steady_s, 3)


def capture_rows(
    settings: Sequence[workload.Setting],
    images: Sequence[int] = (2, 8),
    image_size: int = 800,
    device: str = "cuda",
    amp: str = "fp16",
    repeats: int = 5,
    workload_name: str = workload.DEFAULT_WORKLOAD,
) -> Iterator[dict[str, Any]]:
    """One row per setting, batch size and bucket, in the order a run meets them."""
    if repeats < 1:
        raise UsageError(f"repeats {repeats}: allowed integers >= 1")
    workload.workload_named(workload_name)  # a bad name fails before any model is built
    base = with_buckets(workload.recipe_config(False, image_size), image_size)
    dev = torch.device(device)
    resolved = [(s, workload.setting_config(base, s)) for s in settings]
    for setting, cfg in resolved:
        model = workload.detector(cfg).to(dev).train()

        def step(batch, model=model, accumulate=cfg.solver.accumulate) -> None:
            workload.train_step(model, batch, amp, accumulate)
            model.zero_grad(set_to_none=True)

        counter = roi_sample_counter(model)
        for n in images:
            for bucket in buckets_for(image_size):
                batch = bucket_batch(image_size, n, bucket, dev, workload_name)
                first = first_steps(step, batch, dev)
                if counter is not None:
                    counter.take()  # the first steps'
                steady = statistics.median(
                    timed(lambda b=batch: step(b), dev)[1] for _ in range(repeats)
                )
                positives, _negatives, counted = counter.take() if counter else (0, 0, 0)
                row = {
                    "setting": setting.name,
                    "overrides": list(setting.overrides),
                    "compile_mode": cfg.train.compile_mode,
                    "images": n,
                    "bucket": list(bucket),
                    "first_steps_s": first["first_steps_s"],
                    "steady_step_s": round(steady, 4),
                    "capture_s": beyond_steady(first, steady),
                    "record_s": first["record_s"],
                    "graphs_compiled": first["graphs_compiled"],
                    "cudagraph_skips": first["cudagraph_skips"],
                    "device": dev.type,
                    "amp": amp,
                    "workload": workload_name,
                    # what the steady steps' RoI heads had, as the sampler kept them
                    "positive_rois_per_image": positives / counted if counted else None,
                }
                yield row
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()

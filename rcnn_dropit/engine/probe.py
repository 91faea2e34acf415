"""One memory method measured on this process's device: the run's model built with the method's
overrides, its optimizer, and training steps on the run's first batch at the largest size the
model's resize makes; the peak of one step (weights, gradients and optimizer state included) and
the time of a few, after warm-up. A step that runs out of memory is caught and reported.

Nothing here is collective: under DDP each rank measures alone (a rank that runs out of memory
must not leave the others waiting in a collective), on the plain model, with DDP's gradient
buckets (one more copy of the trainable gradients) added to its peak.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dropit_core import memory
from dropit_core.memory import PeakMeter
from rcnn_dropit.config import Config, with_overrides
from rcnn_dropit.data import collate
from rcnn_dropit.data.transforms import to_float
from rcnn_dropit.distributed import get_rank
from rcnn_dropit.engine.amp import make_scaler
from rcnn_dropit.engine.compiling import compile_model
from rcnn_dropit.engine.optim import build_optimizer
from rcnn_dropit.engine.step import StepOptions, training_step
from rcnn_dropit.engine.trainer import move_targets
from rcnn_dropit.memory_methods import METHODS
from rcnn_dropit.models import build_model
from rcnn_dropit.models.sampling import (
    join_proposals_around,
    per_object_for,
    propose_around,
    roi_sample_counter,
    sampler_cap,
)
from rcnn_dropit.rng import seed_all

OUT_OF_MEMORY = "out of memory"


@dataclass(frozen=True)
class ProbeSteps:
    """How many steps a probe runs: warm-up (gradients and optimizer state made, kernels
    chosen), the one whose peak is measured, then the timed ones."""

    warmup: int = 2
    timed: int = 3


DEFAULT_STEPS = ProbeSteps()


@dataclass(frozen=True)
class Probe:
    """One method measured on one process: its peak and step time, or why it has none."""

    method: str
    peak_bytes: int | None = None  # None: not measured (see note)
    step_s: float | None = None  # median of the timed steps
    spread: float = 0.0  # (slowest - fastest) / median of the timed steps: the timing's noise
    note: str = ""  # why there is no peak: "out of memory", a batch too small to split
    positives: float | None = None  # positive RoIs per image the measured step's heads had

    @property
    def measured(self) -> bool:
        """Whether the probe ran to its end."""
        return self.peak_bytes is not None


@dataclass(frozen=True)
class ProbeBatch:
    """The batch every method is measured on, on the device, with what describes it."""

    images: list[torch.Tensor]
    targets: list[dict]

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """(height, width) of each image."""
        return [tuple(img.shape[-2:]) for img in self.images]


def first_batch(train_loader) -> tuple[list[torch.Tensor], list[dict]]:
    """The run's first training batch (epoch 0), read from the data set by the batch sampler's
    indices: the loader is not iterated, so its workers and generators stay untouched."""
    sampler = train_loader.batch_sampler
    sampler.set_epoch(0)  # the trainer sets each epoch itself before iterating
    indices = next(iter(sampler))
    return collate([train_loader.dataset[key] for key in indices])


def largest_batch(
    images: list[torch.Tensor], targets: list[dict], min_size: int, max_size: int
) -> tuple[list[torch.Tensor], list[dict]]:
    """Each image, its boxes and masks stretched to the largest the model's resize makes of an
    image of its orientation: ``min_size`` by ``max_size`` (the resize then keeps it)."""
    out_images, out_targets = [], []
    for image, target in zip(images, targets, strict=True):
        h, w = image.shape[-2:]
        size = (min_size, max_size) if w >= h else (max_size, min_size)
        sy, sx = size[0] / h, size[1] / w
        image = F.interpolate(to_float(image)[None], size=size, mode="bilinear")[0]
        target = dict(target)
        target["boxes"] = target["boxes"] * torch.tensor([sx, sy, sx, sy])
        if "masks" in target:
            masks = target["masks"][:, None].float()
            target["masks"] = F.interpolate(masks, size=size, mode="nearest")[:, 0].byte()
        if "area" in target:
            target["area"] = target["area"] * (sx * sy)
        out_images.append(image)
        out_targets.append(target)
    return out_images, out_targets


def probe_positives(cfg: Config) -> int:
    """The positive RoIs per image the probe's heads are to see (train.memory_probe_positives,
    by default the sampler's cap)."""
    wanted = cfg.train.memory_probe_positives
    return sampler_cap(cfg.model.box_batch_size_per_image) if wanted is None else wanted


def probe_batch(cfg: Config, train_loader, device: torch.device) -> ProbeBatch:
    """The run's first batch at the largest image size, on ``device``, with proposals around its
    objects for :func:`probe_positives` positive RoIs per image (seeded: every method and rank
    sees the same)."""
    images, targets = first_batch(train_loader)
    images, targets = largest_batch(images, targets, cfg.model.min_size, cfg.model.max_size)
    per_object = per_object_for(targets, probe_positives(cfg))
    if per_object:
        targets = propose_around(targets, per_object, torch.Generator().manual_seed(0))
    return ProbeBatch([img.to(device) for img in images], move_targets(targets, device))


def method_config(cfg: Config, method: str) -> Config:
    """``cfg`` set to train with ``method`` (memory_methods.METHODS)."""
    overrides = METHODS[method].config_overrides()
    return with_overrides(cfg, overrides, source=f"memory method {method}")


def probe_step(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    options: StepOptions,
    batch: ProbeBatch,
    device: torch.device,
    iteration: int,
) -> dict[str, torch.Tensor]:
    """The step a probe measures: the trainer's (engine.step.training_step) without what is
    collective (the losses' all-reduce, the non-finite guard that needs it)."""
    return training_step(
        net, optimizer, scaler, batch.images, batch.targets, options, iteration, get_rank(), device
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(
    cfg: Config, batch: ProbeBatch, device: torch.device, steps: ProbeSteps, ddp: bool
) -> tuple[int, list[float], float | None]:
    """Build, warm up, measure the peak of one step, time the others: (peak bytes, times,
    positive RoIs per image in the measured step)."""
    seed_all(cfg.train.seed)  # the weights the run starts from
    net, _record = build_model(cfg)
    net.rpn.register_forward_hook(join_proposals_around)  # the batch's proposals, if it has any
    net.to(device)
    compile_model(net, cfg.train.compile, cfg.train.compile_backend, cfg.train.compile_mode)
    net.train()
    optimizer = build_optimizer(cfg.solver, net)
    scaler = make_scaler(cfg.solver.amp, device)
    options = StepOptions.from_solver(cfg.solver)
    iteration = 0

    def step() -> None:
        nonlocal iteration
        iteration += 1
        probe_step(net, optimizer, scaler, options, batch, device, iteration)

    for _ in range(steps.warmup):
        step()
    optimizer.zero_grad(set_to_none=True)  # PeakMeter: free what the step would free first
    meter = PeakMeter(
        device, lambda: memory.training_tensors(net, optimizer, batch.images, batch.targets)
    )
    counter = roi_sample_counter(net)
    counter.take()  # the warm-up's
    meter.measure(step)
    positives, _negatives, images = counter.take()
    peak = meter.peak_bytes
    if ddp:  # DDP's buckets: a flat copy of every trainable gradient, alive through training
        peak += sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    times = []
    for _ in range(steps.timed):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return peak, times, positives / images if images else None


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's refusal: CUDA's OutOfMemoryError, or the CPU
    allocator's RuntimeError (a plain one in torch)."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def free_memory(device: torch.device) -> None:
    """Let go of what a finished or failed probe held, cached CUDA blocks included."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def probe_method(
    cfg: Config,
    method: str,
    batch: ProbeBatch,
    device: torch.device,
    steps: ProbeSteps = DEFAULT_STEPS,
    ddp: bool = False,
) -> Probe:
    """Measure ``method`` on this process's device (``cfg``: the run's config; ``ddp``: add
    DDP's buckets to the peak)."""
    failed = False
    try:
        peak, times, positives = _measure(method_config(cfg, method), batch, device, steps, ddp)
    except RuntimeError as err:  # torch.OutOfMemoryError is one, and the CPU allocator's
        if not is_out_of_memory(err):
            raise
        failed = True  # handled outside: the traceback's frames still hold the step's tensors
    free_memory(device)
    if failed:
        return Probe(method, note=OUT_OF_MEMORY)
    median = statistics.median(times) if times else None
    spread = (max(times) - min(times)) / median if median else 0.0
    return Probe(method, peak, median, spread, positives=positives)

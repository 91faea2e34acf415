"""The largest batch each DropIT setting trains within a memory budget (what a GPU user wants).

Each setting (the baseline, then each variant) has the device to itself: the model is built on
the CPU and moved over for its search. A trial is one real training step: forward, backward and
an SGD-with-momentum update, so weights, gradients and momentum buffers all count.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dropit_core.memory import MB, PeakMeter, training_tensors
from instruments.measure.workload import (
    DEFAULT_WORKLOAD,
    Setting,
    Variant,
    describe,
    detector,
    make_batch,
    recipe_config,
    resolve_settings,
    train_step,
)
from rcnn_dropit.config import Config
from rcnn_dropit.engine.amp import check_amp


def largest_fitting(peak_of: Callable[[int], float | None], budget_mb: float, limit: int) -> int:
    """The largest n in [1, limit] whose ``peak_of(n)`` (MB; None: out of memory) fits the budget.

    Doubles until a batch does not fit, then bisects; assumes the peak grows with n. 0 when
    even one image does not fit.
    """

    def fits(n: int) -> bool:
        peak = peak_of(n)
        return peak is not None and peak <= budget_mb

    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        n = min(good * 2, limit)
        if n == good:
            return good
        if fits(n):
            good = n
        else:
            bad = n
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def _step_peak_mb(
    model: nn.Module,
    image_size: int,
    device: torch.device,
    amp: str,
    n: int,
    floor: float,
    accumulate: int = 1,
    workload: str = DEFAULT_WORKLOAD,
) -> float | None:
    """Peak memory (MB) of one SGD-with-momentum step on n images; None when out of memory.

    The peak is PeakMeter's. On CUDA it is everything allocated above ``floor`` (the allocation
    before the model came to the device: weights, gradients, momentum, activations, workspace).
    On the CPU it is the peak above the step's start (weights, gradients and momentum held).
    """
    optimizer = getattr(model, "_bench_optimizer", None)
    if optimizer is None:  # momentum buffers are part of what must fit
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        model._bench_optimizer = optimizer
    meter = PeakMeter(device, lambda: training_tensors(model, optimizer))

    def step() -> None:
        train_step(model, make_batch(image_size, device, n, workload), amp, accumulate)
        optimizer.step()

    try:
        meter.measure(step)
        top = meter.peak_bytes
        peak = top / MB - floor if meter.cuda else (top - meter.start_bytes) / MB
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not isinstance(err, torch.OutOfMemoryError) and "out of memory" not in str(err).lower():
            raise
        peak = None
    model.zero_grad(set_to_none=False)  # gradients stay allocated, as in training
    if meter.cuda:
        torch.cuda.empty_cache()
    return peak


def _search(
    model: nn.Module,
    budget_mb: float,
    limit: int,
    floor: float,
    peak_of: Callable[[nn.Module, int, float], float | None],
) -> tuple[int, dict[int, float | None]]:
    """The largest fitting batch of ``model`` and the peak of every batch tried."""
    peaks: dict[int, float | None] = {}

    def peak_at(n: int) -> float | None:
        peaks[n] = peak_of(model, n, floor)
        return peaks[n]

    return largest_fitting(peak_at, budget_mb, limit), peaks


def _max_batch_row(
    name: str,
    cfg: Config,
    budget_mb: float,
    limit: int,
    dev: torch.device,
    peak_of: Callable[[nn.Module, int, float], float | None],
) -> dict[str, Any]:
    with _fresh_allocation(dev):
        # the floor counts on CUDA only (see _step_peak_mb): on the CPU the peak is above RSS
        floor = torch.cuda.memory_allocated(dev) / MB if dev.type == "cuda" else 0.0
        # the model lives only inside the search: it leaves the device before the cleanup
        best, peaks = _search(detector(cfg).train().to(dev), budget_mb, limit, floor, peak_of)
    info = describe(cfg)
    return {
        "setting": name,
        "variant": name,
        **{key: info[key] for key in ("strategy", "gamma", "options")},
        "budget_mb": budget_mb,
        "max_batch": best,
        "peak_mb_at_max": peaks.get(best),
        "batch_limit": limit,
    }


def largest_batches(
    settings: Sequence[Setting | Variant],
    budget_mb: float,
    limit: int = 64,
    scratch: bool = False,
    image_size: int = 512,
    device: str = "cpu",
    rois_per_image: int = 512,
    backbone: str = "resnet50",
    amp: str = "none",
    heads: str = "v1",
    peak_of: Callable[[nn.Module, int, float], float | None] | None = None,
    workload: str = DEFAULT_WORKLOAD,
) -> Iterator[dict[str, Any]]:
    """For the baseline and each setting alone on the device: the largest batch (up to
    ``limit`` images of ``workload``) whose training step (forward, backward, SGD momentum
    update) fits ``budget_mb``. ``peak_of(model, n, floor)`` replaces the measurement
    (tests)."""
    base_cfg = recipe_config(scratch, image_size, rois_per_image, backbone, heads)
    reference, resolved = resolve_settings(settings, base_cfg)
    dev = torch.device(device)
    check_amp(amp)

    def measured(accumulate: int) -> Callable[[nn.Module, int, float], float | None]:
        def peak(model: nn.Module, n: int, floor: float) -> float | None:
            return _step_peak_mb(model, image_size, dev, amp, n, floor, accumulate, workload)

        return peak

    setting = {"device": dev.type, "amp": amp, "image_size": image_size, "workload": workload}
    # Each model is built on the CPU and moved to the device alone: each has it to itself.
    for s, cfg in [(reference, base_cfg), *resolved]:
        measure = peak_of or measured(cfg.solver.accumulate)
        yield {**_max_batch_row(s.name, cfg, budget_mb, limit, dev, measure), **setting}


@contextlib.contextmanager
def _fresh_allocation(device: torch.device):
    """Free cached blocks before and after, so one setting's leftovers do not count for the next."""
    _free(device)
    yield
    _free(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

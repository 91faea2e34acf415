"""The memory.json report: saved-activation memory of one step, its peaks, throughput."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dropit_core import from_dropit, memory
from rcnn_dropit.config_schema import dropit_rules
from rcnn_dropit.data import images_to_device
from rcnn_dropit.engine.amp import autocast
from rcnn_dropit.engine.data_position import epoch_batches
from rcnn_dropit.engine.step import micro_batches
from rcnn_dropit.engine.trainer import move_targets
from rcnn_dropit.models.sampling import roi_sample_counter
from rcnn_dropit.rng import rng_preserved


def _step(
    net: nn.Module, images: list, targets: list, amp: str, device: torch.device
) -> memory.StepMemory:
    """One forward+backward of ``net`` on the batch, measured (dropit_core.memory.measure_step)."""
    net.train()

    def forward() -> torch.Tensor:
        with autocast(amp, device):
            return sum(net(images, targets).values())

    return memory.measure_step(net, [forward], device, (images, targets))


def measure_memory(
    cfg,
    net: nn.Module,
    train_loader,
    device: torch.device,
    images_per_sec: float,
    train_peak_mb: float | None = None,
) -> dict:
    """The memory.json report: one step of the trained model measured on the first training
    batch (on every rank: SyncBN needs all); with gradient accumulation, on its first
    micro-batch, which is what one forward and backward holds. ``train_peak_mb``: the largest
    peak the training logged (metrics.jsonl ``peak_mem_mb``)."""
    with rng_preserved():  # the training streams go on as if nothing was measured
        images, targets = next(epoch_batches(train_loader, 0))
        images, targets = micro_batches(images, targets, cfg.solver.accumulate)[0]
        images = images_to_device(images, device)
        targets = move_targets(targets, device)
        counter = roi_sample_counter(net)
        if counter is not None:
            counter.take()  # training's
        step = _step(net, images, targets, cfg.solver.amp, device)
        positives, _negatives, counted = counter.take() if counter is not None else (0, 0, 0)
        plain_mb = None
        if cfg.dropit.enabled:  # the same model and batch without DropIT: what it saves
            plain = from_dropit(copy.deepcopy(net))
            plain_step = _step(plain, images, targets, cfg.solver.amp, device)
            plain_mb = plain_step.saved.total_bytes / memory.MB
            del plain
    saved = step.saved.as_dict()
    report = {
        "saved_mb": saved["saved_mb"],
        # what the trained model's RoI heads had in the measured step (its RPN has learned)
        "positive_rois_per_image": positives / counted if counted else None,
        "by_type": saved["by_type_mb"],
        "converted_mb": saved["converted_mb"],
        "unconverted_mb": saved["unconverted_mb"],
        "norm_mb": saved["norm_mb"],  # kept by normalisation layers (their inputs)
        "saved_mb_without_dropit": plain_mb,
        "saved_ratio": round(saved["saved_mb"] / plain_mb, 4) if plain_mb else None,
        # dropit_core.memory.PeakMeter's peak, start included: the largest of training's logged
        # windows, and the measured step's (forward and backward, no optimizer step)
        "train_peak_mb": train_peak_mb,
        # the measured step's figures: the start, then the step's own above it
        **step.as_dict(),
        "images_per_sec": images_per_sec,
        "batch_size": len(images),  # the measured forward's images (one micro-batch)
        "accumulate": cfg.solver.accumulate,
        # what ran: each rule's strategy as it describes itself (gamma only where it means
        # something) and where it applied; the section's own strategy and gamma are only the
        # rules' fallbacks, so writing them would name a setting that may not have run
        "dropit": {
            "enabled": cfg.dropit.enabled,
            "setting": dropit_setting(cfg.dropit),
            "rules": _rules_that_ran(cfg.dropit),
        },
    }
    return report


def _rules_that_ran(d) -> list[dict]:
    """Each rule of the DropIT section as it ran: strategy, gamma where used, options, layers."""
    if not d.enabled:
        return []
    return [
        {
            "strategy": r.strategy.name,
            "gamma": r.gamma if r.strategy.uses_gamma else None,
            "options": dict(r.options),
            "include": list(r.include),
            "exclude": list(r.exclude),
        }
        for r in dropit_rules(d)
    ]


def dropit_setting(d) -> str:
    """The DropIT section in a few words: each rule's strategy as it describes itself (gamma only
    where the strategy uses it) and, for a rule that is not on every layer, where it applies."""
    if not d.enabled:
        return "DropIT off"
    parts = [
        r.strategy.describe() + ("" if r.include == ("*",) else f" on {', '.join(r.include)}")
        for r in dropit_rules(d)
    ]
    return "DropIT " + "; ".join(parts)


def dropit_summary(cfg, report: dict | None) -> str:
    """One line for the end of a run: the DropIT setting and what it saved in the measured step."""
    setting = dropit_setting(cfg.dropit)
    if report is None:
        return f"{setting} (train.measure_memory is off: nothing measured)"
    positives = report.get("positive_rois_per_image")
    heads = f" (the trained model's, {positives:.0f} positive RoIs per image)" if positives else ""
    saved = f"activations kept for backward in one step{heads}: {report['saved_mb']:.1f} MB"
    ratio = report.get("saved_ratio")
    if ratio is None:
        return f"{setting}; {saved}"
    return (
        f"{setting}; {saved}, {report['saved_mb_without_dropit']:.1f} MB without DropIT "
        f"({ratio:.2f}x)"
    )

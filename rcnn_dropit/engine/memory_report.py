"""The memory.json report: saved-activation memory of one step, its peaks, throughput."""

from __future__ import annotations

import torch
from torch import nn

from dropit_core import memory
from rcnn_dropit.data import images_to_device
from rcnn_dropit.engine.data_position import epoch_batches
from rcnn_dropit.engine.trainer import autocast_context, move_targets


def measure_step(net: nn.Module, images: list, targets: list, amp: str, device: torch.device):
    """One forward+backward of the plain model: saved-tensor report and the step's peaks."""
    net.train()
    if device.type == "cuda":  # a CPU run on a GPU node has no CUDA peak to reset
        torch.cuda.reset_peak_memory_stats(device)
    memory.reset_peak_rss()
    with autocast_context(amp, device):
        losses, report = memory.saved_activations(net, lambda: net(images, targets))
    sum(losses.values()).backward()
    net.zero_grad(set_to_none=True)  # the measurement must leave no gradients behind
    cuda_peak = memory.cuda_peak_mb(device) if device.type == "cuda" else None
    return report.as_dict(), cuda_peak, memory.peak_rss_mb()


def measure_memory(
    cfg, net: nn.Module, train_loader, device: torch.device, images_per_sec: float
) -> dict:
    """The memory.json report: one step measured on the first training batch (on every rank:
    SyncBN needs all)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        images, targets = next(epoch_batches(train_loader, 0))
        images = images_to_device(images, device)
        saved, cuda_peak, rss_peak = measure_step(
            net, images, move_targets(targets, device), cfg.solver.amp, device
        )
    report = {
        "saved_mb": saved["saved_mb"],
        "by_type": saved["by_type_mb"],
        "converted_mb": saved["converted_mb"],
        "unconverted_mb": saved["unconverted_mb"],
        "cuda_peak_mb": cuda_peak,
        "step_peak_rss_mb": rss_peak,
        "images_per_sec": images_per_sec,
        "batch_size": len(images),
        "dropit": {
            "enabled": cfg.dropit.enabled,
            "strategy": cfg.dropit.strategy,
            "gamma": cfg.dropit.gamma,
        },
    }
    return report

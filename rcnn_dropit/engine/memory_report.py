"""memory.json: saved-activation memory of one training step, peak memory and throughput."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rcnn_dropit.distributed import is_main_process
from rcnn_dropit.logging_utils import peak_memory_mb


def saved_activation_report(net: nn.Module, images: list, targets: list) -> dict:
    """Saved-tensor accounting of one forward (dropit_core.memory); empty when unavailable."""
    try:
        from dropit_core import memory  # the lead's accounting API; optional until it lands
    except ImportError:
        return {}
    measure = getattr(memory, "measure_saved", None)
    if measure is None:
        return {}
    return dict(measure(lambda: sum(net(images, targets).values()), net))


def write_memory_report(
    cfg, net: nn.Module, train_loader, device: torch.device, trainer, out: Path
):
    """Measure one step of the plain model on the first batch and write memory.json on rank 0."""
    from rcnn_dropit.engine.data_position import epoch_batches
    from rcnn_dropit.engine.trainer import _to_device, autocast_context

    images, targets = next(epoch_batches(train_loader, 0))
    images = [img.to(device) for img in images]
    targets = _to_device(targets, device)
    was_training = net.training
    net.train()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast_context(cfg.solver.amp, device):
            saved = saved_activation_report(net, images, targets)
    net.train(was_training)
    net.zero_grad(set_to_none=True)
    report = {
        "saved_mb": saved.get("saved_mb"),
        "by_type": saved.get("by_type", {}),
        "converted_mb": saved.get("converted_mb"),
        "unconverted_mb": saved.get("unconverted_mb"),
        "cuda_peak_mb": peak_memory_mb(device) if device.type == "cuda" else None,
        "peak_mem_mb": peak_memory_mb(device),
        "images_per_sec": trainer.images_per_sec,
        "dropit": {
            "enabled": cfg.dropit.enabled,
            "strategy": cfg.dropit.strategy,
            "gamma": cfg.dropit.gamma,
        },
    }
    if is_main_process():
        (out / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

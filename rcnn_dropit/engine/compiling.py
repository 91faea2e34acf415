"""``train.compile``: the backbone or the whole model under ``torch.compile``, on request.

The DropIT layers trace as ``torch.library`` operators (``dropit_core.traced``), so a converted
ResNet-FPN backbone compiles into one graph; the detector's heads hold data-dependent steps
(proposal sampling, NMS), where the compiler breaks the graph and runs them eagerly. The
compiled function replaces the module's ``forward`` on the instance: parameters, buffers and
``state_dict`` keys stay the module's own, so checkpoints, resume and DDP see the same model.
Shapes are dynamic (``dynamic=True``): detector images vary in size from batch to batch.
Compiling happens in the first forward (and backward); that forward's time is logged.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("none", "backbone", "model")


def compile_model(net: nn.Module, mode: str) -> nn.Module | None:
    """Compile ``net.backbone`` (``"backbone"``) or ``net`` (``"model"``) in place; return the
    compiled module, or None for ``"none"``."""
    if mode not in COMPILE_CHOICES:
        raise ValueError(f"train.compile={mode!r}: allowed {', '.join(COMPILE_CHOICES)}")
    if mode == "none":
        return None
    target = net.backbone if mode == "backbone" else net
    target.forward = torch.compile(target.forward, dynamic=True)
    _log_first_forward(target, mode)
    return target


def _log_first_forward(module: nn.Module, mode: str) -> None:
    """Log how long the module's first forward took (the compile of its forward included);
    hooks outside the compiled function, removed after that call."""
    started: list[float] = []

    def before(_module, _args) -> None:
        started.append(time.perf_counter())

    def after(_module, _args, _output) -> None:
        pre.remove()
        post.remove()
        log.info(
            "train.compile=%s: first forward %.1f s (compiling included; the backward compiles "
            "in the first backward)",
            mode,
            time.perf_counter() - started[0],
        )

    pre = module.register_forward_pre_hook(before)
    post = module.register_forward_hook(after)

"""``train.compile``: the backbone or the whole model under ``torch.compile``, on request.

The DropIT layers trace as ``torch.library`` operators (``dropit_core.layers.library``), so a
converted ResNet-FPN backbone compiles into one graph; the detector's heads hold data-dependent
steps (proposal sampling, NMS), where the compiler breaks the graph and runs them eagerly. The
compiled function replaces the module's ``forward`` on the instance: parameters, buffers and
``state_dict`` keys stay the module's own, so checkpoints, resume and DDP see the same model.
Shapes are dynamic (``dynamic=True``): detector images vary in size from batch to batch.
Compiling happens in the first forward (and backward); that forward's time is logged.

``train.compile_backend`` picks torch.compile's backend (Inductor by default; ``aot_eager``
traces forward and backward as Inductor would but runs eager ops: a graph's problems without
code generation, in seconds) and ``train.compile_mode`` Inductor's mode (``reduce-overhead``:
CUDA graphs, the step's kernels replayed without a launch each from Python).

Inductor keeps the maps' own memory format (``layout_optimization`` off). On the CPU it would
otherwise run every conv channels-last: a channels-last copy of each 3x3 conv weight made in
every forward and saved for the backward beside the weight itself, which the eager model never
keeps, and on this project's 2-core CPU a slower step, not a faster one
(docs/results/archive/untrained_workload.md, "Compiled"). On a GPU, with dynamic shapes, Inductor
keeps the layout anyway: the option changes nothing there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from rcnn_dropit.config_schema import COMPILE_BACKENDS, COMPILE_MODES, compile_mode_error

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("none", "backbone", "model")


def compile_model(
    net: nn.Module, mode: str, backend: str = "inductor", compile_mode: str = "default"
) -> nn.Module | None:
    """Compile ``net.backbone`` (``"backbone"``) or ``net`` (``"model"``) in place with
    ``backend`` (and, for Inductor, ``compile_mode``); return the compiled module, or None for
    ``"none"``."""
    for key, value, allowed in (
        ("train.compile", mode, COMPILE_CHOICES),
        ("train.compile_backend", backend, COMPILE_BACKENDS),
        ("train.compile_mode", compile_mode, COMPILE_MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{key}={value!r}: allowed {', '.join(allowed)}")
    if mode == "none":
        return None
    mode_error = compile_mode_error(backend, compile_mode)
    if mode_error:
        raise ValueError(mode_error)
    target = net.backbone if mode == "backbone" else net
    target.forward = compiled(target.forward, backend, compile_mode)
    _log_first_forward(target, mode, backend if compile_mode == "default" else compile_mode)
    return target


def compiled(fn: Callable, backend: str = "inductor", compile_mode: str = "default") -> Callable:
    """``fn`` under ``torch.compile`` as ``train.compile`` compiles: dynamic shapes, and with
    Inductor the maps' layout kept."""
    if backend != "inductor":
        return torch.compile(fn, dynamic=True, backend=backend)
    from torch import _inductor  # imported on use: heavy, and only Inductor needs it

    # torch.compile takes a mode or options, not both: the mode's options, with ours
    options = _inductor.list_mode_options(compile_mode, dynamic=True)
    return torch.compile(fn, dynamic=True, options={**options, "layout_optimization": False})


def _log_first_forward(module: nn.Module, mode: str, how: str) -> None:
    """Log how long the module's first forward took (the compile of its forward included);
    hooks outside the compiled function, removed after that call."""
    started: list[float] = []

    def before(_module, _args) -> None:
        started.append(time.perf_counter())

    def after(_module, _args, _output) -> None:
        pre.remove()
        post.remove()
        log.info(
            "train.compile=%s (%s): first forward %.1f s (compiling included; the backward "
            "compiles in the first backward)",
            mode,
            how,
            time.perf_counter() - started[0],
        )

    pre = module.register_forward_pre_hook(before)
    post = module.register_forward_hook(after)

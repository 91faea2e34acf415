"""Which path packs a tensor: the Triton kernels (:mod:`dropit_core.backends.triton`) or eager
torch.

``settings.kernels`` (:mod:`dropit_core.settings`, ``$DROPIT_KERNELS``) chooses: ``auto`` (the
default) gives CUDA tensors the kernels when triton imports, CPU tensors the C loops or eager
torch; ``triton`` forces the kernels (on a CPU tensor they need ``TRITON_INTERPRET=1``, which is
how the CPU tests run them); ``eager`` forces eager torch everywhere. Every path writes the same
packed format, so a pack made by one rebuilds with another. Decided from the tensor's device
alone: no sync, and the environment is not read per call (every layer asks, on each pack and
rebuild: host time a GPU step waits on, docs/gpu.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType

import torch

from dropit_core import settings
from dropit_core.backends import native

ENV = settings.ENVIRONMENT["kernels"]

_warned = False


def set_kernels(mode: str | None) -> None:
    """Deprecated: ``dropit_core.configure(kernels=mode)`` (None: ``reset_settings()``)."""
    warnings.warn(
        "dropit_core.backends.dispatch.set_kernels is deprecated: use "
        "dropit_core.configure(kernels=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    if mode is None:
        settings.configure(kernels=settings.Settings.from_environment().kernels)
    else:
        settings.configure(kernels=mode)


def kernel_mode() -> str:
    """The kernels setting in force (``settings.current().kernels``)."""
    return settings.current().kernels


def triton_available() -> bool:
    """Whether triton can be imported (looked up, not imported: cheap to ask per layer)."""
    return _has_triton


def _find_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules["triton"] = None
        return False


_has_triton = _find_triton()


def use_kernels(t: torch.Tensor) -> bool:
    """Whether ``t`` is packed and rebuilt by the Triton kernels."""
    mode = settings.current().kernels
    if mode == "eager":
        return False
    if mode == "triton":
        if not _has_triton:
            raise RuntimeError(f"{ENV}=triton, but triton is not installed")
        return True
    if not t.is_cuda:
        return False
    if not _has_triton:
        _warn_once()
        return False
    return True


def pack_backend(device: torch.device | str) -> str:
    """Which path packs and rebuilds a layer's tensors on ``device``: ``"triton"`` (the
    kernels), ``"native"`` (the CPU's C loops, for the packs they have) or ``"eager"`` (torch
    ops, several launches each); what a run should say once."""
    device = torch.device(device)
    if use_kernels(torch.empty(0, device=device)):
        return "triton"
    return "native" if native.ready(device) else "eager"


def kernels(name: str) -> ModuleType:
    """The kernels module ``dropit_core.backends.triton.<name>``, imported on the first call (it
    imports triton, which a CPU-only run never needs), then held: an import statement in each
    layer's pack and rebuild was host time."""
    module = _MODULES.get(name)
    if module is None:
        module = _MODULES[name] = importlib.import_module(f"{__package__}.triton.{name}")
    return module


_MODULES: dict[str, ModuleType] = {}


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "DropIT: triton is not installed; CUDA tensors use the eager torch path (slower)",
            RuntimeWarning,
            stacklevel=3,
        )

"""Which path packs a tensor: the Triton kernels (:mod:`dropit_core.kernels`) or eager torch.

``auto`` (the default): CUDA tensors take the kernels when triton imports, CPU tensors eager;
``triton`` forces the kernels (on a CPU tensor they need ``TRITON_INTERPRET=1``, which is how the
CPU tests run them); ``eager`` forces eager torch. Set it with the environment variable
``DROPIT_KERNELS`` or :func:`set_kernels` (which wins). Both paths write the same packed format,
so a pack made by one rebuilds with the other. Decided from the tensor's device alone: no sync.

The variable is read on the first question and again after ``set_kernels(None)``, not on every
call: every layer asks, on each pack and rebuild, and reading the environment took about a
microsecond each time (host time that a GPU step waits on, docs/gpu.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch

MODES = ("auto", "triton", "eager")
ENV = "DROPIT_KERNELS"

_mode: str | None = None  # set_kernels' choice; None: the environment's
_env_mode: str | None = None  # $DROPIT_KERNELS as last read; None: read it on the next question
_warned = False


def set_kernels(mode: str | None) -> None:
    """Force the kernels (``"triton"``), eager torch (``"eager"``) or choose by device
    (``"auto"``); ``None`` goes back to ``$DROPIT_KERNELS`` (default ``auto``), read anew."""
    global _mode, _env_mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"DropIT kernels={mode!r} is invalid: allowed {MODES}")
    _mode = mode
    _env_mode = None


def kernel_mode() -> str:
    """The mode in force: :func:`set_kernels`' choice, else ``$DROPIT_KERNELS``, else auto."""
    global _env_mode
    if _mode is not None:
        return _mode
    if _env_mode is None:
        mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if mode not in MODES:
            raise ValueError(f"{ENV}={mode!r} is invalid: allowed {', '.join(MODES)}")
        _env_mode = mode
    return _env_mode


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
    mode = kernel_mode()
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
    kernels) or ``"eager"`` (torch ops, several launches each); what a run should say once."""
    return "triton" if use_kernels(torch.empty(0, device=device)) else "eager"


def kernels(name: str) -> ModuleType:
    """The kernels module ``dropit_core.kernels.<name>``, imported on the first call (it imports
    triton, which a CPU-only run never needs), then held: an import statement in each layer's
    pack and rebuild was host time."""
    module = _MODULES.get(name)
    if module is None:
        module = _MODULES[name] = importlib.import_module(f"{__package__}.kernels.{name}")
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

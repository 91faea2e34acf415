"""Which path packs a tensor: the Triton kernels (:mod:`dropit_core.kernels`) or eager torch.

``auto`` (the default): CUDA tensors take the kernels when triton imports, CPU tensors eager;
``triton`` forces the kernels (on a CPU tensor they need ``TRITON_INTERPRET=1``, which is how the
CPU tests run them); ``eager`` forces eager torch. Set it with the environment variable
``DROPIT_KERNELS`` or :func:`set_kernels` (which wins). Both paths write the same packed format,
so a pack made by one rebuilds with the other. Decided from the tensor's device alone: no sync.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

MODES = ("auto", "triton", "eager")
ENV = "DROPIT_KERNELS"

_mode: str | None = None  # set_kernels' choice; None: the environment's
_warned = False


def set_kernels(mode: str | None) -> None:
    """Force the kernels (``"triton"``), eager torch (``"eager"``) or choose by device
    (``"auto"``); ``None`` goes back to ``$DROPIT_KERNELS`` (default ``auto``)."""
    global _mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"DropIT kernels={mode!r} is invalid: allowed {MODES}")
    _mode = mode


def kernel_mode() -> str:
    """The mode in force: :func:`set_kernels`' choice, else ``$DROPIT_KERNELS``, else auto."""
    if _mode is not None:
        return _mode
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is invalid: allowed {', '.join(MODES)}")
    return mode


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
    if t.device.type != "cuda":
        return False
    if not _has_triton:
        _warn_once()
        return False
    return True


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "DropIT: triton is not installed; CUDA tensors use the eager torch path (slower)",
            RuntimeWarning,
            stacklevel=3,
        )

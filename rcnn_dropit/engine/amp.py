"""Mixed precision, one convention everywhere: solver.amp's "none", "fp16" or "bf16" as the
forward's autocast and, for fp16 on CUDA, the loss scaler."""

from __future__ import annotations

import contextlib

import torch

from rcnn_dropit.errors import UsageError

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
AMP_CHOICES = ("none", *AMP_DTYPES)


def check_amp(amp: str) -> None:
    """Raise a UsageError for an ``amp`` value other than "none", "fp16" or "bf16"."""
    if amp not in AMP_CHOICES:
        raise UsageError(f"amp={amp!r} is invalid: allowed {', '.join(AMP_DTYPES)} or none")


def autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to amp's dtype on the device's type; nothing for "none"."""
    check_amp(amp)
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


def make_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler | None:
    """GradScaler for fp16 on CUDA; bf16 and fp32 need none."""
    if amp != "fp16":
        return None
    if device.type != "cuda":
        raise UsageError("solver.amp: fp16 needs a CUDA device; use bf16 or none on CPU")
    return torch.amp.GradScaler("cuda")

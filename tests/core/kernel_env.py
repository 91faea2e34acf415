"""Where the Triton kernel tests run, and how they compare bytes: compiled on a GPU where there
is one, else under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is defined). A kernel test module skips itself without
triton (``pytest.importorskip``) and marks itself ``pytestmark = NEEDS_KERNELS``."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
NEEDS_KERNELS = pytest.mark.skipif(
    DEVICE.type == "cpu" and not INTERPRETED, reason="kernels on CPU need TRITON_INTERPRET=1"
)
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both None, or bit-identical tensors of one dtype and shape (+0.0 and -0.0 told apart)."""
    if a is None or b is None:
        return a is None and b is None
    width = _WIDTH[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(width), b.view(width))

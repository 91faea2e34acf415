"""Which elements an element-wise pack keeps, stated so that a Triton kernel can decide it per
element (:mod:`dropit_core.backends.triton.compact`): the strategies' ``_kernel_rule``."""

from __future__ import annotations

from typing import NamedTuple

import torch

# KeepRule kinds (the kernels' RULE): |x| >= threshold; |x| > threshold, then the ties in flat
# order while their rank is at most ``left``; a draw u >= gamma; |x| > u * threshold (fp32).
AT_LEAST, TIES, DRAW, IMPORTANCE = 0, 1, 2, 3


class KeepRule(NamedTuple):
    """Which elements a pack keeps, in terms the Triton kernels evaluate per element."""

    kind: int
    threshold: torch.Tensor | None = None  # 0-dim, on the input's device
    left: torch.Tensor | None = None  # TIES: how many ties to keep (0-dim int64)
    seed: int | None = None  # DRAW, IMPORTANCE: the pack's seed (seeds.hash_uniform's)
    gamma: float = 0.0  # DRAW: the draw's lower bound for a kept element

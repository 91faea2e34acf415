"""The torchvision-specific part: a lean forward for torchvision's R-CNNs and a lean frozen norm.

- :mod:`.lean`: ``lean_detector(model)``, the one call that applies both.
- :mod:`.frozen_norm`: a ``FrozenBatchNorm2d`` that keeps its input's dtype under autocast.
- :mod:`.forward`: the R-CNN forward that releases each large map after its last use (imports
  torchvision; the rest of ``dropit_core`` imports torch only).
- :mod:`.pooler`: its RoI pooler, a few images at a time under autocast.
"""

from dropit_core.detection.frozen_norm import (
    FrozenBatchNorm2d,
    is_frozen_batchnorm,
    lean_frozen_batchnorm,
)
from dropit_core.detection.lean import lean_detector

_FORWARD = ("LeanFeaturePyramidNetwork", "LeanMultiScaleRoIAlign", "lean_forward", "lean_fpn")


def __getattr__(name: str):
    # The forward's names load torchvision: only when asked for.
    if name in _FORWARD:
        from dropit_core.detection import forward

        return getattr(forward, name)
    raise AttributeError(f"module 'dropit_core.detection' has no attribute {name!r}")


__all__ = [
    "FrozenBatchNorm2d",
    "is_frozen_batchnorm",
    "lean_detector",
    "lean_frozen_batchnorm",
    *_FORWARD,
]

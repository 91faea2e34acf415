"""The torchvision-specific part (the only one that imports torchvision, and only when used).

- :mod:`.frozen_norm`: a ``FrozenBatchNorm2d`` that keeps its input's dtype under autocast.
- :mod:`.forward`: the R-CNN forward that releases each large map after its last use.
- :mod:`.pooler`: its RoI pooler, a few images at a time under autocast.
"""

from torch import nn

from dropit_core.detection.frozen_norm import FrozenBatchNorm2d, lean_frozen_batchnorm

_FORWARD = ("LeanFeaturePyramidNetwork", "LeanMultiScaleRoIAlign", "lean_forward", "lean_fpn")


def lean_detector(model: nn.Module, fpn: bool = True) -> nn.Module:
    """Make ``model``'s frozen norms and its torchvision detection modules lean, in place, both
    bit for bit torchvision's in fp32; returns ``model``. ``fpn=False`` leaves the FPNs as they
    are (to measure against)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"lean_detector takes an nn.Module, got {type(model).__name__}")
    model = lean_frozen_batchnorm(model)
    if any(type(m).__module__.startswith("torchvision.") for m in model.modules()):
        from dropit_core.detection.forward import lean_forward  # such a model has torchvision

        lean_forward(model, fpn=fpn)
    return model


def __getattr__(name: str):
    # The forward's names load torchvision: only when asked for.
    if name in _FORWARD:
        from dropit_core.detection import forward

        return getattr(forward, name)
    raise AttributeError(f"module 'dropit_core.detection' has no attribute {name!r}")


__all__ = [
    "FrozenBatchNorm2d",
    "lean_detector",
    "lean_frozen_batchnorm",
    *_FORWARD,
]

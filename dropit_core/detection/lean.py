"""One call that makes a torchvision detector lean: the frozen norm and the forward.

``lean_detector(model)`` is :func:`~dropit_core.detection.frozen_norm.lean_frozen_batchnorm` and,
when the model has torchvision's modules, :func:`dropit_core.detection.forward.lean_forward`: both
bit for bit torchvision's in fp32, with the same modules and ``state_dict`` keys. Only
torchvision's own classes change.
"""

from __future__ import annotations

from torch import nn

from dropit_core.detection.frozen_norm import lean_frozen_batchnorm


def lean_detector(model: nn.Module, fpn: bool = True) -> nn.Module:
    """Make ``model``'s frozen norms and its torchvision detection modules lean, in place;
    returns ``model``. ``fpn=False`` leaves the FPNs torchvision's (to measure against)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"lean_detector takes an nn.Module, got {type(model).__name__}")
    model = lean_frozen_batchnorm(model)
    if any(type(m).__module__.startswith("torchvision.") for m in model.modules()):
        from dropit_core.detection.forward import (
            lean_forward,  # needs torchvision, which such a model has
        )

        lean_forward(model, fpn=fpn)
    return model

"""The toolkit's FPN: torchvision's, with the lean forward of dropit_core.lean_detection.

Kept here for code that imports it from the toolkit; ``dropit_core.lean_detector(model)`` is the
one call that makes a whole detector lean (frozen norms, FPN, backbone, detector, poolers).
"""

from __future__ import annotations

from torch import nn
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork

from dropit_core.lean_detection import LeanFeaturePyramidNetwork

__all__ = ["LeanFeaturePyramidNetwork", "lean_fpn"]


def lean_fpn(model: nn.Module) -> nn.Module:
    """Make every torchvision ``FeaturePyramidNetwork`` in ``model`` lean, in place (the same
    modules and parameters: only the forward changes); returns the model."""
    for module in model.modules():
        if type(module) is FeaturePyramidNetwork:
            module.__class__ = LeanFeaturePyramidNetwork
    return model

"""The toolkit's FPN: torchvision's, with the lean forward of dropit_core.detection.forward.

Kept here for code that imports it from the toolkit; ``dropit_core.lean_detector(model)`` is the
one call that makes a whole detector lean (frozen norms, FPN, backbone, detector, poolers).
"""

from dropit_core.detection import LeanFeaturePyramidNetwork, lean_fpn

__all__ = ["LeanFeaturePyramidNetwork", "lean_fpn"]

"""DropIT: cache only the largest-magnitude part of conv/linear inputs for the backward pass.

``to_dropit(model, strategy, gamma, include, exclude, **options)`` converts layers in place;
``from_dropit(model)`` undoes it; ``set_step(model, step)``, called before each training forward,
seeds the random strategies' draws per step and layer (resume stays bit-exact). See
:mod:`dropit_core.strategies` for the strategies and their costs, :mod:`dropit_core.registry`
for their typed options (``REGISTRY``), and :mod:`dropit_core.memory` for measuring what
autograd keeps. ``checkpoint_modules(model, patterns)`` recomputes chosen modules in backward
instead (exact activation checkpointing); DropIT leaves the layers inside them plain.
``CompressSaved()`` is a context manager that keeps every large activation autograd saves as a
4-bit pack, for what ``to_dropit`` cannot convert. ``lean_frozen_batchnorm(model)`` swaps torchvision's FrozenBatchNorm2d for one that keeps its
input's dtype under autocast (bit-equal in fp32; half the activation memory of a pretrained
ResNet under AMP).
"""

from .base import Packed, Strategy
from .frozen_norm import FrozenBatchNorm2d, is_frozen_batchnorm, lean_frozen_batchnorm
from .packing import VALUE_FORMATS
from .patch import (
    CHECKPOINTED_ATTRIBUTE,
    AppliedSetting,
    ConvertedLayer,
    DropITRecord,
    from_dropit,
    is_dropit,
    set_step,
    to_dropit,
)
from .recompute import checkpoint_modules, is_checkpointed, uncheckpoint_modules
from .registry import Option, Registry
from .rules import PAPER_EXCLUDE, Rule, check_options, check_rules
from .saved import CompressSaved
from .strategies import REGISTRY, STRATEGIES, build_strategy

register_strategy = REGISTRY.register  # a strategy of your own, by name or class to to_dropit

__all__ = [
    "CHECKPOINTED_ATTRIBUTE",
    "CompressSaved",
    "PAPER_EXCLUDE",
    "REGISTRY",
    "STRATEGIES",
    "VALUE_FORMATS",
    "AppliedSetting",
    "ConvertedLayer",
    "DropITRecord",
    "FrozenBatchNorm2d",
    "Option",
    "Packed",
    "Registry",
    "Rule",
    "Strategy",
    "build_strategy",
    "check_options",
    "checkpoint_modules",
    "check_rules",
    "from_dropit",
    "is_checkpointed",
    "is_dropit",
    "is_frozen_batchnorm",
    "lean_frozen_batchnorm",
    "register_strategy",
    "set_step",
    "to_dropit",
    "uncheckpoint_modules",
]

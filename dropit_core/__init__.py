"""DropIT: cache only the largest-magnitude part of conv/linear inputs for the backward pass.

``to_dropit(model, strategy, gamma, include, exclude, **options)`` converts layers in place;
``from_dropit(model)`` undoes it. See :mod:`dropit_core.strategies` for the strategies and their
costs, :mod:`dropit_core.registry` for their typed options (``REGISTRY``), and
:mod:`dropit_core.memory` for measuring what autograd keeps.
"""

from .packing import VALUE_FORMATS
from .patch import ConvertedLayer, from_dropit, is_dropit, to_dropit
from .registry import Option, Registry
from .strategies import REGISTRY, STRATEGIES, STRATEGY_OPTIONS, Strategy, build_strategy

__all__ = [
    "REGISTRY",
    "STRATEGIES",
    "STRATEGY_OPTIONS",
    "VALUE_FORMATS",
    "ConvertedLayer",
    "Option",
    "Registry",
    "Strategy",
    "build_strategy",
    "from_dropit",
    "is_dropit",
    "to_dropit",
]

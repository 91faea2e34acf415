"""DropIT: conv and linear layers keep a compressed copy of their input for the weight gradient.

``to_dropit(model, strategy, gamma, include, exclude, ...)`` converts the layers its patterns
select, in place (a ReLU keeps a 1-bit mask where no plain layer keeps its output);
``dropit_record`` says what it converted and ``from_dropit`` undoes it. ``REGISTRY`` lists the
strategies and their typed options (``python -m dropit_core`` prints the tables of
docs/dropit.md); ``register_strategy`` adds one. ``set_step(model, step, rank)`` seeds the random
draws before each training forward, so that a resumed run draws what the original drew.

Where things are (each subpackage's docstring maps its modules):

- top level, the entry points: :mod:`.convert` (``to_dropit``, ``set_step``, the record),
  :mod:`.rules` (which layers get which setting), :mod:`.readers` (what reads each ReLU's
  output, so which ReLUs a mask frees), :mod:`.recompute` (checkpointing), :mod:`.saved`
  (``compress_saved``: every saved tensor as a 4-bit pack), :mod:`.settings` (the switches),
  :mod:`.registry` (the strategy registry's types), :mod:`.memory` (what autograd keeps, peaks).
- :mod:`.strategies` (what a layer keeps), :mod:`.formats` (each pack format, specified once),
  :mod:`.layers` (where it runs: a module per op), :mod:`.backends` (how fast: the C loops, the
  Triton kernels) and :mod:`.detection` (the only part that imports torchvision).
"""

from dropit_core.backends.dispatch import pack_backend
from dropit_core.convert import (
    AppliedSetting,
    ConvertedLayer,
    DropITRecord,
    dropit_record,
    dropped_values,
    from_dropit,
    is_dropit,
    set_step,
    to_dropit,
)
from dropit_core.detection import (
    FrozenBatchNorm2d,
    lean_detector,
    lean_frozen_batchnorm,
)
from dropit_core.formats.packed import Packed
from dropit_core.formats.values import VALUE_FORMATS
from dropit_core.readers import relu_readers
from dropit_core.recompute import checkpoint_modules, is_checkpointed, uncheckpoint_modules
from dropit_core.registry import Option, Registry
from dropit_core.rules import PAPER_EXCLUDE, Rule, check_rules
from dropit_core.saved import CompressSaved, compress_saved, saved_compression
from dropit_core.settings import Settings, configure, override_settings, reset_settings
from dropit_core.settings import current as current_settings
from dropit_core.strategies.base import Strategy
from dropit_core.strategies.catalog import REGISTRY, STRATEGIES, build_strategy

register_strategy = REGISTRY.register  # a strategy of your own, by name or class to to_dropit

__all__ = [
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
    "Settings",
    "Strategy",
    "build_strategy",
    "checkpoint_modules",
    "compress_saved",
    "configure",
    "current_settings",
    "check_rules",
    "dropit_record",
    "dropped_values",
    "from_dropit",
    "is_checkpointed",
    "is_dropit",
    "lean_detector",
    "lean_frozen_batchnorm",
    "override_settings",
    "pack_backend",
    "register_strategy",
    "relu_readers",
    "reset_settings",
    "saved_compression",
    "set_step",
    "to_dropit",
    "uncheckpoint_modules",
]

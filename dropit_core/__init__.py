"""DropIT: conv and linear layers keep a compressed copy of their input for the weight gradient.

``to_dropit(model, strategy, gamma, include, exclude, strict=True, **options)`` converts the
``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Linear`` and ``nn.ReLU`` modules its patterns select,
in place (a ReLU keeps a 1-bit mask where no plain layer keeps its output), and returns the model;
``dropit_record(model)`` says what it converted and ``from_dropit(model)`` undoes it. What a
layer keeps is its strategy (``REGISTRY`` lists them with their typed options; ``python -m
dropit_core`` prints the tables):

- ``mink`` (the paper's), ``parallel_mink``, ``threshold``: the largest-magnitude ``1 - gamma``
  of the elements (biased: the small ones are always dropped);
- ``random`` (optionally rescaled), ``importance`` (kept with probability proportional to the
  magnitude, rescaled: unbiased);
- ``quant``: every element at 2, 4 or 8 bits per group, stochastically rounded (unbiased; the
  accuracy study's pick at 4 bits);
- ``channel_mink``, ``channel_random``, ``block_mink``, ``pool``: whole channels, feature
  columns or blocks, or a pooled copy.

``register_strategy`` adds one of your own (or pass its class to ``to_dropit``). Strategies that
draw at random are seeded per step and layer by ``set_step(model, step, rank)``, called before each
training forward: without it the draws still differ from step to step, but a resumed run draws
differently from an uninterrupted one. ``checkpoint_modules(model, patterns)`` recomputes chosen
modules in backward instead (exact); DropIT leaves the layers inside them plain.
``pack_backend(device)`` says whether packs on a device run through the Triton kernels, the CPU's C
loops or eager torch. ``dropped_values(model)`` reads how many values the GPU's packs, sized from
the shape, could not store (normally 0). ``CompressSaved()`` keeps every large tensor autograd saves
as a 4-bit pack, for what ``to_dropit`` cannot convert; ``compress_saved(model)`` opens that block
around each training forward, for a loop that cannot be edited. ``lean_frozen_batchnorm(model)``
swaps torchvision's ``FrozenBatchNorm2d`` for one that keeps its input's dtype under autocast
(bit-equal in fp32); ``lean_detector(model)`` does that and gives a torchvision R-CNN a forward that
releases each large map after its last use (bit-equal in fp32 too). ``dropit_core.memory`` measures
what autograd keeps and the memory of a training step. ``configure(kernels=..., native=...,
fuse=...)``, ``override_settings`` (a ``with`` block) and ``current_settings()`` hold
how DropIT runs (:mod:`dropit_core.settings`, read from the ``DROPIT_*`` environment once).

Where things are (each subpackage's docstring maps its modules):

- top level, the entry points: :mod:`.convert` (``to_dropit``, ``set_step``, the record),
  :mod:`.rules` (which layers get which setting), :mod:`.readers` (what reads each ReLU's
  output, so which ReLUs a mask frees: ``relu_readers``), :mod:`.recompute` (checkpointing),
  :mod:`.saved` (``compress_saved``), :mod:`.settings` (the switches), :mod:`.registry` (the
  strategy registry's types), :mod:`.memory` (what autograd keeps, peaks), :mod:`.timing` (step
  timing).
- :mod:`.strategies`: what a layer keeps, one module per family, and ``REGISTRY``.
- :mod:`.formats`: each pack format specified once (quant's in :mod:`.formats.quant`), the seeds'
  hash, the bit masks and the kept values' encodings.
- :mod:`.layers`: where it runs: one module per op (conv, linear, ReLU, norms, pooling), each
  with its autograd Function and its ``torch.library`` operator, and the input cache.
- :mod:`.backends`: how fast: the choice (:mod:`.backends.dispatch`), the C loops, the Triton
  kernels (quant on a GPU: :mod:`.backends.triton.quant`).
- :mod:`.detection`: the torchvision-specific lean forward and frozen norm (the only part that
  imports torchvision).
"""

from dropit_core.backends.dispatch import pack_backend
from dropit_core.convert import (
    CHECKPOINTED_ATTRIBUTE,
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
from dropit_core.detection.frozen_norm import (
    FrozenBatchNorm2d,
    is_frozen_batchnorm,
    lean_frozen_batchnorm,
)
from dropit_core.detection.lean import lean_detector
from dropit_core.formats.packed import Packed
from dropit_core.formats.values import VALUE_FORMATS
from dropit_core.readers import relu_readers
from dropit_core.recompute import checkpoint_modules, is_checkpointed, uncheckpoint_modules
from dropit_core.registry import Option, Registry
from dropit_core.rules import PAPER_EXCLUDE, Rule, check_options, check_rules
from dropit_core.saved import CompressSaved, SavedCompression, compress_saved, saved_compression
from dropit_core.settings import Settings, configure, override_settings, reset_settings
from dropit_core.settings import current as current_settings
from dropit_core.strategies.base import Strategy
from dropit_core.strategies.catalog import REGISTRY, STRATEGIES, build_strategy

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
    "SavedCompression",
    "Settings",
    "Strategy",
    "build_strategy",
    "check_options",
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
    "is_frozen_batchnorm",
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

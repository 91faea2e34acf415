"""Which elements of a layer input to keep for the weight gradient, and how to rebuild the rest.

Every strategy packs a layer input ``x`` into a :class:`~dropit_core.formats.packed.Packed`
(:meth:`Strategy.pack`) and rebuilds a dense tensor of ``x``'s shape from it in backward
(:meth:`Strategy.unpack`); dropped elements come back as zeros (pooling: as block means).
``REGISTRY``, at the end, lists the strategy classes (:mod:`dropit_core.registry`); their base
class is in :mod:`dropit_core.strategies.base`.

Layouts: ``"conv"`` inputs are ``(..., H, W)``; a *plane* is one ``H x W`` map of one sample
and channel. ``"linear"`` inputs are ``(..., F)``, seen as an ``R x F`` matrix; a *channel* is
one of the F feature columns.

Costs in the forward, for an input of n elements and a kept fraction ``1 - gamma`` (a backward
scatters the kept values back); what a cache holds is each class's ``cache_bytes`` (``python -m
dropit_core`` prints them), ``v`` bytes per stored value (4 fp32, 2 fp16/bf16, 1 int8 + 4 per
``int8_chunk``, 1/2 int4 + 4 per ``int4_chunk``). "Unbiased": the rebuilt input equals the input
in expectation over the pack's random draws, and so does the weight gradient:

==============  ====================================================================================
strategy        extra time in forward
==============  ====================================================================================
mink            the exact global k-th |x|, no dense copy (CPU: bracketed by a 64Ki sample; GPU: a
                radix select, two histogram passes)
parallel_mink   top-k inside chunks of D elements
random          one random number per element; ``scale``: times 1/(1-gamma), unbiased
threshold       gamma-quantile of ~64Ki |x| at a prime stride: O(n), no sort; count approximate
importance      tau from a sort of ~64Ki |x|, one random number per element; unbiased (backward:
                max(|v|, tau)); kept count random
channel_mink    one L2 norm per plane, top-k over planes
channel_random  a permutation of the planes
block_mink      one L2 norm per b x b block, top-k blocks
pool            one average pool (f from gamma or option)
quant           min/max per group, one random number per element; unbiased; gamma unused
                (backward: a dense multiply-add)
==============  ====================================================================================

``kept``: ``int((1 - gamma) * n)`` for mink, per chunk for parallel_mink (on the CPU ties with the
threshold too; zeros are never stored). On a GPU the element-wise strategies size their values
from the shape (:mod:`dropit_core.strategies.elementwise`): ``kept`` is then a capacity, k for
mink and parallel_mink (ties in flat order until k), and for threshold, importance and random the
expected count plus 8 standard deviations plus 64 (at 4Mi elements and gamma 0.8: 1.064x the
expected count for threshold and importance, 1.008x for random), plus 8 bytes counting what did
not fit (``dropit_core.dropped_values``). ``sparse_bits`` keeps min(n/8, capacity) mask bytes.
"""

from __future__ import annotations

import numbers
from typing import Any

from dropit_core.formats.values import ValueCodec
from dropit_core.registry import Registry
from dropit_core.strategies.base import CODEC_OPTIONS, COMMON_OPTIONS, Strategy
from dropit_core.strategies.importance import Importance
from dropit_core.strategies.magnitude import MinK, ParallelMinK, RandomKeep, Threshold
from dropit_core.strategies.quant import Quant
from dropit_core.strategies.structured import BlockMinK, ChannelMinK, ChannelRandom, Pool

# The one list of strategies, in the order users see them (config choices, messages, docs).
REGISTRY = Registry(
    (
        MinK,
        ParallelMinK,
        RandomKeep,
        Threshold,
        Importance,
        ChannelMinK,
        ChannelRandom,
        BlockMinK,
        Pool,
        Quant,
    ),
    COMMON_OPTIONS,
)
STRATEGIES: tuple[str, ...] = REGISTRY.names


def build_strategy(name: str | type, gamma: float, **options: Any) -> Strategy:
    """Validate a strategy (a registered name, or a strategy class), gamma and options against
    ``REGISTRY``; return the strategy."""
    cls = REGISTRY.get(name)
    name = cls.name
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):  # numpy floats too
        raise ValueError(f"DropIT gamma={gamma!r} is not a number: allowed 0 <= gamma < 1")
    gamma = float(gamma)
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"DropIT gamma={gamma} is out of range: allowed 0 <= gamma < 1")
    resolved = REGISTRY.resolve(name, options)
    codec = ValueCodec(
        **{field: resolved.pop(key) for key, field in CODEC_OPTIONS.items() if key in resolved}
    )
    return cls(gamma, codec, resolved.pop("rescale"), **resolved)

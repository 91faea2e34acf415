"""Which elements of a layer input to keep for the weight gradient, and how to rebuild the rest.

Every strategy turns a layer input ``x`` into a :class:`~dropit_core.formats.packed.Packed`: a few
small tensors in named fields plus a named tuple of plain-Python metadata (:meth:`Strategy.pack`)
and rebuilds a dense tensor of ``x``'s shape from it in backward (:meth:`Strategy.unpack`). Dropped
elements come back as zeros (pooling: as block means). Each strategy class declares its name
and typed options; ``REGISTRY``, at the end, lists them (see :mod:`dropit_core.registry`). The
base class and the options every strategy takes live in :mod:`dropit_core.formats.packed`, the
slice-by-slice element-wise pack in :mod:`dropit_core.strategies.elementwise`.

Layouts: ``"conv"`` inputs are ``(..., H, W)``; a *plane* is one ``H x W`` map of one sample
and channel. ``"linear"`` inputs are ``(..., F)``, seen as an ``R x F`` matrix; a *channel* is
one of the F feature columns.

Costs, for an input of n elements, kept fraction ``1 - gamma``, ``v`` bytes per stored value
(4 fp32, 2 fp16/bf16, 1 int8 + 4 bytes of scale per ``int8_chunk`` values, 1/2 int4 + 4 bytes
per ``int4_chunk``); "unbiased": the rebuilt input equals the input in expectation over the
pack's random draws (:mod:`dropit_core.strategies.importance`), so does the weight gradient:

================  =====================================  ===========================================
strategy          cache bytes                            extra time in forward (backward: a scatter)
================  =====================================  ===========================================
mink              ceil(n/8) + kept*v                     the exact global k-th value of |x|
                                                         (the published method): on the CPU
                                                         bracketed by a 64Ki sample, the values
                                                         above its low end gathered slice by
                                                         slice; on a GPU a radix select (two
                                                         histogram passes); no dense copy
parallel_mink     ceil(n/8) + kept*v                     top-k inside chunks of D elements, in
                                                         slices of ~4M elements: no dense temporary
random            kept*v (mask rebuilt from a seed)      one random number per element (see below);
                                                         ``scale``: kept values times 1/(1-gamma),
                                                         unbiased (backward: one pass over them)
threshold         ceil(n/8) + kept*v                     gamma-quantile of ~64Ki |x| read at a
                                                         prime stride: O(n), no sort; kept count
                                                         approximate
importance        ceil(n/8) + kept*v + 4 (tau, fp32)     tau from a sort of ~64Ki |x| (water
                                                         filling), one random number per element;
                                                         unbiased (backward: max(|v|, tau) on the
                                                         kept values); kept count random
channel_mink      kept_planes*(H*W)*v + 4*kept_planes    one L2 norm per plane, top-k over planes
channel_random    same as channel_mink                   a permutation of the planes
block_mink        kept_blocks*b*b*v + 4*kept_blocks      one L2 norm per b x b block, top-k blocks
pool              ceil(H/f)*ceil(W/f)*planes*v           one average pool (f from gamma or option)
quant             ceil(n*bits/8) + 8*ceil(n/group)       min/max per group, one random number per
                                                         element; unbiased; gamma unused (backward:
                                                         a dense multiply-add)
================  =====================================  ===========================================

``kept`` is ``int((1 - gamma) * n)`` for mink and per chunk for parallel_mink; on the CPU
elements tied with the threshold are kept too, and zeros are never stored (they rebuild as zeros
anyway).

On a GPU the element-wise strategies size their values from the shape, so that no host waits for
the device (:mod:`dropit_core.strategies.elementwise`): ``kept`` above is then the capacity, k for
mink and parallel_mink (ties with the k-th value are taken in flat order until k), and for
threshold, importance and random the expected count plus 8 standard deviations plus 64 (at 4Mi
elements and gamma 0.8: 1.064x the expected count for threshold and importance, 1.008x for random),
plus 8 bytes counting what did not fit (``Packed.dropped``, summed per model by
``dropit_core.dropped_values``); slots past the kept values hold zeros. ``sparse_bits`` keeps
min(n/8, capacity) mask bytes there.

Random draws are seeded per pack from the strategy's ``seed`` and a key
(:mod:`dropit_core.formats.seeds`) that the layers' InputCache derives from the training step and
the pack's place in the forward: call ``dropit_core.set_step(model, step)`` before each forward and
a resumed run draws the same.
"""

from __future__ import annotations

import numbers
from typing import Any

from dropit_core.formats.values import ValueCodec
from dropit_core.registry import Registry
from dropit_core.strategies.base import (
    CODEC_OPTIONS,
    COMMON_OPTIONS,
    Strategy,
)
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

"""The one list of strategies, ``REGISTRY``, and ``build_strategy``.

Dropped elements rebuild as zeros (pooling: as block means); what each strategy keeps and costs,
its ``keeps`` and ``cache_bytes``, is tabled in docs/dropit.md.

Layouts: ``"conv"`` inputs are ``(..., H, W)``; a *plane* is one ``H x W`` map of one sample
and channel. ``"linear"`` inputs are ``(..., F)``, seen as an ``R x F`` matrix; a *channel* is
one of the F feature columns.
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
    """Validate a strategy (a registered name or class), gamma and options; return the strategy."""
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

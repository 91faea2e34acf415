"""What a layer keeps: the strategies, one module per family, and the one list of them.

- :mod:`.catalog`: ``REGISTRY`` (every strategy in the order users see them), ``build_strategy``
  and the table of what each one costs.
- :mod:`.base`: the :class:`~.base.Strategy` base class and the options every strategy takes.
- :mod:`.magnitude`: ``mink`` (the paper's), ``parallel_mink``, ``threshold``, ``random``.
- :mod:`.importance`: ``importance``, unbiased sampling by magnitude.
- :mod:`.quant`: ``quant``, every element as a stochastically rounded group code.
- :mod:`.structured`: ``channel_mink``, ``channel_random``, ``block_mink``, ``pool``.
- :mod:`.elementwise`: the slice-by-slice pack and rebuild the element-wise families share.
- :mod:`.select`: the exact k-th largest magnitude, with small temporaries.
"""

from dropit_core.strategies.catalog import REGISTRY, STRATEGIES, build_strategy
from dropit_core.strategies.importance import Importance
from dropit_core.strategies.magnitude import MinK, ParallelMinK, RandomKeep, Threshold
from dropit_core.strategies.quant import Quant
from dropit_core.strategies.structured import BlockMinK, ChannelMinK, ChannelRandom, Pool

__all__ = [
    "REGISTRY",
    "STRATEGIES",
    "BlockMinK",
    "ChannelMinK",
    "ChannelRandom",
    "Importance",
    "MinK",
    "ParallelMinK",
    "Pool",
    "Quant",
    "RandomKeep",
    "Threshold",
    "build_strategy",
]

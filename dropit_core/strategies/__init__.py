"""What a layer keeps: the strategies, one module per family, and the one list of them.

- :mod:`.catalog`: ``REGISTRY`` and ``build_strategy``; :mod:`.base`: the ``Strategy`` base.
- :mod:`.magnitude`: ``mink``, ``parallel_mink``, ``threshold``, ``random``.
- :mod:`.importance`: ``importance``; :mod:`.quant`: ``quant``.
- :mod:`.structured`: ``channel_mink``, ``channel_random``, ``block_mink``, ``pool``.
- :mod:`.elementwise`: the pack the element-wise families share; :mod:`.select`: the exact
  k-th largest magnitude.
"""

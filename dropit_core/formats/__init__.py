"""Each pack format, specified once: the fields, sizes and rules every backend writes and reads.

- :mod:`.packed`: :class:`~.packed.Packed`, the cache every strategy returns, and its metadata.
- :mod:`.quant`: quant's format and its eager reference pack and rebuild.
- :mod:`.seeds`: the counter hash and the seeds derived from it (every backend's draws).
- :mod:`.bits`: the torch byte packer, 1-bit masks, compaction of kept values, their rebuild.
- :mod:`.keep_rule`: which elements an element-wise pack keeps, for every backend.
- :mod:`.values`: how sparse packs store their kept values (``same`` to ``int4``).
"""

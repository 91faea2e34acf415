"""Host-side arithmetic of a launch, in plain Python: ``triton.cdiv`` and ``next_power_of_2`` are
jit functions, several microseconds per host call, and a GPU step waits on the host.
"""

from __future__ import annotations

from functools import cache


def cdiv(n: int, per: int) -> int:
    """Programs of ``per`` elements that cover ``n``: ``triton.cdiv``."""
    return -(-n // per)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` >= 1: ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@cache
def tile(group: int, block: int) -> tuple[int, int]:
    """(the group's width as a power of two, groups per program) for ``block`` elements."""
    width = next_power_of_2(group)
    return width, max(1, block // width)

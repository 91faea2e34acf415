"""The eager DropIT convolution (plain or transposed) without a Python autograd Function: less host
time per layer.

A Python ``autograd.Function`` pays its own machinery on every call, forward and backward. Here
the conv is aten's own op, whose C++ autograd node keeps its input and weight for backward; a
saved-tensor hook, pushed for that one call, hands the input to the layer's cache to pack and the
weight back as it is, and in backward hands the node the rebuilt input. The same op, pack draw
and backward call: the bytes and gradients of
:class:`~dropit_core.layers.functions.DropITConvFunction` (tests/core/test_dropit_hooked.py).

A layer takes this path only where the Function would do just that (:func:`takes`):

- its weight trains (a frozen conv's Function keeps no input at all; aten's node would);
- its input is smaller than ``ops.SPLIT_BYTES`` (a larger one takes the Function's backward in
  turn, which frees the rebuilt map before the input gradient is made);
- no other saved-tensor hooks are active: only the innermost pair runs, so ``compress_saved``,
  a memory count or any user's hooks would not see the conv's tensors while ours is pushed.
  With them the layer runs the Function, which they see as they always did.

``DROPIT_HOOKED=0`` (or ``configure(hooked=False)``) makes every eager conv run its Function.
"""

from __future__ import annotations

from typing import Any

import torch

from dropit_core import settings
from dropit_core.formats.packed import Packed, refuse_double_backward

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_top = torch._C._autograd._top_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled


def takes(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None, limit: int) -> bool:
    """Whether a conv of ``x`` (computed in ``dtype``, None: its own) runs through the hooks:
    a trained weight, an input of fewer than ``limit`` bytes in the compute dtype, no other
    saved-tensor hooks active."""
    itemsize = x.itemsize if dtype is None else dtype.itemsize
    return (
        settings.current().hooked
        and weight.requires_grad
        and x.numel() * itemsize < limit
        and _top(False) is None
        and _hooks_enabled()
    )


class SavedInputHooks:
    """The pack and unpack hooks of one cache's hooked convs. While its conv runs, ``weight`` is
    the weight the op was given (it comes back as it is: the input gradient reads it) and the
    other tensor the op saves, its input, is packed; ``source`` is the tensor that input was cast
    from under autocast (the key layers fed the same tensor share a pack by), ``dtype`` the
    compute dtype. Both are cleared after the call, so no weight cast or input outlives it here.
    A cache is one thread's, as its draw counter is."""

    __slots__ = ("cache", "weight", "source", "dtype", "pair")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.weight: torch.Tensor | None = None
        self.source: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.pair = (self.pack, self.unpack)  # bound once: two method objects per call otherwise

    def pack(self, t: torch.Tensor) -> Any:
        if t is self.weight:
            return t
        return self.cache.pack(t, "conv", self.source, self.dtype)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, Packed):
            return saved
        refuse_double_backward()
        self.cache.end_forward()  # a backward has begun: this forward's packs are no more shared
        return self.cache.unpack(saved)


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: tuple,
    hooks: SavedInputHooks,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """``torch.convolution`` of ``x`` (cast to ``dtype`` when given: autocast's) with its saved
    input packed by ``hooks``' cache; ``weight`` and ``bias`` are cast already."""
    used = x if dtype is None else x.to(dtype)
    hooks.weight, hooks.dtype = weight, dtype
    hooks.source = None if used is x else x
    _push(*hooks.pair)
    try:
        return torch.convolution(used, weight, bias, *args)
    finally:
        _pop()
        hooks.weight = hooks.source = None

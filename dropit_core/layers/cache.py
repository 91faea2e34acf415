"""A DropIT layer's input cache (:class:`InputCache`; its draws as device data, :class:`KeyTable`);
a layer's Function keeps its pack (:func:`keep_packed`) and reads it back (:func:`kept_packed`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence

import torch

from dropit_core.formats.packed import (
    Packed,
    keep_pack,
    pack_made,
    refuse_double_backward,
    tag_pack,
)
from dropit_core.formats.seeds import mix_part, mix_state, seed_of
from dropit_core.layers.casts import ParamCasts
from dropit_core.strategies.base import Strategy

# The caches by number: a torch.library operator (layers.library) names a cache by its number.
_CACHES: weakref.WeakValueDictionary[int, InputCache] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count(1)

# The attribute of a layer input that holds its pack: (forward, version, layout, dtype, pack).
# Forward numbers are unique across caches, so two caches never take each other's pack.
_SHARED = "_dropit_shared_pack"
_FORWARDS = itertools.count(1)

# Rows of a cache's key table on a device: the packs one forward draws, with room (R50-FPN Mask
# R-CNN: 97 conv and linear layers, the RPN head's three once per FPN level).
KEY_ROWS = 256
# Draw keys an input cache makes at a time (InputCache.next_key): at first, and at most.
KEY_BLOCK, MAX_KEY_BLOCK = 32, 4096


def cache_by_number(number: int) -> InputCache:
    cache = _CACHES.get(number)
    if cache is None:
        raise RuntimeError(f"DropIT: the input cache #{number} of a compiled graph is gone")
    return cache


class InputCache:
    """Packs layer inputs with one strategy, sharing a pack between layers fed the same tensor (a
    ResNet block's input feeds conv1 and the downsample conv: one pack's work and bytes instead
    of two): the pack rides on the tensor, so it dies with it, and a backward or a new step makes
    it stale (a tensor the caller keeps past the step keeps its last pack until it is packed
    again: a fraction of its own bytes).

    Each pack that draws is keyed by (rank, ``stream``, step, its position among the step's
    packs): the forward order is deterministic, so :meth:`set_step` makes a resumed run draw what
    the original drew. ``dropped`` sums, on the device, the values packs sized from the shape
    chose but could not store; None until a pack reports some.
    """

    def __init__(self, strategy: Strategy, stream: int = 0) -> None:
        self.strategy = strategy
        self.stream = stream  # tells the caches of one model apart (one per rule)
        self.step = 0
        self.rank = 0
        self.position = 0
        self._prefix = mix_state(0, self.rank, self.stream, self.step)
        # The keys of positions _block_first on, made together (next_key reads them), and how
        # many to make next time: the last step's draws, so one block serves a whole step.
        self._block: list[int] = []
        self._block_first = 0
        self._block_size = KEY_BLOCK
        self._forward = next(_FORWARDS)  # names this cache's current forward on its packs
        self.casts = ParamCasts()  # autocast's weight casts, shared by the calls of a forward
        self.dropped: torch.Tensor | None = None
        self.number = next(_NUMBERS)  # how the torch.library operators name it (library.py)
        _CACHES[self.number] = self
        self.keys = KeyTable(self)  # the step's draws as device data (draw_row)

    def set_step(self, step: int, rank: int = 0) -> None:
        """Start the random streams of training step ``step`` (on process ``rank``); packs of
        earlier steps are forgotten, and the step's first block of draw keys is made here."""
        self._block_size = max(KEY_BLOCK, self.position)
        self.step, self.rank, self.position = step, rank, 0
        self._prefix = mix_state(0, rank, self.stream, step)
        self._block = []
        if self.strategy.draws:
            self._next_block()
        self._forward = next(_FORWARDS)
        self.keys.new_step()

    def draw_row(self, device: torch.device) -> torch.Tensor:
        """The next pack's draw as device data, ``(k0, k1, 0)`` int64, from the key table on
        ``device`` that ``set_step`` rewrites in place: a CUDA graph's replay draws each step's."""
        position = self.position
        self.next_key()  # moves on as eager does (its row holds this key's hash keys)
        return self.keys.row(position, device).clone()

    def next_key(self) -> int:
        """The key of the next pack that draws, and move on."""
        at = self.position - self._block_first
        if not 0 <= at < len(self._block):
            self._next_block()
            at = 0
        self.position += 1
        return self._block[at]

    def _next_block(self) -> None:
        """Make the next positions' keys together on a tensor (host time), and let the strategy
        derive its draws from them (``remember_draws``)."""
        count = min(max(self._block_size, 2 * len(self._block)), MAX_KEY_BLOCK)
        keys = self.key_at(torch.arange(self.position, self.position + count))
        self._block_first, self._block = self.position, keys.tolist()
        self.strategy.remember_draws(keys)

    def key_at(self, position: int | torch.Tensor) -> int | torch.Tensor:
        """``mix_seed(rank, stream, step, position)`` (three folded in set_step), int or tensor."""
        return seed_of(mix_part(self._prefix, position))

    def pack(
        self,
        x: torch.Tensor,
        layout: str,
        source: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> Packed:
        """Pack ``x`` as ``dtype`` values (default its own), or return this forward's pack of the
        same tensor: ``source`` (the tensor ``x`` was cast from) when given, else ``x``."""
        key = x if source is None else source
        dtype = x.dtype if dtype is None else dtype
        made = (self._forward, key._version, layout, dtype)
        hit = pack_made(key, _SHARED, made)
        if hit is not None:
            return hit
        draw = self.next_key() if self.strategy.draws else 0
        if dtype == x.dtype:  # the usual call (strategies that override pack take it)
            packed = self.strategy.pack(x, layout, draw)
        else:
            packed = self.strategy.pack(x, layout, draw, dtype)
        if packed.dropped is not None:  # a device-side sum: reading it is the caller's choice
            self.dropped = packed.dropped if self.dropped is None else self.dropped + packed.dropped
        keep_pack(key, _SHARED, made, packed)
        return packed

    def end_forward(self) -> None:
        """Forget this forward's packs (a backward has begun): a tensor fed again packs afresh,
        with a new draw, even without ``set_step``."""
        self._forward = next(_FORWARDS)

    def unpack(self, packed: Packed) -> torch.Tensor:
        return self.strategy.unpack(packed)

    def unpack_part(self, packed: Packed, start: int, stop: int) -> torch.Tensor | None:
        """``Strategy.unpack_part``: elements ``[start, stop)`` of the rebuilt input, or None."""
        return self.strategy.unpack_part(packed, start, stop)

    # A copy starts with no packs and no casts, at the same place in the random streams.
    _STATE = ("strategy", "stream", "step", "rank", "position")

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self._STATE}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["strategy"], state["stream"])
        self.set_step(state["step"], state["rank"])
        self.position = state["position"]


class KeyTable:
    """A cache's draws as device data: row p holds ``(k0, k1, 0)``, the hash keys of the step's
    key at position p, rewritten in place each step (a recorded CUDA graph reads them)."""

    def __init__(self, cache: InputCache) -> None:
        self.cache = cache
        self.table: torch.Tensor | None = None
        self.read = 0  # rows a forward has read: new_step rewrites those
        self.fresh = 0  # rows holding this step's keys

    def new_step(self) -> None:
        """The cache began a step: its rows read so far get the step's keys, in place."""
        if self.table is not None:
            self.table[: self.read].copy_(self._rows(0, self.read))
        self.fresh = self.read

    def row(self, position: int, device: torch.device) -> torch.Tensor:
        table = self.table
        if table is None or table.device != device or position >= len(table):
            # Sized once, before a graph records (its first forwards run eagerly): a table
            # moved or grown later would leave a recorded graph reading the old one.
            rows = max(KEY_ROWS, 2 * position + 2)
            table = self.table = self._rows(0, rows).to(device)
            self.fresh = rows
        elif position >= self.fresh:  # past the rows new_step rewrote: this step's, now
            table[self.fresh : position + 1].copy_(self._rows(self.fresh, position + 1))
            self.fresh = position + 1
        self.read = max(self.read, position + 1)
        return table[position]

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        cache = self.cache
        k0, k1 = cache.strategy.draw_keys(cache.key_at(torch.arange(start, stop)))
        return torch.stack([k0, k1, torch.zeros_like(k0)], 1)


def keep_packed(ctx, cache: InputCache, packed: Packed | None, *rest: torch.Tensor | None) -> None:
    """Keep for a Function's backward the tensors ``rest`` and ``packed`` (None: no pack), the
    tensors through ``save_for_backward`` (saved-tensor hooks see every byte), the meta on ctx."""
    ctx.cache, ctx.rest = cache, len(rest)
    ctx.meta = None if packed is None else packed.meta
    if packed is None:
        ctx.save_for_backward(*rest)
        return
    tag_pack(packed)  # before compress_saved's hooks, if any, see its tensors
    ctx.save_for_backward(*rest, *packed[1:])


def kept_packed(ctx) -> tuple[list[torch.Tensor | None], Packed | None]:
    """(the tensors :func:`keep_packed` kept besides the pack, the pack or None), for a backward
    (a double backward is refused; the forward is over)."""
    refuse_double_backward()
    ctx.cache.end_forward()
    saved = ctx.saved_tensors
    packed = None if ctx.meta is None else Packed(ctx.meta, *saved[ctx.rest :])
    return list(saved[: ctx.rest]), packed


# A layer's (input, weight, bias) gradients, None where not needed
Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def forward_and_pack(
    ctx,
    op,
    layout: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias,
    cache: InputCache,
    dtype,
    *args,
) -> torch.Tensor:
    """``op(x, weight, bias, *args)`` of ``x`` cast to ``dtype`` (autocast's; None: as it is),
    keeping the weight and, when it trains, the pack of the op's input, keyed by ``x``. A
    strategy that reads through the cast (quant) packs ``x`` itself: the cast dies with the op."""
    used = x if dtype is None else x.to(dtype)
    out = op(used, weight, bias, *args)
    ctx.x_shape = x.shape
    if not weight.requires_grad:
        keep_packed(ctx, cache, None, weight)
        return out
    if used is not x and cache.strategy.packs_uncast():
        used = x
    keep_packed(ctx, cache, cache.pack(used, layout, x, dtype or used.dtype), weight)
    return out


def weight_and_input(ctx) -> tuple[torch.Tensor, Rebuilt | None]:
    """(weight, the packed input to rebuild or None) from what :func:`forward_and_pack` kept."""
    (weight,), packed = kept_packed(ctx)
    return weight, None if packed is None else Rebuilt(ctx.x_shape, ctx.cache, packed)


class Rebuilt:
    """A layer's packed input (of ``shape``), read back by its cache: whole, or images ``[i, j)``
    at a time (rebuilt alone where the strategy can, else sliced from one whole rebuild)."""

    __slots__ = ("shape", "cache", "packed", "_batch")

    def __init__(
        self, shape: Sequence[int], cache: InputCache | int, packed: Packed | list[torch.Tensor]
    ) -> None:
        self.shape, self.cache, self.packed = shape, cache, packed
        self._batch: torch.Tensor | None = None

    def read_whole(self) -> torch.Tensor:
        return self.cache.unpack(self.packed)

    def read_part(self, start: int, stop: int) -> torch.Tensor | None:
        """Flat elements ``[start, stop)`` rebuilt alone, or None where the pack cannot."""
        return self.cache.unpack_part(self.packed, start, stop)

    def whole(self) -> torch.Tensor:
        return self.read_whole() if self._batch is None else self._batch

    def images(self, i: int, j: int) -> torch.Tensor:
        if self._batch is None:
            per_image = math.prod(self.shape[1:])
            part = self.read_part(i * per_image, j * per_image)
            if part is not None:
                return part.view(j - i, *self.shape[1:])
            self._batch = self.read_whole()
        return self._batch[i:j]

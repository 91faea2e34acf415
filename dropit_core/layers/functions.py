"""Autograd functions: convolution and linear layers that keep a dropped input, and a ReLU that
keeps a 1-bit mask of its output.

The forward output is exactly the plain op's. The input gradient needs only the weight, and the
bias gradient only the output gradient, so both are exact; only the weight gradient is computed
from the rebuilt (dropped) input.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from dropit_core.backends import dispatch, native
from dropit_core.formats.bits import pack_blocked, zero_flagged_sliced
from dropit_core.formats.packed import (
    Packed,
    keep_pack,
    pack_made,
    refuse_double_backward,
    tag_pack,
)
from dropit_core.formats.seeds import mix_part, mix_state, seed_of
from dropit_core.layers.hooked import SavedInputHooks
from dropit_core.strategies.base import Strategy

# The caches by number: a torch.library operator takes plain values (dropit_core.layers.library),
# and names a cache by its number, for as long as the cache lives.
_CACHES: weakref.WeakValueDictionary[int, InputCache] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count(1)

# The attribute of a layer input that holds its pack: (forward, version, layout, dtype, pack).
# Forward numbers are unique across caches, so two caches never take each other's pack.
_SHARED = "_dropit_shared_pack"
_FORWARDS = itertools.count(1)


def _number(cache: InputCache) -> int:
    number = next(_NUMBERS)
    _CACHES[number] = cache
    return number


def cache_by_number(number: int) -> InputCache:
    """The live :class:`InputCache` numbered ``number`` (its ``number`` attribute)."""
    cache = _CACHES.get(number)
    if cache is None:
        raise RuntimeError(f"DropIT: the input cache #{number} of a compiled graph is gone")
    return cache


class InputCache:
    """Packs layer inputs with one strategy, sharing a pack between layers fed the same tensor.

    In a ResNet the block input feeds conv1 and the downsample conv, and FPN reads the same stage
    outputs; in the RPN head one tensor feeds two convs. Packing it once halves or thirds both the
    work and the bytes. The pack rides on the input tensor itself (an attribute, tagged with the
    cache and its forward, cheap to read: host time): it dies with the tensor, and a backward or
    a new step makes it stale.

    It also says where the packs are in their random streams: each pack that draws is keyed by
    (rank, ``stream``, step, its position among this step's packs). The forward order is
    deterministic, so the position names the layer and the call; :meth:`set_step` (called through
    ``dropit_core.set_step`` before each forward) makes a resumed run draw what the original drew.
    Without it the position keeps counting, so every pack still draws afresh.

    ``dropped`` sums, on the device, the values its packs chose but could not store (packs sized
    from the shape: :mod:`dropit_core.strategies.elementwise`); None until a pack reports some.
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
        self.number = _number(self)  # how the torch.library operators name it (library.py)
        self.saved_hooks = SavedInputHooks(self)  # its convs' path without a Function (hooked.py)
        self.keys = KeyTable(self)  # the step's draws as device data (draw_row)

    def set_step(self, step: int, rank: int = 0) -> None:
        """Start the random streams of training step ``step`` (on process ``rank``).

        Packs of earlier steps are forgotten: a tensor fed again (a fixed input) packs afresh.
        """
        self._block_size = max(KEY_BLOCK, self.position)
        self.step, self.rank, self.position = step, rank, 0
        self._prefix = mix_state(0, rank, self.stream, step)
        self._block = []
        self._forward = next(_FORWARDS)
        self.keys.new_step()

    def draw_row(self, device: torch.device) -> torch.Tensor:
        """The next pack's draw as device data: ``(k0, k1, 0)`` (the hash keys of
        :meth:`next_key`, the pack's first element), int64, from the step's key table on
        ``device``, which ``set_step`` rewrites in place: a pack replayed in a CUDA graph (no
        Python runs) draws each step's keys, eager's."""
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
        """Make the next positions' keys together on a tensor (not a hash in Python per pack:
        host time), and let the strategy derive its draws from them (``remember_draws``)."""
        count = min(max(self._block_size, 2 * len(self._block)), MAX_KEY_BLOCK)
        keys = self.key_at(torch.arange(self.position, self.position + count))
        self._block_first, self._block = self.position, keys.tolist()
        self.strategy.remember_draws(keys)

    def key_at(self, position: int | torch.Tensor) -> int | torch.Tensor:
        """mix_seed(rank, stream, step, position), the first three folded in set_step; of each
        position of an int64 tensor of them, as a tensor."""
        return seed_of(mix_part(self._prefix, position))

    def pack(
        self,
        x: torch.Tensor,
        layout: str,
        source: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> Packed:
        """Pack ``x`` as ``dtype`` values (default its own), or return the pack made earlier in
        this forward for the same tensor.

        Layers fed the same tensor share its pack, under autocast too: the key is ``source``, the
        tensor ``x`` was cast from, when given, else ``x``; ``dtype`` is the layer's compute
        dtype, so that ``x`` may be the uncast input (a strategy that reads through the cast
        packs it without a copy: :meth:`Strategy.pack`).
        """
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
        """Forget this forward's packs: a backward has begun, so the forward that shares them is
        over. A tensor fed again in a later step then packs afresh, with a new draw, even without
        ``set_step``. (A pack stays on its input until the input dies or is packed again: a
        tensor the caller keeps past the step keeps its last pack, a fraction of its own bytes.)"""
        self._forward = next(_FORWARDS)

    def reads_through_cast(self) -> bool:
        """Whether a pack of an autocast input is made from the uncast tensor (so the cast the
        layer ran need not outlive the layer's op)."""
        strategy = self.strategy
        return strategy.reads_through_cast and strategy.rescale == "none"

    def unpack(self, packed: Packed) -> torch.Tensor:
        """Rebuild the dense (dropped) input."""
        return self.strategy.unpack(packed)

    def unpack_part(self, packed: Packed, start: int, stop: int) -> torch.Tensor | None:
        """Elements ``[start, stop)`` of the flat rebuilt input, or None where the strategy
        cannot rebuild them alone (``Strategy.unpack_part``)."""
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
    """A cache's draws as device data: row p holds ``(k0, k1, 0)``, the strategy's hash keys of
    the step's key at position p. ``new_step`` rewrites the rows a forward has read in place, so
    a CUDA graph that recorded reads of this memory draws each step's keys on replay."""

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
        """Row ``position`` of the table on ``device`` (a view)."""
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


class ConvArgs(NamedTuple):
    """The arguments of ``aten.convolution`` besides input, weight and bias (lists or tuples:
    aten takes either; the compiled path's operators take lists)."""

    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    transposed: bool
    output_padding: Sequence[int]
    groups: int


def _zeros_like_shape(ref: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    # A zero-stride stand-in: the input gradient only reads the input's shape.
    return ref.new_zeros(()).expand(shape)


def _forward_and_save(ctx, x, weight, bias, cache: InputCache, dtype, args: ConvArgs | None):
    """The conv (``args`` given) or linear op of ``x`` (cast to ``dtype``, autocast's; None:
    as it is), keeping for backward the weight (input gradient) and, when the weight trains, the
    pack of the input the op computed with: its tensor fields through ``save_for_backward``
    (None included), its metadata on ``ctx``.

    Where the strategy packs ``x`` as the cast's values directly (quant), ``x`` is packed and
    the cast's last reference goes before the pack, so the cast lives as long as the op, as
    plain autocast's copy does. The pack is keyed by ``x``: the layers fed ``x`` share it.
    """
    used = x if dtype is None else x.to(dtype)
    if args is None:
        out = F.linear(used, weight, bias)
    else:
        out = torch.convolution(used, weight, bias, *args)
    ctx.cache, ctx.x_shape = cache, x.shape
    if not weight.requires_grad:
        ctx.meta = None
        ctx.save_for_backward(weight)
        return out
    if used is not x and cache.reads_through_cast():
        used = x
    packed = cache.pack(used, "linear" if args is None else "conv", x, dtype or used.dtype)
    tag_pack(packed)  # before compress_saved's hooks, if any, see its tensors
    ctx.meta = packed.meta
    ctx.save_for_backward(weight, *packed[1:])
    return out


def _saved_input(ctx) -> tuple[torch.Tensor, Rebuilt | None]:
    """(weight, the packed input to rebuild or None) from what :func:`_forward_and_save` kept,
    for a backward: one that would be differentiated again is refused, and the forward is
    over."""
    refuse_double_backward()
    ctx.cache.end_forward()
    weight, *tensors = ctx.saved_tensors
    if ctx.meta is None:
        return weight, None
    return weight, Rebuilt(ctx.x_shape, ctx.cache, Packed(ctx.meta, *tensors))


# Inputs of at least this many bytes have their conv's weight and input gradients made in turn
# (conv_grads): one rebuilt map fewer at the peak, for one more call, which small layers skip.
SPLIT_BYTES = 8 << 20
# Rows of a cache's key table on a device (InputCache.draw_row): the packs one forward draws,
# with room (quant converts 97 conv and linear layers of torchvision's R50-FPN Mask R-CNN; the
# RPN head's three run once per FPN level).
KEY_ROWS = 256
# Draw keys an input cache makes at a time (InputCache.next_key): at first, and at most.
KEY_BLOCK, MAX_KEY_BLOCK = 32, 4096
# A split weight gradient takes its images in chunks of at least one image and at most this many
# bytes of input, by device type: 64 MiB on an accelerator, so a layer's launches do not grow with
# the batch while a chunk's rebuilt map stays small beside the peak (docs/results/chunk_bytes/);
# 8 MiB on the CPU, where a call costs only its work, so the committed CPU runs keep their sums.
CHUNK_BYTES: dict[str, int] = {"cpu": 8 << 20, "accelerator": 64 << 20}


def images_per_chunk(batch: int, image_bytes: int, device: torch.device) -> int:
    """How many images of ``image_bytes`` each a backward's chunk takes on ``device``: as many
    as its CHUNK_BYTES holds, at least one, at most the batch."""
    budget = CHUNK_BYTES["cpu" if device.type == "cpu" else "accelerator"]
    return max(1, min(batch, budget // max(image_bytes, 1)))


class DropITConvFunction(torch.autograd.Function):
    """Convolution (plain or transposed) whose weight gradient uses a dropped input cache."""

    @staticmethod
    def forward(ctx, x, weight, bias, args: ConvArgs, cache: InputCache, dtype):
        ctx.args = args
        return _forward_and_save(ctx, x, weight, bias, cache, dtype, args)

    @staticmethod
    def backward(ctx, grad):
        weight, rebuilt = _saved_input(ctx)
        grads = conv_grads(grad, weight, ctx.x_shape, ctx.args, ctx.needs_input_grad, rebuilt)
        return grads + (None,) * 3


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def conv_grads(
    grad: torch.Tensor,
    weight: torch.Tensor,
    x_shape: Sequence[int],
    args: ConvArgs,
    needs: Sequence[bool],
    rebuilt: Rebuilt | None,
) -> Grads:
    """(input, weight, bias gradients) of a DropIT conv, the one body of the autograd Function's
    backward and the traced operator's. ``rebuilt`` reads the packed input (None: no pack, the
    weight does not train); ``needs`` the first three of ``ctx.needs_input_grad``.

    A large input (at least SPLIT_BYTES) has its gradients made in turn: the weight's (and
    bias's) first, over chunks of images (:func:`_weight_grad_by_images`), then the input
    gradient, bit for bit the joint call's: one map fewer alive at the backward's peak."""
    need_x, need_w, need_b = needs[:3]
    need_w = need_w and rebuilt is not None
    out_channels = weight.shape[1] * args.groups if args.transposed else weight.shape[0]
    grad = grad.contiguous()  # a no-op when it already is
    bias_sizes = [out_channels] if need_b else None
    if need_w and math.prod(x_shape) * grad.element_size() >= SPLIT_BYTES:
        gw, gb = _weight_grad_by_images(grad, rebuilt, x_shape, weight, bias_sizes, args)
        return (conv_input_grad(grad, weight, x_shape, args) if need_x else None), gw, gb
    if not need_w and not need_b:
        return (conv_input_grad(grad, weight, x_shape, args) if need_x else None), None, None
    x_hat = rebuilt.whole() if need_w else _zeros_like_shape(grad, x_shape)
    gx, gw, gb = torch.ops.aten.convolution_backward.default(
        grad, x_hat, weight, bias_sizes, *args, [need_x, need_w, need_b]
    )
    return gx, gw, gb


def conv_input_grad(
    grad: torch.Tensor, weight: torch.Tensor, x_shape: torch.Size, args: ConvArgs
) -> torch.Tensor:
    """A conv's input gradient without its input. On the CPU a 2-D conv's is the transposed
    conv of ``grad``: the backward's kernel would first make its input argument contiguous (a
    whole map of zeros for the zero-stride stand-in); the same values."""
    if grad.device.type == "cpu" and not args.transposed and grad.dim() == 4:
        k = weight.shape[2:]
        pad = [
            x_shape[2 + i]
            - ((grad.shape[2 + i] - 1) * args.stride[i] - 2 * args.padding[i]
               + args.dilation[i] * (k[i] - 1) + 1)
            for i in range(2)
        ]  # fmt: skip
        # the rows and columns the forward's stride skipped at the end (what torch allows)
        if all(0 <= p < max(s, d) for p, s, d in zip(pad, args.stride, args.dilation, strict=True)):
            return F.conv_transpose2d(
                grad, weight, None, args.stride, args.padding, pad, args.groups, args.dilation
            )
    return torch.ops.aten.convolution_backward.default(
        grad, _zeros_like_shape(grad, x_shape), weight, None, *args, [True, False, False]
    )[0]


class Rebuilt:
    """A layer's packed input (of ``shape``), read back for its backward by its cache: whole, or
    images ``[i, j)`` at a time, each chunk rebuilt alone where the strategy can, else sliced
    from one rebuild of the whole batch (made once). The same values either way. (Slots: one is
    made in every backward.)"""

    __slots__ = ("shape", "cache", "packed", "_batch")

    def __init__(
        self, shape: Sequence[int], cache: InputCache | int, packed: Packed | list[torch.Tensor]
    ) -> None:
        self.shape, self.cache, self.packed = shape, cache, packed
        self._batch: torch.Tensor | None = None

    def read_whole(self) -> torch.Tensor:
        """One rebuild of the whole input."""
        return self.cache.unpack(self.packed)

    def read_part(self, start: int, stop: int) -> torch.Tensor | None:
        """Flat elements ``[start, stop)`` rebuilt alone, or None where the pack cannot."""
        return self.cache.unpack_part(self.packed, start, stop)

    def whole(self) -> torch.Tensor:
        """The whole rebuilt input."""
        return self.read_whole() if self._batch is None else self._batch

    def images(self, i: int, j: int) -> torch.Tensor:
        """Images ``[i, j)`` of the rebuilt input."""
        if self._batch is None:
            per_image = math.prod(self.shape[1:])
            part = self.read_part(i * per_image, j * per_image)
            if part is not None:
                return part.view(j - i, *self.shape[1:])
            self._batch = self.read_whole()
        return self._batch[i:j]


def _weight_grad_by_images(
    grad: torch.Tensor,
    rebuilt: Rebuilt,
    x_shape: Sequence[int],
    weight: torch.Tensor,
    bias_sizes: list[int] | None,
    args: ConvArgs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) gradient of a conv as a sum over chunks of images (CHUNK_BYTES of
    input each, at least one image), images ``[i, j)`` read as ``rebuilt.images(i, j)``: the
    rebuilt input and the kernel's copies are a chunk's, not the batch's. The parts are summed
    in fp32 in image order: one call's value up to float rounding where there are several."""
    batch = x_shape[0]
    per_image = math.prod(x_shape[1:]) * grad.element_size()
    chunk = images_per_chunk(batch, per_image, grad.device)
    mask = [False, True, bias_sizes is not None]
    if chunk >= batch:
        _, gw, gb = torch.ops.aten.convolution_backward.default(
            grad, rebuilt.images(0, batch), weight, bias_sizes, *args, mask
        )
        return gw, gb
    gw = gb = None
    for i in range(0, batch, chunk):
        _, w_i, b_i = torch.ops.aten.convolution_backward.default(
            grad[i : i + chunk], rebuilt.images(i, min(i + chunk, batch)), weight, bias_sizes,
            *args,
            mask,
        )  # fmt: skip
        gw = w_i.float() if gw is None else gw.add_(w_i)
        if b_i is not None:
            gb = b_i.float() if gb is None else gb.add_(b_i)
    return gw.to(weight.dtype), (None if gb is None else gb.to(weight.dtype))


class DropITLinearFunction(torch.autograd.Function):
    """Linear layer over any leading dims whose weight gradient uses a dropped input cache."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache: InputCache, dtype):
        return _forward_and_save(ctx, x, weight, bias, cache, dtype, None)

    @staticmethod
    def backward(ctx, grad):
        weight, rebuilt = _saved_input(ctx)
        return linear_grads(grad, weight, ctx.x_shape, ctx.needs_input_grad, rebuilt) + (None,) * 2


def linear_grads(
    grad: torch.Tensor,
    weight: torch.Tensor,
    x_shape: Sequence[int],
    needs: Sequence[bool],
    rebuilt: Rebuilt | None,
) -> Grads:
    """(input, weight, bias gradients) of a DropIT linear layer over any leading dims: the one
    body of the autograd Function's backward and the traced operator's (as :func:`conv_grads`)."""
    need_x, need_w, need_b = needs[:3]
    g2 = grad.reshape(-1, grad.shape[-1])
    gx = gw = gb = None
    if need_w and rebuilt is not None:  # first: the rebuilt input goes before gx is made
        x_hat = rebuilt.whole()
        gw = g2.t() @ x_hat.reshape(-1, x_hat.shape[-1])
        del x_hat
    if need_x:
        gx = (g2 @ weight).view(x_shape)
    if need_b:
        gb = g2.sum(0)
    return gx, gw, gb


class MaskedReLUFunction(torch.autograd.Function):
    """ReLU that keeps one bit per element (output <= 0) for backward instead of the output.

    Storing "blocked" rather than "passes" lets NaN through exactly as the plain ReLU backward.
    """

    @staticmethod
    def forward(ctx, x, inplace: bool):
        out, bits = relu_and_mask(x, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(bits)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        (bits,) = ctx.saved_tensors
        return relu_mask_grad(grad, bits), None


def relu_and_mask(x: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(relu(x), the packed flags of ``relu(x) <= 0``): the masked ReLU's forward, eager and
    traced alike. The kernel takes a float tensor, contiguous when in place (it writes the
    output in x's memory order)."""
    way = dispatch.choose("relu_mask", x)
    if way == "triton" and (x.is_contiguous() or not inplace):
        return dispatch.kernels("relu").relu_mask(x, inplace, check=False)  # choose checked x
    out = x.relu_() if inplace else torch.relu(x)
    return out, native.relu_mask(out) if way == "native" else pack_blocked(out)


def relu_mask_grad(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The masked ReLU's input gradient: ``grad`` with the flagged elements zeroed."""
    way = dispatch.choose("relu_grad", grad)
    if way == "triton":
        return dispatch.kernels("relu").relu_mask_grad(grad, bits, check=False)
    return native.relu_apply(grad, bits) if way == "native" else zero_flagged_sliced(grad, bits)


class ParamCasts:
    """``p.to(dtype)``, one copy per forward for a layer called many times (the RPN head runs
    once per FPN level), as autocast's own weight cache does for the plain layer. Each cast is
    held weakly: the autograd graph keeps it through the forward and lets it go with the graph,
    so no copy of the weights outlives a step. (Weak dictionaries neither pickle nor copy: a
    copied cache starts with none.)"""

    def __init__(self) -> None:
        self._casts: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def get(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p`` as ``dtype``: the cast made earlier of this version of ``p``, or a new one."""
        if p.dtype == dtype:
            return p
        hit = self._casts.get(p)
        if hit is not None:
            cast = hit[1]()
            if cast is not None and hit[0] == p._version and cast.dtype == dtype:
                return cast
        cast = p.to(dtype)
        self._casts[p] = (p._version, weakref.ref(cast))
        return cast


def _any_autocast_fallback() -> bool:
    return True  # a torch without the one-call check: ask the device's flag every time


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast_fallback)


def autocast_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: InputCache | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype | None]:
    """(weight, bias, the input's dtype) as autocast would cast them for conv/linear (the dtype
    None without autocast): outputs identical to the plain layer's, narrow values in the cache.
    The weight casts are made here, outside the Function, so that autograd sees them, shared by
    the calls of one forward through ``cache`` (None while tracing: the compiler shares them).
    The input is cast inside the op (:func:`_forward_and_save`), so that the cast can go as soon
    as the op has run; autograd casts its gradient back to ``x``'s dtype, as autocast does."""
    # One C call answers the usual fp32 case; the device's own flag only under some autocast.
    if not _any_autocast():
        return weight, bias, None
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return weight, bias, None
    dtype = torch.get_autocast_dtype(device_type)
    if cache is None:
        return weight.to(dtype), None if bias is None else bias.to(dtype), dtype
    return (
        cache.casts.get(weight, dtype),
        cache.casts.get(bias, dtype) if bias is not None else None,
        dtype,
    )

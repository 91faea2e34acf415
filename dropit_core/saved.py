"""Compress every activation autograd saves, in any model, through saved-tensor hooks
(docs/dropit.md, "Every saved activation, in any model").

Inside a :class:`CompressSaved` block every floating-point tensor autograd saves, from
``min_bytes`` up, is kept as a ``quant`` pack plus one bit for "is zero" and one for "is
negative": the rebuilt tensor has the original's exact zeros and signs. Parameters and their
autocast copies, integer and small tensors stay as they are; a tensor saved twice is packed once.
:func:`compress_saved` attaches the block to every training forward of a model (forward hooks),
for a training loop that cannot be edited.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from dropit_core.formats.packed import (
    PACK_TAG,
    Packed,
    keep_pack,
    pack_made,
    refuse_double_backward,
)
from dropit_core.formats.seeds import mix_seed
from dropit_core.strategies.catalog import build_strategy
from dropit_core.strategies.quant import Quant, pack_signed, unpack_signed

# The attribute of a saved tensor that holds its pack: (block number, version, pack).
_SEEN = "_dropit_saved_pack"
_BLOCKS = itertools.count(1)


class _Saved(NamedTuple):
    """What stands for a compressed saved tensor until the backward asks for it."""

    packed: Packed
    zero: torch.Tensor  # 1 bit per element: the value is 0
    negative: torch.Tensor  # 1 bit per element: the value is < 0
    shape: torch.Size
    # The original's layout where it is not contiguous: the dims in memory order (a dense
    # permutation, as channels-last maps), else its strides (rebuilt by a copy); None: contiguous.
    layout: tuple[str, tuple[int, ...]] | None


class CompressSaved:
    """Context manager: the tensors autograd saves inside it are kept compressed. ``packs``,
    ``packed_bytes`` and ``dense_bytes`` count them; ``step`` and ``rank`` seed the draws."""

    def __init__(
        self,
        bits: int = 4,
        group: int = 256,
        min_bytes: int = 1 << 16,
        seed: int = 0,
        step: int = 0,
        rank: int = 0,
    ) -> None:
        quant = build_strategy("quant", 0.0, bits=bits, group=group, seed=seed)
        assert isinstance(quant, Quant)
        for name, value in (("min_bytes", min_bytes), ("step", step), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"compress_saved {name}={value!r}: allowed a whole number >= 0")
        self.quant: Quant = quant
        self.min_bytes, self.step, self.rank = min_bytes, step, rank
        self.packs = self.packed_bytes = self.dense_bytes = 0
        self._number = next(_BLOCKS)  # names this block's packs on the tensors they were made of
        self._hooks: Any = None
        # Called with (tensor, bytes kept) for each tensor first handed to the block, bytes None
        # where it stays dense: the hooks of an outer block (a memory count) never see these.
        self.observer: Callable[[torch.Tensor, int | None], None] | None = None

    def __enter__(self) -> CompressSaved:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def _keeps_dense(self, t: torch.Tensor) -> bool:
        """Tensors left as they are: small, not floating point, parameters, their casts and
        views of either (a linear layer saves ``weight.t()`` for its input gradient)."""
        if not t.is_floating_point() or t.numel() * t.element_size() < self.min_bytes:
            return True
        if getattr(t, PACK_TAG, False):  # a converted layer's cache: compressed already
            return True
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return True
        # an autocast copy of a parameter: a cast straight from a parameter
        fn = base.grad_fn
        return type(fn).__name__ == "ToCopyBackward0" and any(
            isinstance(getattr(nxt, "variable", None), nn.Parameter) for nxt, _ in fn.next_functions
        )

    def _pack(self, t: torch.Tensor) -> Any:
        if self._keeps_dense(t):
            if self.observer is not None:
                self.observer(t, None)
            return t
        seen = (self._number, t._version)
        hit = pack_made(t, _SEEN, seen)
        if hit is not None:
            return hit
        draw = mix_seed(self.rank, self.step, self.packs)
        flat, layout = _in_memory_order(t.detach())
        saved = _Saved(*pack_signed(self.quant, flat, draw), t.shape, layout)
        keep_pack(t, _SEEN, seen, saved)
        kept = saved.packed.nbytes() + saved.zero.nbytes + saved.negative.nbytes
        self.packs += 1
        self.packed_bytes += kept
        self.dense_bytes += t.numel() * t.element_size()
        if self.observer is not None:
            self.observer(t, kept)
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        refuse_double_backward()
        rebuilt = unpack_signed(self.quant, saved.packed, saved.zero, saved.negative)
        return _in_layout(rebuilt, saved.shape, saved.layout)


def _in_memory_order(t: torch.Tensor) -> tuple[torch.Tensor, tuple[str, tuple[int, ...]] | None]:
    """(t's values flat, and the layout :func:`_in_layout` restores: a compiled graph checks the
    strides it saved). A dense permutation (channels-last) is read in memory order, no copy."""
    if t.is_contiguous():
        return t.reshape(-1), None
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    dense = t.permute(order)
    if dense.is_contiguous():
        return dense.reshape(-1), ("order", order)
    return t.reshape(-1), ("strides", t.stride())


def _in_layout(
    flat: torch.Tensor, shape: torch.Size, layout: tuple[str, tuple[int, ...]] | None
) -> torch.Tensor:
    """The rebuilt values ``flat`` as a tensor of ``shape`` in the original's layout."""
    if layout is None:
        return flat.view(shape)
    kind, dims = layout
    if kind == "order":
        inverse = sorted(range(len(dims)), key=dims.__getitem__)
        return flat.view([shape[d] for d in dims]).permute(inverse)
    out = torch.empty_strided(shape, dims, dtype=flat.dtype, device=flat.device)
    return out.copy_(flat.view(shape))


ATTRIBUTE = "dropit_saved"  # where compress_saved keeps its handle on the model (set_step reads it)


def saved_compression(module: nn.Module) -> SavedCompression | None:
    """The handle of :func:`compress_saved` attached to ``module`` itself, or None."""
    return module.__dict__.get(ATTRIBUTE)


class SavedCompression:
    """The handle :func:`compress_saved` returns: the block's ``options``, the ``step`` its next
    training forward draws with, the last forward's block (``last``) and :meth:`remove`."""

    def __init__(self, model: nn.Module, bits: int, group: int, min_bytes: int, seed: int) -> None:
        CompressSaved(bits, group, min_bytes, seed)  # checks the options once, here
        self.options = {"bits": bits, "group": group, "min_bytes": min_bytes, "seed": seed}
        self.step, self.rank = 0, 0
        self.last: CompressSaved | None = None
        self.observer: Callable[[torch.Tensor, int | None], None] | None = None  # see CompressSaved
        self._active: CompressSaved | None = None
        self._model = model
        self._hooks = (
            model.register_forward_pre_hook(self._enter),
            # always_call: a forward that raises still leaves the block, or every later saved
            # tensor of the process would be packed
            model.register_forward_hook(self._leave, always_call=True),
        )

    def set_step(self, step: int, rank: int = 0) -> None:
        """Seed the next training forward's draws (``set_step(model, ...)`` calls this)."""
        self.step, self.rank = step, rank

    def remove(self) -> None:
        """Detach from the model: its later forwards keep what they save as it is."""
        for hook in self._hooks:
            hook.remove()
        self._model.__dict__.pop(ATTRIBUTE, None)

    @torch.compiler.disable
    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._active is not None or not (module.training and torch.is_grad_enabled()):
            return  # a nested call runs inside the block already; eval saves nothing
        self._active = CompressSaved(**self.options, step=self.step, rank=self.rank)
        self._active.observer = self.observer
        self._active.__enter__()

    @torch.compiler.disable
    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        block, self._active = self._active, None
        if block is None:
            return
        block.__exit__(None, None, None)
        self.last = block
        self.step += 1  # without set_step, each forward still draws afresh


def compress_saved(
    model: nn.Module, bits: int = 4, group: int = 256, min_bytes: int = 1 << 16, seed: int = 0
) -> SavedCompression:
    """Run every training forward of ``model`` (before or after its DDP wrap) inside a
    :class:`CompressSaved` block; returns the handle (also ``model.dropit_saved``).
    ``set_step(model, step, rank)`` seeds the draws, else the step counts training forwards."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compress_saved takes an nn.Module, got {type(model).__name__}")
    if (attached := saved_compression(model)) is not None:
        raise ValueError(
            f"compress_saved: this {type(model).__name__} is compressed already "
            f"(options {attached.options}); call .remove() on that handle first"
        )
    handle = SavedCompression(model, bits, group, min_bytes, seed)
    model.__dict__[ATTRIBUTE] = handle
    return handle

"""What every strategy shares: the options every strategy takes and the :class:`Strategy` base,
which owns how kept values are stored (a :class:`~dropit_core.formats.values.ValueCodec`) and the
``rescale`` of the rebuilt input.
"""

from __future__ import annotations

from typing import Any

import torch

from dropit_core.formats.packed import Packed, tiny
from dropit_core.formats.values import VALUE_FORMATS, ValueCodec
from dropit_core.registry import Option


def encoded(
    codec: ValueCodec, values: torch.Tensor, keep_sign: bool = False
) -> dict[str, torch.Tensor | None]:
    """The ``values``/``scales`` fields of a pack whose kept ``values`` ``codec`` encodes."""
    parts = codec.encode(values, keep_sign)
    return {"values": parts[0], "scales": parts[1] if len(parts) > 1 else None}


def decoded(codec: ValueCodec, packed: Packed, dtype: torch.dtype, count: int) -> torch.Tensor:
    """The kept values of ``packed`` (``count`` of them) decoded to ``dtype``."""
    parts = (packed.values,) if packed.scales is None else (packed.values, packed.scales)
    return codec.decode(parts, dtype, count)


# How a rebuilt input is scaled before the weight gradient: as it is, or to the input's L2 norm.
RESCALES = ("none", "norm")
# Options every strategy takes (unless it names them in ``skips_common``): how the kept values
# are stored (see ValueCodec), and the rescale.
COMMON_OPTIONS = (
    Option("values", str, "same", "how kept values are stored", choices=VALUE_FORMATS),
    Option("int8_chunk", int, ValueCodec.int8_chunk, "values per fp32 scale of `int8`", minimum=1),
    Option("int4_chunk", int, ValueCodec.int4_chunk, "values per fp32 scale of `int4`", minimum=1),
    Option(
        "rescale",
        str,
        "none",
        "`norm`: scale each rebuilt input by the L2 norm ratio of the input to the rebuilt one, "
        "so the weight gradient keeps the exact gradient's scale",
        choices=RESCALES,
    ),
)
# The common options that build the codec, and the ValueCodec field each sets.
CODEC_OPTIONS = {"values": "fmt", "int8_chunk": "int8_chunk", "int4_chunk": "int4_chunk"}
SEED = Option(
    "seed", int, 0, "seed of the random draws, mixed with the step and the layer (`set_step`)"
)


def keep_count(gamma: float, n: int) -> int:
    """How many of n elements (or units) a drop of ``gamma`` keeps."""
    return int((1.0 - gamma) * n)


class Strategy:
    """Base class: pick what to keep of a layer input and rebuild a dense tensor from it. A subclass
    declares its ``name``, ``options`` (each value an attribute of its name), ``keeps`` and
    ``cache_bytes`` (the docs' table), and implements :meth:`_pack` and :meth:`_unpack`."""

    name = ""
    options: tuple[Option, ...] = ()
    keeps = ""
    cache_bytes = ""
    draws = False  # a pack draws random numbers (from its key)
    uses_gamma = True  # whether gamma means anything to it
    every_element = False  # nothing dropped: may pack a norm's input, whose backward reads all
    skips_common: tuple[str, ...] = ()  # common options that do not apply to it
    reads_through_cast = False  # implements _pack_cast
    described: tuple[str, ...] = ()  # the attributes (options) describe() shows

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str = RESCALES[0], **options: Any
    ) -> None:
        self.gamma = gamma
        self.codec = codec
        self.rescale = rescale
        for name, value in options.items():
            setattr(self, name, value)

    def pack(
        self, x: torch.Tensor, layout: str, key: int = 0, dtype: torch.dtype | None = None
    ) -> Packed:
        """Compress ``x`` (a ``"conv"`` or ``"linear"`` input), drawn with ``key``; ``dtype``: the
        layer's (autocast's), the pack of ``x.to(dtype)``."""
        cast = dtype is not None and dtype != x.dtype
        if cast and self.packs_uncast():
            packed = self._pack_cast(x, layout, key, dtype)
        else:  # the norm below is the cast's
            x = x.to(dtype) if cast else x
            packed = self._pack(x, layout, key)
        if self.rescale == "norm":  # one more pass over x; the norm rides with the pack
            packed = packed._replace(norm=torch.linalg.vector_norm(x, dtype=torch.float32))
        return packed

    def packs_uncast(self) -> bool:
        """Whether a pack of ``x.to(dtype)`` is read from ``x`` itself (:meth:`_pack_cast`)."""
        return self.reads_through_cast and self.rescale == RESCALES[0]

    def unpack(self, packed: Packed) -> torch.Tensor:
        """Rebuild a dense tensor of the packed input's shape and dtype; with ``rescale="norm"``
        scaled to the input's L2 norm."""
        x_hat = self._unpack(packed)
        if packed.norm is None:
            return x_hat
        rebuilt = torch.linalg.vector_norm(x_hat, dtype=torch.float32)
        # An all-zero rebuild stays zero (no division by zero); no host sync either way.
        scale = torch.where(rebuilt > 0, packed.norm / rebuilt.clamp_min(tiny(torch.float32)), 1.0)
        # Out of place: some strategies rebuild as a view of a cached tensor, which layers share.
        return x_hat * scale.to(x_hat.dtype)

    def unpack_part(self, packed: Packed, start: int, stop: int) -> torch.Tensor | None:
        """``unpack(packed).reshape(-1)[start:stop]`` without rebuilding the rest; None where the
        pack cannot be read in parts there (the default: nowhere)."""
        return None

    def remember_draws(self, keys: torch.Tensor) -> None:
        """Told the keys of the next packs that draw (an int64 CPU tensor), made together."""

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        raise NotImplementedError

    def _pack_cast(self, x: torch.Tensor, layout: str, key: int, dtype: torch.dtype) -> Packed:
        """The pack of ``x.to(dtype)``, bit for bit, read from ``x`` (``reads_through_cast``)."""
        raise NotImplementedError

    def _unpack(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        """Short human-readable form, e.g. ``mink(gamma=0.8)``."""
        params = [f"gamma={self.gamma}"] if self.uses_gamma else []
        params += self._describe_params()
        if self.rescale != RESCALES[0]:
            params.append(f"rescale={self.rescale}")
        return f"{self.name}({', '.join(params)})"

    def _describe_params(self) -> tuple[str, ...]:
        """The strategy's own settings worth showing in :meth:`describe`."""
        return tuple(f"{name}={getattr(self, name)}" for name in self.described)

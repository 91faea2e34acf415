"""How an element-wise pack stores its kept values (``values`` option): as they are, fp16/bf16, or
``int8``/``int4`` with one fp32 scale per chunk of kept values, round to nearest, symmetric (not
quant's 4-bit format: kept values are the large ones, so a chunk's range is narrow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_FORMATS = ("same", "fp16", "bf16", "int8", "int4")
_FLOAT_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_INT_LEVELS = {"int8": 127, "int4": 7}


def _in_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """Flat ``t`` zero-padded to whole chunks, a chunk per row."""
    return torch.nn.functional.pad(t, (0, (-t.numel()) % chunk)).view(-1, chunk)


@dataclass(frozen=True)
class ValueCodec:
    """How kept values are stored: as they are, as fp16/bf16, or int8/int4 with per-chunk scales."""

    fmt: str = "same"
    int8_chunk: int = 1024
    int4_chunk: int = 64

    @property
    def chunk(self) -> int:
        """Values per scale of the integer formats."""
        return self.int4_chunk if self.fmt == "int4" else self.int8_chunk

    def encode(self, values: torch.Tensor, keep_sign: bool = False) -> tuple[torch.Tensor, ...]:
        """Encode a flat tensor of kept values into one or two tensors. ``keep_sign``: an
        integer format codes a non-zero value that rounds to 0 as one step of its sign instead
        (for a rebuild that reads every kept value's sign)."""
        if self.fmt == "same":
            return (values,)
        if self.fmt in _FLOAT_FORMATS:
            return (values.to(_FLOAT_FORMATS[self.fmt]),)
        m, levels = values.numel(), _INT_LEVELS[self.fmt]
        v = _in_chunks(values.float(), self.chunk)
        scale = v.abs().amax(dim=1).clamp_min_(torch.finfo(torch.float32).tiny) / levels
        q = torch.round(v / scale[:, None])
        if keep_sign:
            q = torch.where((q == 0) & (v != 0), torch.sign(v), q)
        q = q.to(torch.int8).view(-1)
        if self.fmt == "int4":
            # Two codes per byte, offset to 1..15 (0 never occurs: a padded code rebuilds as 0).
            q = (q[:m] + 8).to(torch.uint8)
            q = torch.nn.functional.pad(q, (0, m % 2))
            return (q[0::2] | (q[1::2] << 4), scale)
        # Slicing off the padding would still keep it alive in the storage: copy instead.
        return (q[:m].clone() if q.numel() > m else q, scale)

    def decode(
        self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype, count: int | None = None
    ) -> torch.Tensor:
        """Decode what :meth:`encode` returned back to a flat tensor of ``dtype``. ``count``, the
        number of encoded values, is needed for int4 (two per byte: an odd count leaves a padding
        code)."""
        if self.fmt not in _INT_LEVELS:
            return parts[0].to(dtype)
        q, scale = parts
        if self.fmt == "int4":
            if count is None:
                raise ValueError("decoding int4 values needs their count")
            q = (torch.stack([q & 0xF, q >> 4], dim=1).view(-1)[:count]).to(torch.int8) - 8
        v = _in_chunks(q, self.chunk).to(torch.float32)
        return (v * scale[:, None]).view(-1)[: q.numel()].to(dtype)

    def nbytes(self, kept: int, elem_size: int) -> int:
        """Bytes that ``kept`` encoded values take (input element size ``elem_size``)."""
        if self.fmt == "same":
            return kept * elem_size
        if self.fmt in _FLOAT_FORMATS:
            return kept * 2
        codes = kept if self.fmt == "int8" else (kept + 1) // 2
        return codes + 4 * (-(-kept // self.chunk))

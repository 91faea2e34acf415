"""What a DropIT conv or linear layer hands its op: its weight and bias where its call trains
(:class:`WeightLayer`), cast as autocast casts them (:func:`autocast_inputs`, :class:`ParamCasts`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary


class WeightLayer:
    """The forward of a DropIT conv or linear layer, a base before its plain class: the plain op
    unless the call keeps something for a backward, else ``dropit_forward(x, weight, bias, *args)``
    (the parameters from ``_parameters``, not ``nn.Module.__getattr__``: host time)."""

    dropit_cache: Any  # its InputCache

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = self._parameters
        weight = params.get("weight")
        weight = self.weight if weight is None else weight
        if not (
            self.training
            and torch.is_grad_enabled()
            and (weight.requires_grad or x.requires_grad)
            and x.numel() > 0
        ):
            return super().forward(x, *args, **kwargs)
        bias = params["bias"] if "bias" in params else self.bias
        return self.dropit_forward(x, weight, bias, *args, **kwargs)


class ParamCasts:
    """``p.to(dtype)``, one copy per forward for a layer called many times, as autocast's own
    weight cache; held weakly, so no copy of the weights outlives the step's graph."""

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


# One C call for every device's autocast (torch >= 2.4 has it), held: a lookup per layer
_any_autocast = torch._C._is_any_autocast_enabled


def autocast_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: Any
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype | None]:
    """(weight, bias, the input's dtype) as autocast would cast them for conv/linear (the dtype
    None without autocast). The weights are cast here, outside the Function, so that autograd
    sees the casts, shared through ``cache`` (None while tracing); the input inside the op, so
    that its cast can go as soon as the op has run."""
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

"""The DropIT linear layer: its module, its autograd Function and its traced operator
``dropit::linear``, whose backward is the Function's body, :func:`linear_grads` (as :mod:`.conv`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dropit_core.layers import library
from dropit_core.layers.cache import (
    Grads,
    InputCache,
    Rebuilt,
    forward_and_pack,
    weight_and_input,
)
from dropit_core.layers.casts import WeightLayer


class DropITLinearFunction(torch.autograd.Function):
    """Linear layer over any leading dims whose weight gradient uses a dropped input cache."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache: InputCache, dtype):
        return forward_and_pack(ctx, F.linear, "linear", x, weight, bias, cache, dtype)

    @staticmethod
    def backward(ctx, grad):
        weight, rebuilt = weight_and_input(ctx)
        return linear_grads(grad, weight, ctx.x_shape, ctx.needs_input_grad, rebuilt) + (None,) * 2


def linear_grads(
    grad: Tensor,
    weight: Tensor,
    x_shape: Sequence[int],
    needs: Sequence[bool],
    rebuilt: Rebuilt | None,
) -> Grads:
    """(input, weight, bias gradients) of a DropIT linear layer over any leading dims."""
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


def _linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, fields: list[Tensor], cache: int
) -> Tensor:
    """``F.linear`` (its own fake too); the backward's weight gradient reads the pack ``fields``."""
    return F.linear(x, weight, bias)


library.layer_op(
    "linear",
    _linear,
    lambda grad, weight, ctx, rebuilt: linear_grads(
        grad, weight, ctx.x_shape, ctx.needs_input_grad, rebuilt
    ),
)


def _traced(x, weight, bias, fields, cache: int) -> Tensor:
    return torch.ops.dropit.linear(x, weight, bias, fields, cache)


class DropITLinear(WeightLayer, nn.Linear):
    """``nn.Linear`` whose weight gradient is computed from a dropped input cache."""

    def dropit_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        cache = self.dropit_cache
        return library.run(DropITLinearFunction, _traced, "linear", x, weight, bias, cache)

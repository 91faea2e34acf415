"""The DropIT convolution, transposed convolution, linear and ReLU modules: what a converted layer
runs.

Each is a subclass of the plain module with only ``forward`` changed, so parameters, buffers,
hooks and ``state_dict()`` are the plain module's. A training step runs the eager path (aten's
node with a saved-tensor hook, or the autograd Function: :mod:`dropit_core.layers.functions`);
while compiling, the ``torch.library`` operators (:mod:`dropit_core.layers.library`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dropit_core.layers import functions as ops
from dropit_core.layers import hooked
from dropit_core.layers import library as traced
from dropit_core.layers.cache import InputCache
from dropit_core.layers.casts import autocast_inputs
from dropit_core.layers.functions import ConvArgs, DropITConvFunction, DropITLinearFunction
from dropit_core.layers.relu import MaskedReLUFunction


def _training_step(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> bool:
    # In eval, under no_grad, or for a frozen layer fed a constant, run the plain op: zero
    # selection work.
    return (
        module.training
        and torch.is_grad_enabled()
        and (weight.requires_grad or x.requires_grad)
        and x.numel() > 0  # an empty batch (a head without RoIs) keeps nothing either way
    )


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(module.weight, module.bias)``, from its parameters where they are: ``module.weight``
    runs ``nn.Module.__getattr__`` (0.7 µs, every layer and step); a parametrized one is not."""
    params = module._parameters
    weight = params.get("weight")
    weight = module.weight if weight is None else weight
    return weight, params["bias"] if "bias" in params else module.bias


class DropITConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        if not _training_step(self, x, weight):
            return super().forward(x)
        if x.dim() == 3:  # an unbatched (C, H, W) input, as nn.Conv2d takes
            return self.forward(x.unsqueeze(0)).squeeze(0)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            x, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation), (0, 0)
        cache = self.dropit_cache
        if torch.compiler.is_compiling():
            args = ConvArgs(
                list(self.stride), list(padding), list(self.dilation), False, [0, 0], self.groups
            )
            return _compiling(x, weight, bias, cache, args)
        # The module's tuples as they are: aten takes them so (a list of each per call was
        # host time, on every layer of every step).
        args = ConvArgs(self.stride, padding, self.dilation, False, (0, 0), self.groups)
        return _eager_conv(x, weight, bias, args, cache)


def _eager_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    cache: InputCache,
) -> torch.Tensor:
    """The DropIT convolution (plain or transposed) eagerly: aten's own autograd node with its
    input packed through a saved-tensor hook where that does what the Function does (less host
    time: dropit_core.layers.hooked), else the autograd Function."""
    w, b, dtype = autocast_inputs(x, weight, bias, cache)
    # ops.SPLIT_BYTES read here, not copied at import: one threshold for both sides of the split
    if hooked.takes(x, w, dtype, ops.SPLIT_BYTES):
        return hooked.conv(x, w, b, args, cache.saved_hooks, dtype)
    return DropITConvFunction.apply(x, w, b, args, cache, dtype)


def _compiling(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cache: InputCache,
    args: ConvArgs | None,
) -> torch.Tensor:
    """The DropIT convolution (``args`` given) or linear layer while compiling: the traced
    operators (strategies whose pack sizes depend on the data: the autograd Function, behind a
    graph break)."""
    if not traced.traceable(cache):
        return _behind_break(x, weight, bias, cache, args)
    w, b, dtype = autocast_inputs(x, weight, bias, None)
    if args is None:
        return traced.linear(x, w, b, cache, dtype)
    return traced.conv(x, w, b, args, cache, dtype)


# A graph break, stated in dropit_core.layers.library (a decorated copy: the eager path pays no
# wrapper).
@torch.compiler.disable
def _behind_break(x, weight, bias, cache: InputCache, args: ConvArgs | None) -> torch.Tensor:
    w, b, dtype = autocast_inputs(x, weight, bias, cache)
    if args is None:
        return DropITLinearFunction.apply(x, w, b, cache, dtype)
    return DropITConvFunction.apply(x, w, b, args, cache, dtype)


def _explicit_padding(x, padding: str, kernel_size, dilation) -> torch.Tensor:
    """``x`` padded as a ``"same"`` or ``"valid"`` conv pads it."""
    if padding == "valid":
        return x
    pads = []
    for k, d in zip(reversed(kernel_size), reversed(dilation), strict=True):
        total = d * (k - 1)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


class DropITConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        if not _training_step(self, x, weight):
            return super().forward(x, output_size)
        if x.dim() == 3:  # an unbatched (C, H, W) input, as nn.ConvTranspose2d takes
            return self.forward(x.unsqueeze(0), output_size).squeeze(0)
        stride, padding, dilation = list(self.stride), list(self.padding), list(self.dilation)
        kernel = list(self.kernel_size)
        output_padding = self._output_padding(x, output_size, stride, padding, kernel, 2, dilation)
        args = ConvArgs(stride, padding, dilation, True, list(output_padding), self.groups)
        if torch.compiler.is_compiling():
            return _compiling(x, weight, bias, self.dropit_cache, args)
        return _eager_conv(x, weight, bias, args, self.dropit_cache)


class DropITLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _weight_and_bias(self)
        if not _training_step(self, x, weight):
            return super().forward(x)
        if torch.compiler.is_compiling():
            return _compiling(x, weight, bias, self.dropit_cache, None)
        w, b, dtype = autocast_inputs(x, weight, bias, self.dropit_cache)
        return DropITLinearFunction.apply(x, w, b, self.dropit_cache, dtype)


class DropITReLU(nn.ReLU):
    """``nn.ReLU`` that keeps a 1-bit mask of its output for backward, not the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        if torch.compiler.is_compiling():
            return traced.relu(x, self.inplace)
        return MaskedReLUFunction.apply(x, self.inplace)

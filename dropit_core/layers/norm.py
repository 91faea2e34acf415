"""Normalisation layers that keep a packed copy of their input for backward.

A trainable ``BatchNorm2d``, ``SyncBatchNorm`` or ``GroupNorm`` keeps its whole input for its
backward: in a model trained from scratch that is as much as every conv input together. The
DropIT subclasses here compute the forward with the same aten op as the plain layer (the output,
the batch statistics and the running-statistics update are the plain layer's, bit for bit) and
keep the input as a pack of the layer's strategy, which must keep every element (``quant``:
stochastic rounding, unbiased). Backward rebuilds the input and runs the plain layer's backward
on it, with the exact batch statistics of the forward:

- the weight and bias gradients are linear in the input: unbiased (the bias gradient is exact);
- the input gradient is not linear in it (it reads the input twice, through the projection onto
  the normalised input): close, but neither exact nor unbiased. ``docs/dropit.md`` states the
  error measured on a test model.

``SyncBatchNorm`` across several processes runs torch's own synchronised function, with its saved
input packed through a saved-tensor hook scoped to that one call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dropit_core.formats.packed import Packed, refuse_double_backward, tag_pack
from dropit_core.layers import library as traced
from dropit_core.layers.functions import Grads, InputCache


def _training_step(module: nn.Module, x: torch.Tensor) -> bool:
    # Batch statistics with a graph to keep: otherwise the plain layer, untouched (an empty
    # batch, e.g. a mask head without positive RoIs, keeps nothing either way).
    return module.training and torch.is_grad_enabled() and x.requires_grad and x.numel() > 0


def _save_pack(ctx, cache: InputCache, x: torch.Tensor, *rest: torch.Tensor | None) -> None:
    packed = cache.pack(x, "conv")
    tag_pack(packed)  # before compress_saved's hooks, if any, see its tensors
    ctx.meta, ctx.cache, ctx.rest = packed.meta, cache, len(rest)
    ctx.save_for_backward(*rest, *packed[1:])


def _saved(ctx) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the tensors saved besides the pack, the rebuilt input)."""
    refuse_double_backward()
    ctx.cache.end_forward()
    saved = ctx.saved_tensors
    rest, tensors = list(saved[: ctx.rest]), saved[ctx.rest :]
    return rest, ctx.cache.unpack(Packed(ctx.meta, *tensors))


class _BatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm (aten's, as ``F.batch_norm`` dispatches it) with a packed input."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, cache):
        ctx.eps, ctx.update, ctx.channels = eps, running_mean is not None, x.shape[1]
        if ctx.update:  # the op F.batch_norm dispatches to (cuDNN's on CUDA), stats updated
            out, mean, invstd, reserve = torch.ops.aten._batch_norm_with_update.default(
                x, weight, bias, running_mean, running_var, momentum, eps
            )
        else:  # no running statistics (track_running_stats=False)
            out, mean, invstd = torch.ops.aten.native_batch_norm.default(
                x, weight, bias, None, None, True, momentum, eps
            )
            reserve = None
        _save_pack(ctx, cache, x, weight, mean, invstd, reserve)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight, mean, invstd, reserve), x_hat = _saved(ctx)
        stats = (mean, invstd, reserve if ctx.update else None)
        grads = batch_norm_grads(grad, x_hat, weight, stats, ctx.eps, ctx.needs_input_grad)
        return *grads, None, None, None, None, None


def batch_norm_grads(
    grad: torch.Tensor,
    x_hat: torch.Tensor,
    weight: torch.Tensor | None,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    eps: float,
    needs: Sequence[bool],
) -> Grads:
    """(input, weight, bias gradients) of training-mode batch norm from its rebuilt input: the
    one body of the autograd Function's backward and the traced operator's. ``stats``: (mean,
    invstd, the reserve of the op that updated running statistics, or None without them)."""
    mean, invstd, reserve = stats
    need = list(needs[:3])
    grad = grad.contiguous()
    if reserve is None:
        return torch.ops.aten.native_batch_norm_backward.default(
            grad, x_hat, weight, None, None, mean, invstd, True, eps, need
        )
    if weight is None:  # the op wants a weight even without affine parameters
        weight = torch.ones(x_hat.shape[1], device=grad.device, dtype=torch.float32)
        need[1] = need[2] = False
    return torch.ops.aten.batch_norm_backward.default(
        grad, x_hat, weight, None, None, mean, invstd, True, eps, need, reserve
    )


class _GroupNormFunction(torch.autograd.Function):
    """Group norm (aten's native op) with a packed input."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, cache):
        n, c = x.shape[:2]
        hw = x[0, 0].numel() if n and c else 0
        out, mean, rstd = torch.ops.aten.native_group_norm.default(
            x, weight, bias, n, c, hw, groups, eps
        )
        ctx.dims = (n, c, hw, groups)
        _save_pack(ctx, cache, x, weight, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight, mean, rstd), x_hat = _saved(ctx)
        grads = group_norm_grads(grad, x_hat, weight, mean, rstd, ctx.dims, ctx.needs_input_grad)
        return *grads, None, None, None


def group_norm_grads(
    grad: torch.Tensor,
    x_hat: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dims: tuple[int, int, int, int],
    needs: Sequence[bool],
) -> Grads:
    """(input, weight, bias gradients) of group norm from its rebuilt input (``dims``: N, C,
    HxW, groups): the one body of the autograd Function's backward and the traced operator's."""
    need = list(needs[:3])
    if weight is None:
        need[1] = need[2] = False
    return torch.ops.aten.native_group_norm_backward.default(
        grad.contiguous(), x_hat, mean, rstd, weight, *dims, need
    )


def _momentum(module: nn.modules.batchnorm._BatchNorm) -> float:
    """The running-statistics factor of this step, counting it (``_BatchNorm.forward``'s rule)."""
    factor = 0.0 if module.momentum is None else module.momentum
    if module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:  # a cumulative average; reads the count on the host
            factor = 1.0 / float(module.num_batches_tracked)
    return factor


def _batch_norm(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    factor = _momentum(module)
    track = module.track_running_stats
    # while compiling, the traced operator; eagerly, the autograd Function (the same arguments)
    compiling = torch.compiler.is_compiling() and traced.traceable(module.dropit_cache)
    run = batch_norm if compiling else _BatchNormFunction.apply
    return run(
        x,
        module.weight,
        module.bias,
        module.running_mean if track else None,
        module.running_var if track else None,
        factor,
        module.eps,
        module.dropit_cache,
    )


class DropITBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that keeps a packed copy of its input for backward."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        self._check_input_dim(x)
        F._verify_batch_size(x.size())  # one value per channel: no variance, as the plain layer
        return _batch_norm(self, x)


class DropITSyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` that keeps a packed copy of its input for backward."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        if not _synchronised(self):
            self._check_input_dim(x)
            F._verify_batch_size(x.size())
            return _batch_norm(self, x)
        # Across processes: torch's own function (its backward all-reduces), its input packed.
        with _pack_saved(self.dropit_cache, x):
            return super().forward(x)


def _synchronised(module: nn.SyncBatchNorm) -> bool:
    """Whether ``nn.SyncBatchNorm.forward`` would reduce across processes (world size > 1)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(module.process_group or dist.group.WORLD) > 1


class _pack_saved(torch.autograd.graph.saved_tensors_hooks):
    """Pack the one saved tensor shaped like ``x`` (the norm's input); leave the rest as it is."""

    def __init__(self, cache: InputCache, x: torch.Tensor) -> None:
        def pack(t: torch.Tensor):
            if t.shape != x.shape or not t.is_floating_point():
                return t
            return cache.pack(t, "conv")

        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            refuse_double_backward()
            return cache.unpack(saved)

        super().__init__(pack, unpack)


class DropITGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` that keeps a packed copy of its input for backward."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            # CUDA autocast runs group_norm in fp32 (the plain layer's output dtype): cast outside
            # the Function, as autocast would, so that autograd sees the cast.
            x = x.float()
        if torch.compiler.is_compiling() and traced.traceable(self.dropit_cache):
            return group_norm(
                x, self.weight, self.bias, self.num_groups, self.eps, self.dropit_cache
            )
        return _GroupNormFunction.apply(
            x, self.weight, self.bias, self.num_groups, self.eps, self.dropit_cache
        )


# Normalisation layers (norm=True) ---------------------------------------------------------------


@torch.library.custom_op("dropit::batch_norm", mutates_args=())
def batch_norm_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    fields: list[Tensor],
    momentum: float,
    eps: float,
    cache: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training-mode batch norm as ``norm._BatchNormFunction`` runs it: (output, mean, invstd,
    reserve, the updated running mean and variance). Functional: the statistics are updated in
    copies, which the caller writes back (an operator with an autograd formula mutates nothing).
    """
    if running_mean is None:
        out, mean, invstd = torch.ops.aten.native_batch_norm.default(
            x, weight, bias, None, None, True, momentum, eps
        )
        empty = x.new_empty(0)
        return out, mean, invstd, empty, empty.clone(), empty.clone()
    new_mean, new_var = running_mean.clone(), running_var.clone()
    out, mean, invstd, reserve = torch.ops.aten._batch_norm_with_update.default(
        x, weight, bias, new_mean, new_var, momentum, eps
    )
    return out, mean, invstd, reserve, new_mean, new_var


@batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, fields, momentum, eps, cache):
    channels = x.shape[1]
    stats = x.new_empty(channels, dtype=torch.float32)
    if running_mean is None:
        empty = x.new_empty(0)
        return torch.empty_like(x), stats, stats.clone(), empty, empty.clone(), empty.clone()
    return (
        torch.empty_like(x),
        stats,
        stats.clone(),
        x.new_empty(0, dtype=torch.uint8),
        torch.empty_like(running_mean),
        torch.empty_like(running_var),
    )


def _batch_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, running_mean, _, fields, _, eps, cache = inputs
    ctx.eps, ctx.cache, ctx.update = eps, cache, running_mean is not None
    ctx.x_shape, ctx.x_dtype, ctx.affine = list(x.shape), x.dtype, weight is not None
    _, mean, invstd, reserve, _, _ = output
    ctx.save_for_backward(weight, mean, invstd, reserve, *fields)


def _batch_norm_backward(ctx, grad, *_):
    weight, mean, invstd, reserve, *fields = ctx.saved_tensors
    x_hat = torch.ops.dropit.unpack(fields, ctx.cache, ctx.x_shape, ctx.x_dtype)
    stats = (mean, invstd, reserve if ctx.update else None)
    grads = batch_norm_grads(grad, x_hat, weight, stats, ctx.eps, ctx.needs_input_grad)
    return *grads, None, None, [None] * len(fields), None, None, None


batch_norm_op.register_autograd(_batch_norm_backward, setup_context=_batch_norm_setup)


def batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    cache: InputCache,
) -> Tensor:
    """The traced form of ``norm._BatchNormFunction.apply`` (running statistics updated alike)."""
    fields = traced.pack(cache, x, "conv", x.dtype)
    out, _, _, _, new_mean, new_var = torch.ops.dropit.batch_norm(
        x, weight, bias, running_mean, running_var, fields, momentum, eps, cache.number
    )
    if running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
    return out


@torch.library.custom_op("dropit::group_norm", mutates_args=())
def group_norm_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    fields: list[Tensor],
    groups: int,
    eps: float,
    cache: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Group norm as ``norm._GroupNormFunction`` runs it: (output, mean, rstd)."""
    n, c = x.shape[:2]
    hw = x[0, 0].numel() if n and c else 0
    return torch.ops.aten.native_group_norm.default(x, weight, bias, n, c, hw, groups, eps)


@group_norm_op.register_fake
def _(x, weight, bias, fields, groups, eps, cache):
    n = x.shape[0]
    stats = x.new_empty((n, groups))
    return torch.empty_like(x), stats, stats.clone()


def _group_norm_setup(ctx, inputs, output) -> None:
    x, weight, _, fields, groups, _, cache = inputs
    n, c = x.shape[:2]
    ctx.dims = (n, c, math.prod(x.shape[2:]), groups)
    ctx.cache, ctx.x_shape, ctx.x_dtype = cache, list(x.shape), x.dtype
    ctx.affine = weight is not None
    ctx.save_for_backward(weight, output[1], output[2], *fields)


def _group_norm_backward(ctx, grad, *_):
    weight, mean, rstd, *fields = ctx.saved_tensors
    x_hat = torch.ops.dropit.unpack(fields, ctx.cache, ctx.x_shape, ctx.x_dtype)
    grads = group_norm_grads(grad, x_hat, weight, mean, rstd, ctx.dims, ctx.needs_input_grad)
    return *grads, [None] * len(fields), None, None, None


group_norm_op.register_autograd(_group_norm_backward, setup_context=_group_norm_setup)


def group_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float, cache
) -> Tensor:
    """The traced form of ``norm._GroupNormFunction.apply``."""
    fields = traced.pack(cache, x, "conv", x.dtype)
    return torch.ops.dropit.group_norm(x, weight, bias, fields, groups, eps, cache.number)[0]


# The plain class each DropIT norm converts (exact types: a subclass may compute otherwise).
NORM_CLASSES: dict[type, type] = {
    nn.BatchNorm2d: DropITBatchNorm2d,
    nn.SyncBatchNorm: DropITSyncBatchNorm,
    nn.GroupNorm: DropITGroupNorm,
}

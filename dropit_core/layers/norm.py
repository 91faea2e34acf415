"""Normalisation layers that keep a packed copy of their input for backward: the plain layer's
aten op (output and statistics bit for bit), its backward on the rebuilt input (docs/dropit.md,
"Normalisation layers and max-pools"). ``SyncBatchNorm`` across processes runs torch's own
function, its saved input packed by a saved-tensor hook.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dropit_core.formats.packed import Packed, refuse_double_backward
from dropit_core.layers import library
from dropit_core.layers.cache import Grads, InputCache, keep_packed, kept_packed


def _batch_norm_forward(x, weight, bias, running_mean, running_var, momentum, eps):
    """(output, mean, invstd, reserve) of training-mode batch norm, the op ``F.batch_norm`` runs
    (running statistics updated in place); without them the native op, and no reserve (None)."""
    if running_mean is None:
        out, mean, invstd = torch.ops.aten.native_batch_norm.default(
            x, weight, bias, None, None, True, momentum, eps
        )
        return out, mean, invstd, None
    return torch.ops.aten._batch_norm_with_update.default(
        x, weight, bias, running_mean, running_var, momentum, eps
    )


def _group_norm_forward(x, weight, bias, groups, eps):
    """((output, mean, rstd), dims) of aten's group norm; dims: (N, C, HxW, groups)."""
    dims = (*x.shape[:2], math.prod(x.shape[2:]), groups)
    return torch.ops.aten.native_group_norm.default(x, weight, bias, *dims, eps), dims


class _BatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm (aten's, as ``F.batch_norm`` dispatches it) with a packed input."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, cache):
        ctx.eps = eps
        out, *stats = _batch_norm_forward(x, weight, bias, running_mean, running_var, momentum, eps)
        keep_packed(ctx, cache, cache.pack(x, "conv"), weight, *stats)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight, *stats), packed = kept_packed(ctx)  # stats: mean, invstd, reserve (or None)
        x_hat = ctx.cache.unpack(packed)
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
    """(input, weight, bias gradients) of training-mode batch norm from its rebuilt input."""
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
        (out, mean, rstd), ctx.dims = _group_norm_forward(x, weight, bias, groups, eps)
        keep_packed(ctx, cache, cache.pack(x, "conv"), weight, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight, mean, rstd), packed = kept_packed(ctx)
        x_hat = ctx.cache.unpack(packed)
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
    """(input, weight, bias gradients) of group norm from its rebuilt input; dims: N, C, HxW, G."""
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


def _traced(cache: InputCache) -> bool:
    """Whether to run the traced operator (compiling, a traceable strategy), not the Function."""
    return torch.compiler.is_compiling() and library.traceable(cache)


def _batch_norm(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    module._check_input_dim(x)
    F._verify_batch_size(x.size())  # one value per channel: no variance, as the plain layer
    factor = _momentum(module)
    stats = (module.running_mean, module.running_var) if module.track_running_stats else (None,) * 2
    run = batch_norm if _traced(module.dropit_cache) else _BatchNormFunction.apply
    return run(x, module.weight, module.bias, *stats, factor, module.eps, module.dropit_cache)


class _NormLayer:
    """The forward of a DropIT norm, a base before its plain class."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Batch statistics with a graph to keep: otherwise the plain layer, untouched (an empty
        # batch, e.g. a mask head without positive RoIs, keeps nothing either way).
        if self.training and torch.is_grad_enabled() and x.requires_grad and x.numel() > 0:
            return self.dropit_forward(x)
        return super().forward(x)


class DropITBatchNorm2d(_NormLayer, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that keeps a packed copy of its input for backward."""

    dropit_forward = _batch_norm


class DropITSyncBatchNorm(_NormLayer, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` that keeps a packed copy of its input for backward."""

    def dropit_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _synchronised(self):
            return _batch_norm(self, x)
        # Across processes: torch's own function (its backward all-reduces), its input packed.
        with _pack_saved(self.dropit_cache, x):
            return nn.SyncBatchNorm.forward(self, x)


def _synchronised(module: nn.SyncBatchNorm) -> bool:
    """Whether ``nn.SyncBatchNorm.forward`` would reduce across processes (world size > 1)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(module.process_group or dist.group.WORLD) > 1


class _pack_saved(torch.autograd.graph.saved_tensors_hooks):
    """Pack the one saved tensor shaped like ``x`` (the norm's input); leave the rest as it is."""

    def __init__(self, cache: InputCache, x: torch.Tensor) -> None:
        def pack(t: torch.Tensor):
            return cache.pack(t, "conv") if t.shape == x.shape and t.is_floating_point() else t

        def unpack(saved) -> torch.Tensor:
            if not isinstance(saved, Packed):
                return saved
            refuse_double_backward()
            cache.end_forward()  # a backward has begun: this forward's packs are no more shared
            return cache.unpack(saved)

        super().__init__(pack, unpack)


class DropITGroupNorm(_NormLayer, nn.GroupNorm):
    """``nn.GroupNorm`` that keeps a packed copy of its input for backward."""

    def dropit_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            # CUDA autocast runs group_norm in fp32 (the plain layer's output dtype): cast outside
            # the Function, as autocast would, so that autograd sees the cast.
            x = x.float()
        run = group_norm if _traced(self.dropit_cache) else _GroupNormFunction.apply
        return run(x, self.weight, self.bias, self.num_groups, self.eps, self.dropit_cache)


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
    """``_BatchNormFunction``'s batch norm: (output, mean, invstd, reserve, the updated running
    mean and variance; the last three empty without them), updated in copies that the caller
    writes back (an operator with an autograd formula mutates nothing)."""
    if running_mean is not None:
        running_mean, running_var = running_mean.clone(), running_var.clone()
    *outs, reserve = _batch_norm_forward(x, weight, bias, running_mean, running_var, momentum, eps)
    if reserve is None:
        reserve, running_mean, running_var = (x.new_empty(0) for _ in range(3))
    return *outs, reserve, running_mean, running_var


@batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, fields, momentum, eps, cache):
    stats = x.new_empty(x.shape[1], dtype=torch.float32)
    if running_mean is None:
        rest = [x.new_empty(0) for _ in range(3)]
    else:
        reserve = x.new_empty(0, dtype=torch.uint8)
        rest = [reserve, torch.empty_like(running_mean), torch.empty_like(running_var)]
    return torch.empty_like(x), stats, stats.clone(), *rest


def _batch_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, running_mean, _, fields, _, eps, cache = inputs
    ctx.eps, ctx.cache, ctx.update = eps, cache, running_mean is not None
    ctx.x_shape, ctx.x_dtype = list(x.shape), x.dtype
    ctx.save_for_backward(weight, *output[1:4], *fields)  # mean, invstd, reserve


def _batch_norm_backward(ctx, grad, *_):
    weight, mean, invstd, reserve, *fields = ctx.saved_tensors
    x_hat = library.rebuilt(ctx, fields).whole()
    stats = (mean, invstd, reserve if ctx.update else None)
    grads = batch_norm_grads(grad, x_hat, weight, stats, ctx.eps, ctx.needs_input_grad)
    return *grads, None, None, [None] * len(fields), None, None, None


batch_norm_op.register_autograd(_batch_norm_backward, setup_context=_batch_norm_setup)


def batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, cache) -> Tensor:
    """The traced ``_BatchNormFunction.apply`` (running statistics alike), typed by its operator."""
    fields = library.pack(cache, x, "conv", x.dtype)
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
    return _group_norm_forward(x, weight, bias, groups, eps)[0]


@group_norm_op.register_fake
def _(x, weight, bias, fields, groups, eps, cache):
    stats = x.new_empty((x.shape[0], groups))
    return torch.empty_like(x), stats, stats.clone()


def _group_norm_setup(ctx, inputs, output) -> None:
    x, weight, _, fields, groups, _, cache = inputs
    ctx.dims = (*x.shape[:2], math.prod(x.shape[2:]), groups)
    ctx.cache, ctx.x_shape, ctx.x_dtype = cache, list(x.shape), x.dtype
    ctx.save_for_backward(weight, output[1], output[2], *fields)


def _group_norm_backward(ctx, grad, *_):
    weight, mean, rstd, *fields = ctx.saved_tensors
    x_hat = library.rebuilt(ctx, fields).whole()
    grads = group_norm_grads(grad, x_hat, weight, mean, rstd, ctx.dims, ctx.needs_input_grad)
    return *grads, [None] * len(fields), None, None, None


group_norm_op.register_autograd(_group_norm_backward, setup_context=_group_norm_setup)


def group_norm(x, weight, bias, groups, eps, cache) -> Tensor:
    """The traced form of ``_GroupNormFunction.apply``, its arguments typed by the operator."""
    fields = library.pack(cache, x, "conv", x.dtype)
    return torch.ops.dropit.group_norm(x, weight, bias, fields, groups, eps, cache.number)[0]


# The plain class each DropIT norm converts (exact types: a subclass may compute otherwise).
NORM_CLASSES: dict[type, type] = {
    nn.BatchNorm2d: DropITBatchNorm2d,
    nn.SyncBatchNorm: DropITSyncBatchNorm,
    nn.GroupNorm: DropITGroupNorm,
}

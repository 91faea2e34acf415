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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dropit_core.formats.packed import Packed, refuse_double_backward, tag_pack
from dropit_core.layers import library as traced
from dropit_core.layers.functions import InputCache


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
        need = list(ctx.needs_input_grad[:3])
        grad = grad.contiguous()
        if not ctx.update:
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward.default(
                grad, x_hat, weight, None, None, mean, invstd, True, ctx.eps, need
            )
            return gx, gw, gb, None, None, None, None, None
        if weight is None:  # the op wants a weight even without affine parameters
            weight = torch.ones(ctx.channels, device=grad.device, dtype=torch.float32)
            need[1] = need[2] = False
        gx, gw, gb = torch.ops.aten.batch_norm_backward.default(
            grad, x_hat, weight, None, None, mean, invstd, True, ctx.eps, need, reserve
        )
        return gx, gw, gb, None, None, None, None, None


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
        need = list(ctx.needs_input_grad[:3])
        if weight is None:
            need[1] = need[2] = False
        gx, gw, gb = torch.ops.aten.native_group_norm_backward.default(
            grad.contiguous(), x_hat, mean, rstd, weight, *ctx.dims, need
        )
        return gx, gw, gb, None, None, None


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
    batch_norm = traced.batch_norm if compiling else _BatchNormFunction.apply
    return batch_norm(
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
            return traced.group_norm(
                x, self.weight, self.bias, self.num_groups, self.eps, self.dropit_cache
            )
        return _GroupNormFunction.apply(
            x, self.weight, self.bias, self.num_groups, self.eps, self.dropit_cache
        )


# The plain class each DropIT norm converts (exact types: a subclass may compute otherwise).
NORM_CLASSES: dict[type, type] = {
    nn.BatchNorm2d: DropITBatchNorm2d,
    nn.SyncBatchNorm: DropITSyncBatchNorm,
    nn.GroupNorm: DropITGroupNorm,
}

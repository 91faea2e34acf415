"""A FrozenBatchNorm2d that keeps its input's dtype under autocast: torchvision's computes with
fp32 scale and bias, so every backbone activation leaves it in fp32 (and the next conv keeps its
own narrow copy). This one casts them to the input's dtype first, as detectron2's does: bit for
bit torchvision's in fp32, with the same buffers and state_dict keys.
"""

from __future__ import annotations

import torch
from torch import nn

# The buffers that make a module a frozen batch norm (torchvision's and ours).
_BUFFERS = ("weight", "bias", "running_mean", "running_var")


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine; the output keeps the input's dtype."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in zip(_BUFFERS, (1.0, 0.0, 0.0, 1.0), strict=True):  # torchvision's init
            self.register_buffer(name, torch.full((num_features,), fill))

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        # ImageNet files of BatchNorm models carry a counter a frozen norm has no use for
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x * scale + bias`` per channel in ``x``'s dtype; scale and bias are torchvision's fp32
        expressions, so that an fp32 input gives its bits."""
        w, b, rv, rm = (
            t.reshape(1, -1, 1, 1)
            for t in (self.weight, self.bias, self.running_var, self.running_mean)
        )
        scale = w * (rv + self.eps).rsqrt()
        bias = b - rm * scale
        # In place into the product (nothing else reads it): one map fewer alive, same roundings
        return (x * scale.to(x.dtype)).add_(bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _torchvision_norm(module: nn.Module) -> bool:
    """Whether ``module`` is torchvision's frozen batch norm (recognised without importing
    torchvision: its class name and buffers), not this module's."""
    buffers = dict(module.named_buffers(recurse=False))
    return (
        type(module).__name__ == "FrozenBatchNorm2d"
        and not isinstance(module, FrozenBatchNorm2d)
        and all(name in buffers for name in _BUFFERS)
        and not any(True for _ in module.parameters(recurse=False))
    )


def lean_frozen_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every torchvision ``FrozenBatchNorm2d`` of ``model`` by :class:`FrozenBatchNorm2d`
    in place, sharing its buffers; returns ``model`` (a new module if it is itself one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"lean_frozen_batchnorm takes an nn.Module, got {type(model).__name__}")
    if _torchvision_norm(model):
        return _lean(model)
    for name, child in list(model.named_children()):
        if _torchvision_norm(child):
            setattr(model, name, _lean(child))
        else:
            lean_frozen_batchnorm(child)
    return model


def _lean(module: nn.Module) -> FrozenBatchNorm2d:
    """The lean norm holding ``module``'s own buffer tensors (same device, dtype, storage)."""
    lean = FrozenBatchNorm2d(module.weight.numel(), eps=module.eps)
    for name in _BUFFERS:
        setattr(lean, name, getattr(module, name))  # a tensor assigned to a buffer stays one
    lean.train(module.training)
    return lean

"""torchvision's FeaturePyramidNetwork with its top-down path kept in the features' dtype.

CUDA autocast runs ``F.interpolate`` in fp32 (upsampling is on its fp32 list), so in
torchvision's FPN under AMP the upsampled map, and its sum with the lateral, are fp32 at every
level: on an H200 at 8 images of 800 px the two largest blocks alive at the training step's
peak were these fp32 maps at P2 (docs/gpu.md, docs/results/gpu_h200/probe_memory.log). CPU
autocast keeps bf16 there, so nothing changes on the CPU.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork


class LeanFeaturePyramidNetwork(FeaturePyramidNetwork):
    """The same modules, weights and ``state_dict`` keys as torchvision's FPN; the nearest
    upsample of the top-down path runs outside autocast, on the map as it is.

    Nearest upsampling copies values, so the upsampled map holds the same numbers in the
    features' dtype; the lateral sum is then an fp16/bf16 add, as every other add under
    autocast. In fp32 and under CPU autocast the outputs are torchvision's bit for bit; under
    CUDA autocast each level's sum is rounded to fp16 where torchvision carries it in fp32.
    """

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        names = list(x)
        feats = list(x.values())
        last_inner = self.get_result_from_inner_blocks(feats[-1], -1)
        results = [self.get_result_from_layer_blocks(last_inner, -1)]
        for idx in range(len(feats) - 2, -1, -1):
            lateral = self.get_result_from_inner_blocks(feats[idx], idx)
            with torch.autocast(lateral.device.type, enabled=False):
                top_down = F.interpolate(last_inner, size=lateral.shape[-2:], mode="nearest")
            last_inner = lateral + top_down
            results.insert(0, self.get_result_from_layer_blocks(last_inner, idx))
        if self.extra_blocks is not None:
            results, names = self.extra_blocks(results, feats, names)
        return OrderedDict(zip(names, results, strict=True))


def lean_fpn(model: nn.Module) -> nn.Module:
    """Make every torchvision ``FeaturePyramidNetwork`` in ``model`` lean, in place (the same
    modules and parameters: only the forward changes); returns the model."""
    for module in model.modules():
        if type(module) is FeaturePyramidNetwork:
            module.__class__ = LeanFeaturePyramidNetwork
    return model

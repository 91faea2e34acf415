"""Box head with ReLU modules, so that module-level tools (DropIT) can see its activations."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


class MLPHead(nn.Sequential):
    """Drop-in for torchvision's TwoMLPHead (same fc6/fc7 state_dict keys) using nn.ReLU modules:
    flatten, fc6, relu6, fc7, relu7. A Sequential, so that DropIT reads from the structure what
    reads each ReLU's output (relu7's: the box predictor, dropit_core.readers)."""

    def __init__(self, in_channels: int, representation_size: int) -> None:
        super().__init__(
            OrderedDict(
                flatten=nn.Flatten(start_dim=1),
                fc6=nn.Linear(in_channels, representation_size),
                relu6=nn.ReLU(),
                fc7=nn.Linear(representation_size, representation_size),
                relu7=nn.ReLU(),
            )
        )
